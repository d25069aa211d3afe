"""Every call order on the GPU: real CUDA graph replays (torch.cuda.graph, and cudagraph trees under
mode="reduce-overhead") interleaved with single blocks, partial forwards, blocks that raise and whole
eager forwards, on forced one- and two-slot placements (not the machine's profile). Skipped without
CUDA; run with `pytest -m gpu`."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import with_boundaries
from test_call_orders import CODED_DIM, DIM, N_BLOCKS, Model

import weightstream as ws
from weightstream.placement.plan import placement_of
from weightstream.placement.prepare import prepare
from weightstream.placement.timing import capture_graph

pytestmark = pytest.mark.gpu


def gpu_twin(kind: str, edges: bool = False, coded: bool = False):
    """(reference, copy to offload) in bf16 on the GPU (`coded`: wide enough that groups compress).
    With `edges` the reference has the (idle) schedule ops at its block edges, as the compiled
    references must: Inductor fuses a bf16 block's last op with the next block's first in the
    resident graph (docs/exactness.md)."""
    torch.manual_seed(0)
    ref = Model(kind, CODED_DIM if coded else DIM).eval().requires_grad_(False).to("cuda", torch.bfloat16)
    model = copy.deepcopy(ref)
    return (with_boundaries(ref) if edges else ref), model


def forced(model, n_slots: int, landing: int | None = None):
    """Offload with every block streamed through `n_slots` slots; `landing`: compressed, through that
    many landing buffers."""
    cost = prepare(model, gpu_memory=2**40, compress=landing is not None).cost
    placement = placement_of(cost, tuple(range(N_BLOCKS)), n_slots, compressed=landing is not None,
                             landing_buffers=landing)
    assert placement is not None and placement.n_landing == (landing or 0)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    handle = ws.offload(model, gpu_memory=placement.gpu_bytes, placement=placement)
    stats = handle.stats
    freed = before - torch.cuda.memory_allocated()
    assert freed >= stats.streamed_bytes - stats.staging_bytes - 512 * sum(1 for _ in model.parameters())
    return handle


def inp(seed: int, dim: int = DIM) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(3, dim, generator=gen).to("cuda", torch.bfloat16)


def eager_steps(ref, model, step: int) -> None:
    """Between replays: a block alone, a partial forward, a block that raises, a whole forward."""
    x = inp(100 + step, model.dim)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = ref.start(x)
        i = step % N_BLOCKS
        got, want = model.run_block(i, state), ref.run_block(i, state)
        assert all(torch.equal(got[k], want[k]) for k in want), f"block {i} alone"
        ref.order = model.order = list(range(step % 3, N_BLOCKS - 1))
        assert torch.equal(model(x), ref(x)), "partial forward"
        ref.order = model.order = list(range(N_BLOCKS))
        model.layers[(step + 2) % N_BLOCKS].fail = True
        with pytest.raises(RuntimeError, match="on purpose"):
            model(x)
        model.layers[(step + 2) % N_BLOCKS].fail = False
        assert torch.equal(model(x), ref(x)), "whole eager forward"


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize(("n_slots", "landing"), [(1, None), (2, None), (1, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("kind", ["one", "two"])
def test_graph_replays_interleaved_with_eager_calls_are_exact(kind, n_slots, landing, compiled):
    """landing None: raw groups; else compressed, through that many landing buffers (with one slot and
    two, the next group's blob is copied ahead, also inside the captured graph)."""
    ref, model = gpu_twin(kind, edges=compiled, coded=landing is not None)
    handle = forced(model, n_slots, landing)
    if landing is not None:
        assert handle.stats.wire_bytes < handle.stats.wire_raw_bytes
    fref, fmodel = ref, model
    if compiled:
        torch._dynamo.reset()
        fref, fmodel = torch.compile(ref, fullgraph=True), torch.compile(model, fullgraph=True)
    with torch.no_grad():
        eager_steps(ref, model, 0)  # the capture starts from a state eager calls left
        x = inp(0, model.dim)
        replay_ref, replay_model = capture_graph(fref, x), capture_graph(fmodel, x)
    for step in range(1, 6):
        replay_ref.static_in.copy_(inp(step, model.dim))
        replay_model.static_in.copy_(inp(step, model.dim))
        out_ref, out_model = replay_ref(), replay_model()
        torch.cuda.synchronize()
        assert torch.equal(out_model, out_ref), f"replay {step}"
        eager_steps(ref, model, step)
    handle.restore()


def test_a_side_stream_shared_with_another_engine_leaves_captures_intact():
    """torch hands out side streams from a pool of 32 per device, so two engines can get the same one:
    here the other engine's copy stream is this one's. This engine's capture forks that stream but
    not the other engine's decode stream; the capture's end joins every live engine's side streams
    and must skip the unforked one (waiting on it raised cudaErrorStreamCaptureIsolation on the H200
    when the test order made the pool hand out such a pair)."""
    ref, model = gpu_twin("one", coded=True)
    _, other = gpu_twin("one", coded=True)
    handle, handle_other = forced(model, 1, landing=2), forced(other, 1, landing=2)
    handle_other.engine.transfer.stream = handle.engine.transfer.stream
    with torch.no_grad():
        x = inp(0, model.dim)
        replay_ref, replay_model = capture_graph(ref, x), capture_graph(model, x)
        for step in range(1, 4):
            replay_ref.static_in.copy_(inp(step, model.dim))
            replay_model.static_in.copy_(inp(step, model.dim))
            assert torch.equal(replay_model(), replay_ref()), f"replay {step}"
            assert torch.equal(model(inp(step, model.dim)), ref(inp(step, model.dim)))
    handle.restore()
    handle_other.restore()


@pytest.mark.parametrize("kind", ["one", "two"])
def test_reduce_overhead_interleaved_with_eager_calls_is_exact(kind):
    ref, model = gpu_twin(kind, edges=True)
    forced(model, 1)
    torch._dynamo.reset()
    cref = torch.compile(ref, fullgraph=True, mode="reduce-overhead")
    cmodel = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        for step in range(6):
            a = cref(inp(step)).clone()
            b = cmodel(inp(step)).clone()
            assert torch.equal(a, b), f"compiled call {step}"
            eager_steps(ref, model, step)


def test_threads_on_the_gpu_are_exact():
    import threading

    ref, model = gpu_twin("two")
    forced(model, 1)
    inputs = [inp(s) for s in range(24)]
    with torch.no_grad():
        want = [ref(x) for x in inputs]
    wrong: list[int] = []

    def work(indices):
        with torch.no_grad():
            for i in indices:
                out = model(inputs[i])
                torch.cuda.current_stream().synchronize()
                if not torch.equal(out, want[i]):
                    wrong.append(i)

    threads = [threading.Thread(target=work, args=(range(t, 24, 3),)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not wrong


@pytest.mark.parametrize("name", ["t5", "whisper"])
def test_encoder_decoder_generate_on_the_gpu_has_no_misses(name):
    from model_zoo import SEQ2SEQ

    ref, ids = SEQ2SEQ[name]()
    ref = ref.eval().requires_grad_(False).to("cuda", torch.bfloat16)
    model = copy.deepcopy(ref)
    cost = prepare(model, gpu_memory=2**40).cost
    placement = placement_of(cost, tuple(range(len(cost.block_bytes))), 2)
    handle = ws.offload(model, gpu_memory=placement.gpu_bytes, placement=placement)
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            src = ids.cuda() if name == "t5" else ids.to("cuda", torch.bfloat16)
            assert torch.equal(model.generate(src, **kwargs), ref.generate(src, **kwargs))
    assert handle.stats.misses == 0


@pytest.mark.parametrize("n_slots", [1, 2])
def test_a_captured_block_or_partial_forward_replays_exactly(n_slots):
    """A capture of part of a pass (one block; blocks 1-3) ends with its copies joined, and its replays
    interleave with whole eager forwards."""
    ref, model = gpu_twin("one")
    forced(model, n_slots)

    def part(m):
        return lambda x: m.layers[3](m.layers[2](m.layers[1](x)))

    with torch.no_grad():
        one = capture_graph(lambda x: model.layers[2](x), inp(0))
        three = capture_graph(part(model), inp(0))
        for step in range(1, 4):
            x = inp(step)
            one.static_in.copy_(x)
            three.static_in.copy_(x)
            assert torch.equal(one(), ref.layers[2](x))
            assert torch.equal(model(x), ref(x))
            assert torch.equal(three(), part(ref)(x))
            assert torch.equal(model.layers[4](x), ref.layers[4](x))
