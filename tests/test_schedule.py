"""The schedule state machine, driven by a simulated copy engine: a slot holds a group's id."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightstream.schedule import Schedule


class SimulatedSlots:
    """Executes a schedule's decisions; `slots[s]` is the group whose bytes slot s really holds."""

    def __init__(self, n_groups: int, n_slots: int):
        self.schedule = Schedule(n_groups, n_slots)
        self.slots = [None] * n_slots

    def wait(self, g: int) -> None:
        plan = self.schedule.on_wait(g)
        for s, group in plan.copies:
            self.slots[s] = group
        assert self.slots[plan.slot] == g, "stale weights"

    def release(self, g: int) -> None:
        plan = self.schedule.on_release(g)
        if plan.copy is not None:
            slot, group = plan.copy
            self.slots[slot] = group

    def forward(self, order) -> None:
        for g in order:
            self.wait(g)
            self.release(g)

    def replay(self) -> None:
        """A captured forward replayed from a CUDA graph: the slots end as an in-order forward leaves
        them (each holds the last group staged in it). A real replay goes through
        torch.cuda.CUDAGraph.replay, which replay.py wraps to invalidate the schedule."""
        n, k = self.schedule.n_groups, self.schedule.n_slots
        self.slots = [max(g for g in range(n) if g % k == s) for s in range(k)]
        self.schedule.invalidate()


@pytest.mark.parametrize("n_groups, n_slots", [(1, 1), (5, 1), (4, 2), (7, 2), (9, 3)])
def test_in_order_forwards_copy_each_group_once_and_never_fetch(n_groups, n_slots):
    sim = SimulatedSlots(n_groups, n_slots)
    for _ in range(3):
        sim.forward(range(n_groups))
    assert sim.schedule.misses == 0
    if n_groups > n_slots:
        assert sim.schedule.prologues == 3 and sim.schedule.copies == 3 * n_groups  # one pass per forward
    else:  # every group has a slot of its own: copied once, trusted afterwards
        assert sim.schedule.prologues == 1 and sim.schedule.copies == n_groups


@given(n_groups=st.integers(1, 12), n_slots=st.integers(1, 3), data=st.data())
def test_any_call_order_computes_with_the_right_group(n_groups, n_slots, data):
    n_slots = min(n_slots, n_groups)
    sim = SimulatedSlots(n_groups, n_slots)
    calls = data.draw(st.lists(st.integers(0, n_groups - 1), max_size=60))
    for g in calls:
        sim.wait(g)  # asserts the slot holds g
        if data.draw(st.booleans()):
            sim.release(g)
    sim.forward(range(n_groups))  # and an ordinary forward afterwards is still right


def test_repeated_block_is_a_miss_then_the_pipeline_recovers():
    sim = SimulatedSlots(6, 2)
    sim.forward([0, 1, 2, 2, 3, 4, 5])
    odd = sim.schedule.misses
    assert odd >= 1  # 2's release had prefetched group 4 into 2's slot
    sim.forward(range(6))  # what it learned (2 after 2) is wrong again once: relearned
    recovered = sim.schedule.misses
    assert recovered <= odd + 1
    sim.forward(range(6))
    assert sim.schedule.misses == recovered and sim.schedule.misses_last_pass == 0


def test_invalid_group_and_slot_counts_are_rejected():
    with pytest.raises(ValueError):
        Schedule(2, 3)
    with pytest.raises(IndexError):
        Schedule(2, 1).on_wait(2)


def test_blocks_called_alone_between_graph_replays_get_their_own_weights():
    """The H200 GPU test test_manual_cuda_graph_replay_is_exact_and_self_contained failed this way with
    a one-slot placement before replays invalidated the schedule: layer 1 called alone (group 0: the
    prologue, and its release prefetches group 1), a replay (the slot ends holding group 2), then
    layer 2 called alone trusted the prefetch."""
    sim = SimulatedSlots(3, 1)
    sim.forward(range(3))  # the forward that was captured
    for g in range(3):
        sim.replay()
        sim.wait(g)  # asserts the slot holds g
        sim.release(g)


def test_the_run_order_is_learned_and_prefetched():
    """A model whose blocks run out of module order (a UNet's mid block registered last): the first
    forward misses, later ones prefetch in run order with no misses."""
    order = [0, 1, 4, 2, 3, 5]
    sim = SimulatedSlots(6, 2)
    sim.forward(order)
    first = sim.schedule.misses
    assert first >= 1
    for _ in range(3):
        sim.forward(order)
    assert sim.schedule.misses == first
    sim.forward(range(6))  # the order changes back: relearned, never stale
    sim.forward(range(6))
    assert sim.schedule.misses_last_pass == 0


def test_each_pass_starts_its_own_prologue():
    """An encoder-decoder generate: the encoder pass once, then decoder passes; each decoder pass
    enters at its first group with a prologue, not a miss."""
    sim = SimulatedSlots(8, 2)  # groups 0-3 encoder, 4-7 decoder
    sim.forward(range(8))  # encoder, then the first decoder step
    for _ in range(5):
        sim.forward(range(4, 8))
    assert sim.schedule.misses == 0
    assert sim.schedule.prologues == 6
