"""The GPU expert cache on the GPU: the model zoo's mixtures of experts in bf16 under a forced placement
(every block's routed experts read in place behind a cache, not the machine's profile), outputs
`torch.equal` to the resident model eagerly and replayed from a CUDA graph while the cache fills and
replaces, the expert bytes off the GPU, the Triton row copy equal to its torch reference (from pinned
host memory too) and no host synchronization in a gather. Skipped without CUDA; run with
`pytest -m gpu`."""

from __future__ import annotations

import copy
import gc
import warnings

import pytest
import torch
from model_zoo import ZOO
from test_expert_cache import CACHED

import weightstream as ws
from weightstream.engine.expert_cache import copy_rows_reference
from weightstream.placement.plan import placement_of
from weightstream.placement.prepare import prepare
from weightstream.placement.timing import capture_graph

pytestmark = pytest.mark.gpu


def gpu_twin(name: str):
    model, inputs = ZOO[name]()
    ref = model.eval().requires_grad_(False).to("cuda", torch.bfloat16)
    return ref, copy.deepcopy(ref), inputs["input_ids"].cuda()


def cached(model, slots: int = 2, fill_calls: int = 2):
    """Offload with every block that holds routed experts reading them in place behind a cache."""
    cost = prepare(model, gpu_memory=2**40).cost
    apart = tuple(i for i in range(len(cost.block_bytes)) if cost.experts_apart(i))
    placement = placement_of(cost, (), 0, apart, uva_experts=apart, expert_cache=apart, expert_slots=slots)
    handle = ws.offload(model, gpu_memory=placement.gpu_bytes, placement=placement)
    assert handle.expert_caches is not None and len(handle.expert_caches.blocks) == len(apart)
    for cache in handle.expert_caches.caches:
        cache.table.fill_calls = fill_calls
    return handle


def other_ids(ids: torch.Tensor, seed: int) -> torch.Tensor:
    return torch.randint(0, 128, ids.shape, generator=torch.Generator().manual_seed(seed)).cuda()


@pytest.mark.parametrize("name", CACHED)
def test_cached_experts_are_exact_eagerly_and_their_bytes_leave_the_gpu(name):
    ref, model, ids = gpu_twin(name)
    gc.collect()  # earlier tests' cycles, else freed mid-offload and counted as offloaded
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    handle = cached(model)
    stats = handle.stats
    assert stats.uva_bytes > 0 and stats.cache_bytes == handle.placement.cache_bytes
    freed = before - torch.cuda.memory_allocated()
    # the caching allocator rounds each tensor to 512 B: parameters, and each table's nine small tensors
    slack = 512 * sum(1 for _ in model.parameters()) + 512 * 9 * len(handle.expert_caches.caches)
    # the routed experts left; their pools and shared work buffers came (tables: a few hundred bytes)
    assert abs(freed - (stats.uva_bytes - stats.cache_bytes)) <= slack, (freed, stats)
    assert stats.cache_bytes < stats.uva_bytes
    with torch.no_grad():
        for seed in range(5):  # fill, then replace
            batch = other_ids(ids, seed)
            for x in (batch[:, :1], batch):  # a decode step and a short prefill
                assert torch.equal(model(x, use_cache=False).logits, ref(x, use_cache=False).logits), seed
    rate = handle.stats.expert_hit_rate
    assert rate is not None and rate > 0
    handle.restore()
    assert all(p.is_cuda for p in model.parameters())


@pytest.mark.parametrize("name", CACHED)
def test_cached_experts_replay_from_a_cuda_graph_exactly_and_the_cache_moves_with_the_replays(name):
    """Where the resident model itself can be captured: the captured gather updates the table and copies
    rows at every replay (no Python runs), and each replay equals the resident one on new inputs. One
    token a call, so each call reaches few experts and the one-slot caches change."""
    ref, model, ids = gpu_twin(name)
    ids = ids[:, :1]
    try:
        with torch.no_grad():
            replay_ref = capture_graph(lambda x: ref(x, use_cache=False).logits, ids)
    except RuntimeError as err:
        pytest.skip(f"the resident {name} cannot be captured in a CUDA graph: {str(err).splitlines()[0]}")
    handle = cached(model, slots=1, fill_calls=1)
    with torch.no_grad():
        replay_model = capture_graph(lambda x: model(x, use_cache=False).logits, ids)
    calls = handle.expert_caches.counts()["calls"]
    tables = []
    for seed in range(4):
        batch = other_ids(ids, seed)
        replay_ref.static_in.copy_(batch)
        replay_model.static_in.copy_(batch)
        out_ref, out_model = replay_ref(), replay_model()
        torch.cuda.synchronize()
        assert torch.equal(out_model, out_ref), seed
        tables.append([c.table.table.tolist() for c in handle.expert_caches.caches])
    layers = len(handle.expert_caches.caches)
    assert handle.expert_caches.counts()["calls"] == calls + 4 * layers
    assert len({str(t) for t in tables}) > 1, "the replays never changed a table"
    with torch.no_grad():  # and eagerly after the replays, from the tables they left
        assert torch.equal(model(ids, use_cache=False).logits, ref(ids, use_cache=False).logits)
    handle.restore()


def test_eager_decode_through_the_cache_warns_once_and_a_captured_one_never():
    """Real forwards on the GPU: 32 eager ones warn once (the cache's launches cost more than it saves
    eagerly); a model captured in a CUDA graph after its warm-up never warns, however often it then
    runs (replays run no Python)."""
    from weightstream.engine.expert_cache import EAGER_WARN_CALLS

    _, model, ids = gpu_twin("qwen3_moe")
    handle = cached(model)
    with torch.no_grad(), pytest.warns(UserWarning, match="ran .* forwards eagerly") as seen:
        for _ in range(EAGER_WARN_CALLS + 4):
            model(ids[:, :1], use_cache=False)
    assert sum("forwards eagerly" in str(w.message) for w in seen) == 1
    handle.restore()
    _, model, ids = gpu_twin("qwen3_moe")
    handle = cached(model)
    with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        replay = capture_graph(lambda x: model(x, use_cache=False).logits, ids[:, :1])
        for _ in range(EAGER_WARN_CALLS + 4):
            replay()
    assert not any("forwards eagerly" in str(w.message) for w in seen)
    assert not handle.expert_caches.watch_eager
    handle.restore()


def test_the_triton_row_copy_equals_its_reference_from_device_and_pinned_host_memory():
    from weightstream.engine.expert_gather import copy_rows
    from weightstream.engine.uva import uva_view

    gen = torch.Generator().manual_seed(0)
    for width in (2, 6, 4096 + 2, 3 * 2048 * 8 + 16):
        host = torch.randint(0, 256, (9, width), generator=gen, dtype=torch.uint8).pin_memory()
        src1 = uva_view(host.view(-1), torch.device("cuda")).view(9, width)
        src0 = torch.randint(0, 256, (4, width), generator=gen, dtype=torch.uint8).cuda()
        dst_row = torch.tensor([3, -1, 0, 5, 1, -1, 2, 4, 6]).cuda()
        src_row = torch.tensor([8, 0, 1, 2, 3, 4, 0, 7, 5]).cuda()
        which = torch.tensor([1, 0, 0, 1, 0, 1, 1, 1, 0], dtype=torch.bool).cuda()
        src_row = torch.where(which, src_row, src_row % 4)
        want = torch.randint(0, 256, (7, width), generator=gen, dtype=torch.uint8).cuda()
        got = want.clone()
        copy_rows_reference(want, src0, src1.clone(), dst_row, src_row, which)
        copy_rows(got, src0, src1, dst_row, src_row, which)
        torch.cuda.synchronize()
        assert torch.equal(got, want), width


def test_a_gather_needs_no_host_synchronization():
    """The table update and the row copies are device work only: torch's sync debug mode raises on a
    synchronizing call."""
    _, model, _ = gpu_twin("mixtral")
    handle = cached(model)
    cache = handle.expert_caches.caches[0]
    index = torch.tensor([[0, 1], [1, 3]], device="cuda")
    cache.gather(index)  # the first call compiles the kernel (which may synchronize)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            cache.gather(index)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    handle.restore()
