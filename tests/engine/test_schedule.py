"""The schedule state machine, driven by a simulated copy engine: a slot holds a group's id."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightstream.engine.schedule import Schedule


class SimulatedSlots:
    """Executes a schedule's decisions; `slots[s]` is the group whose bytes slot s really holds."""

    def __init__(self, n_groups: int, n_slots: int):
        self.schedule = Schedule(n_groups, n_slots)
        self.slots = [None] * n_slots
        self.hits = 0
        self.issued: list[int] = []  # groups whose copies releases started, in order
        self.computing: int | None = None  # the slot a block is reading between its wait and release

    def wait(self, g: int, capturing: bool = False) -> None:
        plan = self.schedule.on_wait(g, capturing)
        for s, group in plan.copies:
            self.slots[s] = group
        assert self.slots[plan.slot] == g, "stale weights"
        self.hits += plan.hit
        self.computing = plan.slot

    def release(self, g: int, capturing: bool = False):
        plan = self.schedule.on_release(g, capturing)
        self.computing = None
        for slot, group in plan.copies:
            self.slots[slot] = group
        self.issued += [group for _, group in plan.copies]
        return plan

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
    assert sim.schedule.misses == 0 and sim.schedule.prologues == 1  # later forwards start prefetched
    if n_groups > n_slots:  # every group once a forward, and the next forward's first groups
        assert sim.schedule.copies == 3 * n_groups + n_slots
        assert sim.hits == 3 * n_groups - 1  # every wait but the first found its group staged
    else:  # every group has a slot of its own: copied once, trusted afterwards
        assert sim.schedule.copies == n_groups


@given(n_groups=st.integers(1, 12), n_slots=st.integers(1, 3), data=st.data())
def test_any_call_order_computes_with_the_right_group(n_groups, n_slots, data):
    n_slots = min(n_slots, n_groups)
    sim = SimulatedSlots(n_groups, n_slots)
    calls = data.draw(st.lists(st.integers(0, n_groups - 1), max_size=60))
    for g in calls:
        sim.wait(g)  # asserts the slot holds g
        if data.draw(st.booleans()):
            plan = sim.release(g)
            assert all(s == sim.schedule.slot(group) for s, group in plan.copies)  # each into its own slot
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


def test_a_pass_that_begins_elsewhere_is_a_prologue_and_repeated_passes_start_prefetched():
    """An encoder-decoder generate: the encoder pass once, then decoder passes. The first decoder step
    enters at group 4, not where the last forward's prefetch expected (group 0): a new pass, not a
    miss. Every later decoder step finds its first groups staged by the step before; a second
    generate's encoder is again a new pass."""
    sim = SimulatedSlots(8, 2)  # groups 0-3 encoder, 4-7 decoder
    sim.forward(range(8))  # encoder, then the first decoder step
    for _ in range(5):
        sim.forward(range(4, 8))
    assert sim.schedule.misses == 0
    assert sim.schedule.prologues == 2
    assert sim.slots == [4, 5]  # the last step's releases staged the next step's first groups
    sim.forward(range(8))  # the next generate
    assert sim.schedule.misses == 0 and sim.schedule.prologues == 3


@pytest.mark.parametrize("n_groups, n_slots", [(3, 1), (5, 2), (6, 2)])
def test_a_captured_pass_copies_nothing_of_the_next_forward_and_ends_joined(n_groups, n_slots):
    """Inside a capture the prefetch stops where the pass ends, and only there is the release told to
    join; eagerly the last releases start the next forward's copies and never join."""
    sim = SimulatedSlots(n_groups, n_slots)
    sim.forward(range(n_groups))  # eager: learns the order, prefetches the next forward's first groups
    sim.schedule.invalidate()  # a capture begins
    joins = []
    for g in range(n_groups):
        sim.wait(g, capturing=True)
        plan = sim.release(g, capturing=True)
        joins.append(plan.join)
        assert all(group > g for _, group in plan.copies)  # never a copy for the next forward
    assert joins == [False] * (n_groups - 1) + [True]
    sim.schedule.invalidate()  # the capture ends
    eager = [sim.release(g) for g in range(n_groups) if sim.wait(g) is None]
    assert not any(p.join for p in eager)
    assert sorted(sim.slots) == list(range(n_slots))  # staged for the next forward


@pytest.mark.parametrize("n_groups, n_slots", [(5, 2), (7, 2), (7, 3), (8, 3), (6, 2)])
def test_the_next_forwards_copies_start_in_its_run_order(n_groups, n_slots):
    """With an odd number of groups through two slots, the slot of the next forward's second group
    comes free (its last group released) before the slot of its first: that copy waits, so the link
    moves the next forward's groups in the order it needs them."""
    sim = SimulatedSlots(n_groups, n_slots)
    for _ in range(3):
        sim.issued = []
        sim.forward(range(n_groups))
        # the releases copy this forward's later groups, then the next forward's first ones, in order
        assert sim.issued == list(range(n_slots, n_groups)) + list(range(n_slots))
    assert sim.schedule.misses == 0 and sim.schedule.prologues == 1 and not sim.schedule.deferred


@pytest.mark.parametrize("coded", ["raw", "compressed", "mixed"])
@pytest.mark.parametrize("n_groups, n_slots", [(5, 2), (7, 2), (6, 2), (4, 2), (7, 3), (5, 1)])
def test_bytes_cross_the_link_in_run_order_across_forwards(n_groups, n_slots, coded):
    """What the engine moves over the link, as it calls the schedule: each wait's and release's copies
    (a compressed group whose blob was sent ahead moves nothing then), then each copy's `ahead`, which
    a compressed group's blob takes (into a landing buffer; the engine reports it with `sent`) and a
    raw group cannot. Over a loop of forwards the groups' bytes cross in run order, also across
    forwards. With raw and compressed groups mixed ("mixed": even groups raw) a blob copied ahead
    may pass a raw group that waits for its slot inside a forward, but never at the forward's start:
    the next forward's group 1 never overtakes its group 0, which a raw group 0 cannot send ahead."""
    schedule, sent, link = Schedule(n_groups, n_slots), set(), []
    compressed = [coded == "compressed" or (coded == "mixed" and g % 2 == 1) for g in range(n_groups)]

    def started(copies):
        for _, g in copies:
            if g not in sent:
                link.append(g)
            sent.discard(g)
        for _, g in copies:
            nxt = schedule.ahead(g)
            if nxt is not None and compressed[nxt] and nxt not in sent \
                    and schedule.content[schedule.slot(nxt)] != nxt:
                sent.add(nxt)
                schedule.sent(nxt)
                link.append(nxt)

    for _ in range(4):
        for g in range(n_groups):
            started(schedule.on_wait(g).copies)
            started(schedule.on_release(g).copies)
    assert len(link) >= 4 * n_groups
    if coded != "mixed":
        assert link == [i % n_groups for i in range(len(link))], link
    firsts = [i for i, g in enumerate(link) if g == 0]
    seconds = [i for i, g in enumerate(link) if g == 1]
    assert len(firsts) - len(seconds) in (0, 1), link  # the last forward sent the next one's group 0
    assert all(a < b for a, b in zip(firsts[: len(seconds)], seconds, strict=True)), link


@given(n_groups=st.integers(1, 12), n_slots=st.integers(1, 3), data=st.data())
def test_one_run_order_repeated_is_never_an_order_change(n_groups, n_slots, data):
    """Whatever order a model runs its blocks in (each at most once a forward, any subset, any
    permutation), repeating it is never reported as a change of the learned order (the engine warns of
    changes only): its first two forwards may miss against the module-order guess (the second one's
    first wait follows the wrap from the last group to the first, seen then), later ones never miss.
    Running another order afterwards where every successor is as seen before is no change either."""
    n_slots = min(n_slots, n_groups)
    sim = SimulatedSlots(n_groups, n_slots)
    order = data.draw(st.permutations(range(n_groups)))[: data.draw(st.integers(1, n_groups))]
    sim.forward(order)
    sim.forward(order)
    learning = sim.schedule.misses
    for _ in range(3):
        sim.forward(order)
    assert sim.schedule.changes == 0 and sim.schedule.misses == learning
    other = data.draw(st.permutations(order))
    for _ in range(2):
        sim.forward(other)
    # a change needs a successor seen before: the wrap from `order`'s last group into `other`'s first,
    # or a pair of `other` that `order` ran otherwise
    learned = dict(zip(order, order[1:] + order[:1], strict=True))
    seen = zip([order[-1], *other], other, strict=False)
    if all(learned[a] == b for a, b in seen):
        assert sim.schedule.changes == 0
    assert sim.schedule.changes <= sim.schedule.misses
