"""Exact under every call order: a fuzzer over whole, partial and out-of-order forwards, single blocks,
repeated blocks, blocks that raise, simulated CUDA graph replays and threads, on random placements.

The CPU backend runs the real schedule (the same `StreamEngine.wait/release` the GPU runs). A
simulated replay does what a real one does to the engine: the slots' bytes change behind the host's
back, and `replay.notify()` runs (a real replay calls it through the wrapped `CUDAGraph.replay`).
"""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import weightstream as ws
from weightstream.engine import replay
from weightstream.placement.plan import landing_options, placement_of
from weightstream.placement.prepare import prepare

DIM = 8
N_BLOCKS = 5


class OneStreamBlock(nn.Module):
    """x -> x: a transformer-like block with a streamed buffer and a resident non-persistent one."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim, bias=False)
        self.register_buffer("scale", torch.rand(dim))
        self.register_buffer("cache", torch.zeros(dim), persistent=False)
        self.fail = False

    def forward(self, x):
        h = torch.tanh(self.fc(x)) * self.scale
        if self.fail:
            raise RuntimeError("this block failed on purpose")
        return self.out(h) + x


class TwoStreamBlock(nn.Module):
    """(x, context, temb=) -> (context, x): a diffusion-transformer-like block that reads weights on
    its text stream and its time-embedding modulation too, and returns both streams."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.x_proj = nn.Linear(dim, dim)
        self.c_proj = nn.Linear(dim, dim)
        self.mod = nn.Linear(dim, 2 * dim)
        self.fail = False

    def forward(self, x, context, *, temb):
        shift, scale = self.mod(temb).chunk(2, dim=-1)
        x = torch.tanh(self.x_proj(x)) * (1 + scale) + shift + x
        if self.fail:
            raise RuntimeError("this block failed on purpose")
        return torch.sin(self.c_proj(context)) + context, x


class Model(nn.Module):
    """A stem, N blocks run in `self.order`, a head; `kind` picks the block signature, `dim` the
    width (wide enough in bf16 and its groups compress)."""

    def __init__(self, kind: str, dim: int = DIM) -> None:
        super().__init__()
        self.kind = kind
        self.dim = dim
        self.stem = nn.Linear(dim, dim)
        block = OneStreamBlock if kind == "one" else TwoStreamBlock
        self.layers = nn.ModuleList(block(dim) for _ in range(N_BLOCKS))
        self.order = list(range(N_BLOCKS))

    def run_block(self, i: int, state: dict) -> dict:
        """Call block i on `state` (the activations between blocks)."""
        if self.kind == "one":
            return {"x": self.layers[i](state["x"])}
        context, x = self.layers[i](state["x"], state["context"], temb=state["temb"])
        return {"x": x, "context": context, "temb": state["temb"]}

    def start(self, inp: torch.Tensor) -> dict:
        x = self.stem(inp)
        if self.kind == "one":
            return {"x": x}
        return {"x": x, "context": inp.flip(0), "temb": inp.mean(0, keepdim=True).expand_as(inp)}

    def forward(self, inp):
        state = self.start(inp)
        for i in self.order:
            state = self.run_block(i, state)
        return sum(v.sum(0) for v in state.values())


CODED_DIM = 128  # bf16 blocks this wide compress (the codec's chunks are 2560 values)


def twin(kind: str, seed: int = 0, coded: bool = False):
    """(reference, copy to offload); `coded`: bf16 and CODED_DIM wide, so groups can stream compressed."""
    torch.manual_seed(seed)
    ref = Model(kind, CODED_DIM if coded else DIM).eval().requires_grad_(False)
    if coded:
        ref = ref.to(torch.bfloat16)
    return ref, copy.deepcopy(ref)


def forced(model: nn.Module, streamed, n_slots: int, uva=(), part: int = 0,
           landing: int | None = None, check: bool | None = None) -> ws.OffloadHandle:
    """Offload on the CPU backend with exactly this placement; `landing`: compressed, through that
    many landing buffers. `check`: as for offload (False where a test plants stale bytes on purpose,
    which check mode would refuse)."""
    cost = prepare(model, gpu_memory=2**40, device="cpu", compress=landing is not None).cost
    placement = placement_of(cost, tuple(streamed), n_slots, tuple(uva), part,
                             compressed=landing is not None, landing_buffers=landing)
    assert placement is not None and placement.n_landing == (landing or 0)
    return ws.offload(model, gpu_memory=placement.gpu_bytes, device="cpu", placement=placement, check=check)


def simulate_replay(handle, garbage: bool, seed: int, notify: bool = True) -> None:
    """What a CUDA graph replay does to the engine: each slot (and landing buffer) ends holding bytes
    the host did not put there (another group's, or noise), and the wrapped replay calls
    replay.notify()."""
    gen = torch.Generator().manual_seed(seed)
    for buffer in getattr(handle.engine.transfer, "landing", []):
        if garbage:
            buffer.copy_(torch.randint(0, 256, buffer.shape, dtype=torch.uint8, generator=gen))
        else:
            g = int(torch.randint(0, handle.stats.groups, (1,), generator=gen))
            blob = handle.engine.arena.region(g)[: buffer.numel()]
            buffer[: blob.numel()].copy_(blob)
    for slot in handle.engine.slots:
        if garbage:
            slot.copy_(torch.randint(0, 256, slot.shape, dtype=torch.uint8, generator=gen))
        else:
            g = int(torch.randint(0, handle.stats.groups, (1,), generator=gen))
            region = handle.engine.arena.region(g)
            slot[: region.numel()].copy_(region)
    if notify:
        replay.notify()


@st.composite
def placements(draw):
    streamed = draw(st.lists(st.integers(0, N_BLOCKS - 1), min_size=1, max_size=N_BLOCKS, unique=True))
    rest = [i for i in range(N_BLOCKS) if i not in streamed]
    uva = draw(st.lists(st.sampled_from(rest), unique=True)) if rest else []
    n_slots = draw(st.integers(1, min(2, len(streamed))))
    part = draw(st.sampled_from([0, 0, 1]))
    return sorted(streamed), n_slots, sorted(uva), part


@st.composite
def coded_placements(draw):
    """Compressed placements: every block streamed (whole), one or two slots, each landing option."""
    streamed = draw(st.lists(st.integers(0, N_BLOCKS - 1), min_size=2, max_size=N_BLOCKS, unique=True))
    n_slots = draw(st.integers(1, 2))
    landing = draw(st.sampled_from(landing_options(n_slots, len(streamed))))
    return sorted(streamed), n_slots, landing


ACTIONS = st.one_of(
    st.tuples(st.just("forward")),
    st.tuples(st.just("partial"), st.integers(0, N_BLOCKS), st.integers(0, N_BLOCKS)),
    st.tuples(st.just("order"), st.permutations(range(N_BLOCKS))),
    st.tuples(st.just("repeat"), st.integers(0, N_BLOCKS - 1)),
    st.tuples(st.just("block"), st.integers(0, N_BLOCKS - 1)),
    st.tuples(st.just("raise"), st.integers(0, N_BLOCKS - 1)),
    st.tuples(st.just("replay"), st.booleans()),
)


def run_action(action, ref: Model, model: Model, handle, step: int) -> None:
    """Run one action on both models; assert the offloaded output equals the resident one."""
    inp = torch.randn(3, model.dim, generator=torch.Generator().manual_seed(step)).to(model.stem.weight.dtype)
    kind = action[0]
    if kind == "replay":
        simulate_replay(handle, action[1], step)
        return
    if kind == "block":
        state = ref.start(inp)
        got, want = model.run_block(action[1], state), ref.run_block(action[1], state)
        assert all(torch.equal(got[k], want[k]) for k in want), f"block {action[1]} alone"
        return
    if kind == "raise":
        model.layers[action[1]].fail = True
        with pytest.raises(RuntimeError, match="on purpose"):
            model(inp)
        model.layers[action[1]].fail = False
        return
    order = list(range(N_BLOCKS))
    if kind == "partial":
        order = order[min(action[1:]) : max(action[1:])]
    elif kind == "order":
        order = list(action[1])
    elif kind == "repeat":
        order = order[: action[1] + 1] + order[action[1] :]
    ref.order = model.order = order
    assert torch.equal(model(inp), ref(inp)), f"{kind} {order}"
    ref.order = model.order = list(range(N_BLOCKS))


@pytest.mark.parametrize("kind", ["one", "two"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(placement=placements(), actions=st.lists(ACTIONS, min_size=1, max_size=12), direct=st.booleans())
def test_every_call_order_is_exact(kind, placement, actions, direct):
    """direct: eager blocks call the engine straight (the default) or through the custom ops, as a
    compiled forward does (`streamed.EAGER_DIRECT`): either way every call order is exact."""
    ref, model = twin(kind)
    streamed, n_slots, uva, part = placement
    handle = forced(model, streamed, n_slots, uva, part)
    ws.engine.streamed.EAGER_DIRECT = direct
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for step, action in enumerate(actions):
                run_action(action, ref, model, handle, step)
            run_action(("forward",), ref, model, handle, len(actions))  # and an ordinary forward after all
    finally:
        ws.engine.streamed.EAGER_DIRECT = True
    handle.restore()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["one", "two"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(placement=coded_placements(), actions=st.lists(ACTIONS, min_size=1, max_size=10))
def test_every_call_order_is_exact_compressed(kind, placement, actions):
    """The same with compressed groups: blobs land in landing buffers (one group ahead of the slot
    where one slot has two), whose bookkeeping a replay must reset like the slots'."""
    ref, model = twin(kind, coded=True)
    streamed, n_slots, landing = placement
    handle = forced(model, streamed, n_slots, landing=landing)
    assert handle.stats.wire_bytes < handle.stats.wire_raw_bytes  # the groups really are compressed
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step, action in enumerate(actions):
            run_action(action, ref, model, handle, step)
        run_action(("forward",), ref, model, handle, len(actions))
    handle.restore()


def test_one_slot_copies_the_next_compressed_group_ahead_and_a_replay_resets_it():
    """With one slot and two landing buffers the blob of the group after next is already in its
    landing buffer when the slot is released; a replay that overwrites the buffers (notified) must
    not leave the engine decoding stale bytes, and unnotified it would (so the fuzzer can see it)."""
    ref, model = twin("one", coded=True)
    handle = forced(model, range(N_BLOCKS), 1, landing=2, check=False)
    landings = handle.engine.transfer.landings
    x = torch.randn(3, CODED_DIM).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
        # N_BLOCKS = 5: block 4's release decoded the next forward's block 0 (its blob landed in
        # buffer 0) and copied block 1's blob ahead into buffer 1
        assert landings.held == [0, 1]
        state = ref.start(x)
        assert torch.equal(model.run_block(0, state)["x"], ref.run_block(0, state)["x"])
        # block 0 found its slot filled; its release decoded 1 and copied 2 ahead
        assert landings.held == [2, 1] and handle.stats.prologues == 1
        blob = handle.engine.arena.region(3)
        handle.engine.transfer.landing[1][: blob.numel()].copy_(blob)  # a replay left block 3's blob there
        handle.engine.schedule.invalidate()  # as if only the slots were forgotten: block 1's blob trusted
        assert not torch.equal(model.run_block(1, state)["x"], ref.run_block(1, state)["x"])
        simulate_replay(handle, garbage=True, seed=1, notify=True)
        assert landings.held == [None, None]
        assert torch.equal(model.run_block(1, state)["x"], ref.run_block(1, state)["x"])


def test_two_slots_copy_the_next_blob_into_the_landing_buffer_just_decoded():
    """With two slots (a landing buffer each) the blob of a slot's next group is copied into its
    buffer as soon as the current group is decoded out of it, before compute frees the slot: after
    block 0 ran, slot 0 holds group 2 (decoded at the release) and buffer 0 already group 4's blob."""
    ref, model = twin("one", coded=True)
    handle = forced(model, range(N_BLOCKS), 2, landing=2)
    landings, transfer = handle.engine.transfer.landings, handle.engine.transfer
    x = torch.randn(3, CODED_DIM).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
        state = ref.start(x)
        assert torch.equal(model.run_block(0, state)["x"], ref.run_block(0, state)["x"])
        assert landings.held == [4, 3] and landings.pending == [True, True]
        blob = handle.engine.arena.region(4)
        assert torch.equal(transfer.landing[0][: blob.numel()], blob)
        assert torch.equal(model(x), ref(x))  # the next forward starts a pass again: exact
    handle.restore()


def test_the_fuzzers_replay_finds_stale_weights_when_replays_go_unseen():
    """Before replays notified the engine, this sequence used a slot a replay had overwritten (the
    H200 bug); with the notification left out, the simulation still shows it, so the fuzzer above
    would have caught it."""
    ref, model = twin("one")
    handle = forced(model, range(N_BLOCKS), 1, check=False)
    inp = torch.randn(3, DIM)
    with torch.no_grad():
        assert torch.equal(model(inp), ref(inp))
        state = ref.start(inp)
        assert torch.equal(model.run_block(0, state)["x"], ref.run_block(0, state)["x"])
        simulate_replay(handle, garbage=True, seed=0, notify=False)
        assert not torch.equal(model.run_block(1, state)["x"], ref.run_block(1, state)["x"])
        simulate_replay(handle, garbage=True, seed=1, notify=True)
        assert torch.equal(model.run_block(1, state)["x"], ref.run_block(1, state)["x"])


def test_in_order_forwards_never_miss_and_later_ones_start_prefetched():
    ref, model = twin("two")
    handle = forced(model, range(N_BLOCKS), 2)
    with torch.no_grad():
        for seed in range(3):
            inp = torch.randn(3, DIM, generator=torch.Generator().manual_seed(seed))
            assert torch.equal(model(inp), ref(inp))
    stats = handle.stats
    # one prologue: each forward's last releases copied the next forward's first groups
    assert (stats.misses, stats.prologues, stats.copies) == (0, 1, 3 * N_BLOCKS + 2)


def test_a_new_run_order_is_learned_within_two_forwards():
    ref, model = twin("one")
    handle = forced(model, range(N_BLOCKS), 2)
    with torch.no_grad():  # the module order, learned: a later order is a change, and warns
        inp = torch.randn(3, DIM, generator=torch.Generator().manual_seed(99))
        assert torch.equal(model(inp), ref(inp))
    ref.order = model.order = [0, 3, 4, 1, 2]
    with torch.no_grad(), pytest.warns(UserWarning, match="out of the learned order"):
        for seed in range(4):
            inp = torch.randn(3, DIM, generator=torch.Generator().manual_seed(seed))
            prologues = handle.stats.prologues
            assert torch.equal(model(inp), ref(inp))
            if seed == 1:  # each transition seen once: the first forward's and the wrap into the next
                learned = handle.stats.misses
    assert learned >= 1 and handle.stats.misses == learned and handle.stats.misses_last_pass == 0
    # the jump back from 4 to 1 stays inside the pass, and the last forward began with its first groups
    # copied by the one before: no prologue, every copy prefetched
    assert handle.stats.prologues == prologues


def test_a_block_that_raises_leaves_the_model_usable_from_any_thread():
    ref, model = twin("one")
    handle = forced(model, range(N_BLOCKS), 1)
    inp = torch.randn(3, DIM)
    model.layers[2].fail = True
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="on purpose"):
            model(inp)
        model.layers[2].fail = False
        out: list[torch.Tensor] = []
        worker = threading.Thread(target=lambda: out.append(model(inp)))
        worker.start()
        worker.join(timeout=60)
        assert not worker.is_alive(), "the engine stayed held by the thread whose block raised"
        assert torch.equal(out[0], ref(inp))
    assert handle.stats.misses == 0


@pytest.mark.parametrize("kind", ["one", "two"])
def test_threads_calling_one_model_at_once_are_exact(kind):
    ref, model = twin(kind)
    forced(model, range(N_BLOCKS), 1)
    inputs = [torch.randn(3, DIM, generator=torch.Generator().manual_seed(s)) for s in range(40)]
    with torch.no_grad():
        want = [ref(x) for x in inputs]
    wrong: list[int] = []
    errors: list[BaseException] = []

    def work(indices):
        try:
            with torch.no_grad():
                for i in indices:
                    if not torch.equal(model(inputs[i]), want[i]):
                        wrong.append(i)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(range(t, 40, 4),)) for t in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors and not wrong


def test_every_registered_engine_takes_each_graph_notification():
    """`replay.notify` reaches every live engine, offloaded models and reference models with the ops at
    their blocks' edges alike (conftest.Boundaries), with the capture-begin notification too (the H200
    GPU tests found the reference engine refusing its `synchronize` argument, 2026-12-05)."""
    from conftest import make_model, with_boundaries

    edges = with_boundaries(make_model("llama"))
    ref, model = twin("one")
    handle = forced(model, range(N_BLOCKS), 2)
    inp = torch.randn(3, DIM)
    with torch.no_grad():
        model(inp)
        replay.notify(capture_begins=True)
        replay.notify()
        assert handle.stats.prologues == 1 and torch.equal(model(inp), ref(inp))
    assert handle.stats.prologues == 2  # the notification forgot the slots: a new pass
    del edges  # alive until here: the registry holds its engine weakly


def test_a_model_with_idle_ops_at_its_edges_runs_eagerly_like_itself():
    """The compiled tests' reference (conftest.with_boundaries) is also called eagerly between graph
    replays on the GPU: its eager forward goes through `ops.eager` and the idle engine's every method
    (an H200 run on 2026-12-05 found `unalias` missing; this runs that path on the CPU), giving the plain
    model's output. An engine lacking a method is refused when registered."""
    from conftest import make_model, with_boundaries

    from weightstream.engine import ops

    ref = make_model("llama")
    edges = with_boundaries(copy.deepcopy(ref))
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        assert torch.equal(edges(ids).logits, ref(ids).logits)

    class NoUnalias:
        def wait(self, group): ...
        def release(self, group): ...
        def abort(self): ...
        def on_graph_event(self, synchronize=False): ...

    with pytest.raises(TypeError, match="lacks unalias"):
        ops.register(NoUnalias())
