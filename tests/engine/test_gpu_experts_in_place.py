"""Routed experts read in place from pinned host memory, the rest of each block resident, on the GPU:
the model zoo's mixtures of experts in bf16 under a forced placement (not the machine's profile),
outputs `torch.equal` to the resident model eager and replayed from a CUDA graph, and the expert bytes
really leave the GPU. Skipped without CUDA; run with `pytest -m gpu`."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from model_zoo import ZOO
from test_experts_in_place import MOE

import weightstream as ws
from weightstream.engine.guards import live_parameters
from weightstream.placement.plan import placement_of
from weightstream.placement.prepare import prepare
from weightstream.placement.timing import capture_graph

pytestmark = pytest.mark.gpu


def gpu_twin(name: str):
    model, inputs = ZOO[name]()
    ref = model.eval().requires_grad_(False).to("cuda", torch.bfloat16)
    return ref, copy.deepcopy(ref), inputs["input_ids"].cuda()


def experts_in_place(model, streamed_first: bool = False):
    """Offload with every block that holds routed experts reading them in place (the first such block
    streamed instead, with `streamed_first`)."""
    cost = prepare(model, gpu_memory=2**40).cost
    apart = tuple(i for i in range(len(cost.block_bytes)) if cost.experts_apart(i))
    stream = apart[:1] if streamed_first else ()
    uva = tuple(i for i in apart if i not in stream)
    placement = placement_of(cost, stream, len(stream), uva, uva_experts=uva)
    return ws.offload(model, gpu_memory=placement.gpu_bytes, placement=placement)


@pytest.mark.parametrize("streamed_first", [False, True])
@pytest.mark.parametrize("name", MOE)
def test_experts_in_place_are_exact_eagerly_and_leave_the_gpu(name, streamed_first):
    ref, model, ids = gpu_twin(name)
    gc.collect()  # earlier tests' cycles, else freed mid-offload and counted as offloaded
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    handle = experts_in_place(model, streamed_first)
    stats = handle.stats
    assert handle.placement.uva_experts and stats.uva_bytes > 0
    freed = before - torch.cuda.memory_allocated()
    slack = 512 * sum(1 for _ in model.parameters())  # the caching allocator rounds each tensor to 512 B
    assert abs(freed - (stats.streamed_bytes + stats.uva_bytes - stats.staging_bytes)) <= slack
    # the routed expert tensors are zero-copy views of the pinned arena; the rest of the block is on the GPU
    blocks = dict(model.named_modules())
    arena = [handle.engine.arena.region(len(handle.engine.groups) + j) for j in range(len(handle.uva_blocks))]
    spans = [(r.data_ptr(), r.data_ptr() + r.numel()) for r in arena]
    experts = prepare(ref, gpu_memory=2**40).cost.experts
    for name_ in handle.uva_blocks:
        for t in live_parameters(blocks[name_]):
            assert t.is_cuda
            in_arena = any(lo <= t.data_ptr() < hi for lo, hi in spans)
            assert in_arena == (t.dim() == 3 and t.shape[0] == experts), (name_, tuple(t.shape))
    with torch.no_grad():
        for batch in (ids[:, :1], ids):  # a decode step and a short prefill
            assert torch.equal(model(batch, use_cache=False).logits, ref(batch, use_cache=False).logits)
    handle.restore()
    assert all(p.is_cuda for p in model.parameters())


@pytest.mark.parametrize("name", MOE)
def test_experts_in_place_replay_from_a_cuda_graph_exactly(name):
    """Where the resident model itself can be captured (an expert loop that reads which experts were hit
    on the host cannot), the offloaded one replays what the resident one does."""
    ref, model, ids = gpu_twin(name)
    try:
        with torch.no_grad():
            replay_ref = capture_graph(lambda x: ref(x, use_cache=False).logits, ids)
    except RuntimeError as err:
        pytest.skip(f"the resident {name} cannot be captured in a CUDA graph: {str(err).splitlines()[0]}")
    handle = experts_in_place(model)
    with torch.no_grad():
        replay_model = capture_graph(lambda x: model(x, use_cache=False).logits, ids)
    other = torch.randint(0, 128, ids.shape, generator=torch.Generator().manual_seed(1)).cuda()
    replay_ref.static_in.copy_(other)
    replay_model.static_in.copy_(other)
    out_ref, out_model = replay_ref(), replay_model()
    torch.cuda.synchronize()
    assert torch.equal(out_model, out_ref)
    handle.restore()


def test_counting_experts_needs_no_host_synchronization():
    """count_experts()'s hook on the GPU is device-side work only: torch's sync debug mode raises on a
    synchronizing call."""
    _, model, _ = gpu_twin("mixtral")
    handle = experts_in_place(model)
    handle.count_experts()
    router, _ = handle._experts.sites[0]
    with torch.no_grad():
        out = router(torch.randn(4, router.weight.shape[1], device="cuda", dtype=torch.bfloat16))
        torch.cuda.set_sync_debug_mode("error")
        try:
            handle._experts._hook(0)(router, (), out)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    handle.restore()


def test_expert_counts_follow_graph_replays():
    """CUDA graph replays, which run no Python, are counted as the eager forward is."""
    _, model, ids = gpu_twin("mixtral")
    handle = experts_in_place(model)
    handle.count_experts()
    with torch.no_grad():
        eager = model(ids, use_cache=False).logits
    per_forward = handle.stats.expert_bytes_per_token
    assert per_forward and per_forward > 0
    with torch.no_grad():
        replay = capture_graph(lambda x: model(x, use_cache=False).logits, ids)  # 2 warm-up calls, 1 captured
    handle.count_experts()
    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    assert torch.equal(replay(), eager)
    # each replay reached the experts the eager forward did: the same bytes per token
    assert handle.stats.expert_bytes_per_token == pytest.approx(per_forward)
    handle.restore()
