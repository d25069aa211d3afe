"""Expert copies on the GPU: the model zoo's mixtures of experts in bf16 under a forced placement (every
block's routed experts copied by the copy engine, raw or held coded and decoded by the Triton decoder;
not the machine's profile), outputs `torch.equal` to the resident model, the expert bytes off the GPU,
and a CUDA graph capture refused with a message saying what to change. Skipped without CUDA; run with
`pytest -m gpu`."""

from __future__ import annotations

import gc

import pytest
import torch
from test_expert_cache import CACHED
from test_gpu_expert_cache import gpu_twin, other_ids

import weightstream as ws
from weightstream.errors import OffloadStateError
from weightstream.placement.plan import placement_of
from weightstream.placement.prepare import prepare

pytestmark = pytest.mark.gpu


def copied(model, coded: bool = False):
    cost = prepare(model, gpu_memory=2**40, compress=coded).cost
    apart = tuple(i for i in range(len(cost.block_bytes)) if cost.experts_apart(i))
    placement = placement_of(cost, (), 0, apart, uva_experts=apart, expert_copies=apart, coded_copies=coded)
    handle = ws.offload(model, gpu_memory=placement.gpu_bytes, placement=placement)
    assert handle.expert_caches is not None and handle.expert_caches.copies
    assert len(handle.expert_caches.blocks) == len(apart)
    return handle


@pytest.mark.parametrize("coded", [False, True], ids=["raw", "coded"])
@pytest.mark.parametrize("name", CACHED)
def test_copied_experts_are_exact_and_their_bytes_leave_the_gpu(name, coded):
    ref, model, ids = gpu_twin(name)
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    handle = copied(model, coded)
    stats = handle.stats
    if coded:  # every expert held coded: the arena holds less than the experts' bytes
        records = [r for c in handle.expert_caches.caches for r in c.records]
        assert all(r.chunks for r in records) and 0.5 < stats.expert_wire_ratio < 0.95
        assert handle.engine.arena.nbytes == sum(r.nbytes for r in records) < stats.uva_bytes
    freed = before - torch.cuda.memory_allocated()
    slack = 512 * sum(1 for _ in model.parameters())  # the caching allocator's 512-byte rounding
    # the routed experts left; the shared work buffers came
    assert 0 < stats.cache_bytes < stats.uva_bytes
    assert abs(freed - (stats.uva_bytes - stats.cache_bytes)) <= slack, (freed, stats)
    with torch.no_grad():
        for seed in range(4):
            batch = other_ids(ids, seed)
            for x in (batch[:, :1], batch):  # a decode step and a short prefill
                assert torch.equal(model(x, use_cache=False).logits, ref(x, use_cache=False).logits), seed
    handle.restore()
    assert all(p.is_cuda for p in model.parameters())


def test_a_cuda_graph_capture_of_copied_experts_is_refused_saying_what_to_change():
    _, model, ids = gpu_twin("qwen3_moe")
    handle = copied(model)
    with torch.no_grad():
        model(ids[:, :1], use_cache=False)  # warm-up, outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(OffloadStateError, match="expert_copies=False"), torch.cuda.graph(graph):
            model(ids[:, :1], use_cache=False)
    torch.cuda.synchronize()
    handle.restore()


@pytest.mark.parametrize("coded", [False, True], ids=["raw", "coded"])
@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_copied_experts_loaded_by_from_pretrained_are_exact(tmp_path, name, coded):
    """A checkpoint as transformers saves it, loaded straight into place with its routed experts copied
    (coded on the GPU from the files, one layer at a time, where `coded`): logits equal transformers'
    own resident load on the GPU."""
    from test_coded_copies import bf16_model, coded_placement
    from transformers import AutoModelForCausalLM

    model, _ = bf16_model(name)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).cuda().eval()
    placement, _ = coded_placement(reference) if coded else coded_placement(reference, copy_landing_bytes=0)
    loaded = ws.from_pretrained(tmp_path, ws.OffloadConfig(placement.gpu_bytes, placement=placement),
                                progress=False)
    handle = ws.handle_of(loaded)
    assert len(handle.expert_caches.caches) == len(placement.expert_copies)
    assert (handle.stats.expert_wire_ratio is not None) == coded
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        for x in (ids[:, :1], ids):
            assert torch.equal(loaded(x, use_cache=False).logits, reference(x, use_cache=False).logits)
    handle.restore()
