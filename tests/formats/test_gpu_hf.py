"""from_pretrained on a real GPU: straight into place, never the whole model on the GPU, disk tier."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, weight_bytes
from transformers import AutoModelForCausalLM

import weightstream as ws
from weightstream.formats import convert

pytestmark = pytest.mark.gpu


def ids_for(seed=0, batch=2, length=16):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (batch, length), generator=gen).cuda()


@pytest.fixture
def folder(tmp_path):
    make_model("llama", dtype=torch.bfloat16).save_pretrained(tmp_path, max_shard_size="100KB")
    return tmp_path


def test_load_is_exact_and_never_puts_the_whole_model_on_the_gpu(folder):
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval().cuda()
    total = weight_bytes(reference)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    # raw groups: a compressed load codes each group on the GPU, a transient beyond the budget
    model = ws.from_pretrained(folder, gpu_memory=total // 2, progress=False, strategy="stream",
                               profile=ws.REFERENCE_PROFILE, compress=False)
    stats = ws.handle_of(model).stats
    peak = torch.cuda.max_memory_allocated() - base
    assert stats.groups >= 2 and stats.pinned_bytes >= stats.streamed_bytes
    assert peak <= stats.resident_bytes + stats.staging_bytes + 512 * 64 < total
    with torch.no_grad():
        assert torch.equal(model(ids_for()).logits, reference(ids_for()).logits)


def test_a_failure_mid_load_leaves_nothing_allocated(folder, monkeypatch):
    import gc

    gc.collect()  # the garbage of earlier tests must not be freed between the two readings
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    calls = []

    def failing_read(stored, dst):
        calls.append(1)
        if len(calls) == 5:
            raise OSError("disk gone")
        return original(stored, dst)

    original = convert.read_into  # every tensor of a load is read there (formats/convert.py)
    monkeypatch.setattr(convert, "read_into", failing_read)
    with pytest.raises(OSError, match="disk gone"):
        ws.from_pretrained(folder, gpu_memory="300KB", progress=False, profile=ws.REFERENCE_PROFILE)
    gc.collect()
    assert torch.cuda.memory_allocated() == base


def test_disk_tier_on_the_gpu_is_exact_and_refuses_graph_capture(folder):
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval().cuda()
    budget = weight_bytes(reference) // 2
    load = dict(gpu_memory=budget, progress=False, strategy="stream", profile=ws.REFERENCE_PROFILE)
    plain = ws.handle_of(ws.from_pretrained(folder, **load)).stats
    group = plain.staging_bytes // plain.slots
    model = ws.from_pretrained(folder, cpu_memory=3 * group + group // 2, **load)
    stats = ws.handle_of(model).stats
    assert 0 < stats.disk_bytes < stats.streamed_bytes
    with torch.no_grad():
        for seed in range(3):
            assert torch.equal(model(ids_for(seed)).logits, reference(ids_for(seed)).logits)
        hidden = torch.randn(2, 16, 64, device="cuda", dtype=torch.bfloat16)
        pos = model.model.rotary_emb(hidden, torch.arange(16, device="cuda")[None])
        kwargs = dict(position_embeddings=pos, attention_mask=None)
        got = model.model.layers[1](hidden, **kwargs)  # out of order: a synchronous read from disk
        assert torch.equal(got, reference.model.layers[1](hidden, **kwargs))
        assert torch.equal(model(ids_for(5)).logits, reference(ids_for(5)).logits)
    graph, ids = torch.cuda.CUDAGraph(), ids_for()
    with pytest.raises(ws.WeightstreamError, match="disk"), torch.no_grad(), torch.cuda.graph(graph):
        model(ids, use_cache=False)


def test_auto_keeps_to_cpu_memory_and_is_exact(folder):
    """auto with a host budget smaller than what it would read in place: it streams, part from disk."""
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval().cuda()
    total = weight_bytes(reference)
    load = dict(gpu_memory=total // 2, progress=False, profile=ws.REFERENCE_PROFILE)
    free = ws.handle_of(ws.from_pretrained(folder, **load)).stats
    cpu_memory = int(total * 0.4)
    model = ws.from_pretrained(folder, cpu_memory=cpu_memory, **load)
    stats = ws.handle_of(model).stats
    assert stats.uva_bytes <= cpu_memory and stats.pinned_bytes <= cpu_memory
    assert free.uva_bytes <= cpu_memory or stats.placement_kind != free.placement_kind
    with torch.no_grad():
        for seed in range(2):
            assert torch.equal(model(ids_for(seed)).logits, reference(ids_for(seed)).logits)


def test_compressed_disk_tier_on_the_gpu_lands_and_decodes_blobs_exactly(folder, tmp_path):
    """compress=True with groups on disk: their blobs come from the cache file through the pinned bounce
    buffers into the landing buffers and are decoded into the slots (forced: stream, reference profile,
    compress=True prefers a compressed placement wherever one fits)."""
    from weightstream.wire.groups import CodedCudaTransfer

    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval().cuda()
    load = dict(gpu_memory=int(weight_bytes(reference) * 0.75), progress=False, strategy="stream",
                profile=ws.REFERENCE_PROFILE, compress=True)
    probe = ws.handle_of(ws.from_pretrained(folder, **load))
    group = probe.placement.slot_bytes
    probe.restore()
    model = ws.from_pretrained(folder, cpu_memory=3 * group + group // 2, cache_dir=tmp_path / "cache",
                               **load)
    handle = ws.handle_of(model)
    transfer, stats = handle.engine.transfer, handle.stats
    disk, reader = transfer.disk, transfer.prefetcher
    assert handle.placement.compressed and isinstance(transfer, CodedCudaTransfer)
    raw_of_coded = sum(t.nbytes for g in disk.blobs for t, _ in disk.groups[g])
    assert disk.blobs and stats.disk_cache_bytes < raw_of_coded
    assert all(b.numel() == disk.max_read_bytes and b.is_pinned() for b in reader.buffers)
    assert len(transfer.landing) == handle.placement.n_landing
    with torch.no_grad():
        assert torch.equal(model(ids_for(0)).logits, reference(ids_for(0)).logits)
        for seed in range(1, 3):
            for _, _, future in list(reader.pending):
                future.result()  # the ring's reads ahead have landed in the counter
            before = disk.bytes_read
            assert torch.equal(model(ids_for(seed)).logits, reference(ids_for(seed)).logits)
            for _, _, future in list(reader.pending):
                future.result()
            assert disk.bytes_read - before == stats.disk_wire_bytes < stats.disk_bytes
        g = min(disk.blobs)
        layer = int(handle.streamed_blocks[g].rsplit(".", 1)[1])
        hidden = torch.randn(2, 16, 64, device="cuda", dtype=torch.bfloat16)
        pos = model.model.rotary_emb(hidden, torch.arange(16, device="cuda")[None])
        kwargs = dict(position_embeddings=pos, attention_mask=None)
        got = model.model.layers[layer](hidden, **kwargs)  # out of order: its blob read synchronously
        assert torch.equal(got, reference.model.layers[layer](hidden, **kwargs))
        assert torch.equal(model(ids_for(5)).logits, reference(ids_for(5)).logits)
    assert handle.stats.misses >= 1
    want = {k: v.cpu() for k, v in reference.state_dict().items()}
    assert all(torch.equal(v.cpu(), want[k]) for k, v in model.state_dict().items())
    cache = disk.cache.path
    handle.restore()
    assert all(torch.equal(v.cpu(), want[k]) for k, v in model.state_dict().items())
    assert not cache.exists()
