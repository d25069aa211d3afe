"""Compressed streaming end to end: the engine with compress=True gives the resident model's outputs
bit for bit (CPU backend here, CUDA streams and graphs under -m gpu); planner and stats see the codec."""

from __future__ import annotations

import copy
import gc
import warnings

import pytest
import torch
from conftest import ARCHS, in_order_copies, make_model, state_copy, weight_bytes

import weightstream as ws
from weightstream.placement.cost import ModelCost, predict
from weightstream.placement.plan import placement_of, plan
from weightstream.placement.probe import H200


def ids_for(seed: int = 0, batch: int = 2, length: int = 9, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (batch, length), generator=gen).to(device)


def bf16_twin(arch: str, dtype=torch.bfloat16):
    ref = make_model(arch, dtype=dtype)
    return ref, copy.deepcopy(ref)


@pytest.mark.parametrize(("arch", "dtype"), [(a, torch.bfloat16) for a in ARCHS] + [("llama", torch.float16)])
def test_compressed_streaming_is_bit_identical(arch, dtype):
    ref, model = bf16_twin(arch, dtype)
    budget = int(weight_bytes(model) * 0.75)
    handle = ws.offload(model, gpu_memory=budget, device="cpu", strategy="stream", compress=True)
    with torch.no_grad():
        for seed in range(2):
            assert torch.equal(model(ids_for(seed)).logits, ref(ids_for(seed)).logits)
    stats = handle.stats
    assert handle.placement.gpu_bytes <= budget
    assert stats.pinned_bytes == 0 and stats.misses == 0 and stats.copies == in_order_copies(stats, 2)
    p = handle.placement
    assert p.staging_bytes == stats.slots * p.slot_bytes + p.n_landing * p.landing_bytes
    assert "ratio" in str(stats)
    if dtype == torch.bfloat16:  # tiny fp16 blocks (about 0.93 of their bytes) may not pay: raw then
        assert handle.placement.compressed
        assert stats.wire_ratio < 0.9  # groups really crossed compressed


@pytest.mark.slow
def test_compiled_generate_out_of_order_and_restore_stay_exact():
    ref, model = bf16_twin("llama")
    original = state_copy(model)
    handle = ws.offload(model, gpu_memory=int(weight_bytes(model) * 0.75), device="cpu",
                        strategy="stream", compress=True)
    assert handle.placement.compressed
    torch._dynamo.reset()
    # bf16: inductor must round where eager does to match the resident model (docs/exactness.md)
    with torch._inductor.config.patch(emulate_precision_casts=True), torch.no_grad():
        cref, cmodel = torch.compile(ref, fullgraph=True), torch.compile(model, fullgraph=True)
        assert torch.equal(cmodel(ids_for(3)).logits, cref(ids_for(3)).logits)
    torch._dynamo.reset()
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids_for(1, 1), **kwargs), ref.generate(ids_for(1, 1), **kwargs))
    prologues = handle.stats.prologues
    with torch.no_grad(), warnings.catch_warnings():  # a block called on its own: a pass of its own
        warnings.simplefilter("ignore")
        hidden = torch.randn(2, 9, 64, dtype=torch.bfloat16)
        pos = model.model.rotary_emb(hidden, torch.arange(9)[None])
        got = model.model.layers[2](hidden, position_embeddings=pos, attention_mask=None)
        assert torch.equal(got, ref.model.layers[2](hidden, position_embeddings=pos, attention_mask=None))
    assert handle.stats.prologues == prologues + 1
    handle.restore()
    assert all(torch.equal(v, original[k]) for k, v in model.state_dict().items())


def test_fp32_and_auto_on_cpu_stream_raw():
    ref, model = bf16_twin("llama", torch.float32)
    with pytest.warns(UserWarning, match="would not shrink"):
        handle = ws.offload(model, gpu_memory=int(weight_bytes(model) * 0.75), device="cpu",
                            strategy="stream", compress=True)
    assert handle.stats.wire_ratio == 1.0  # nothing to code: fp32 passes raw
    with torch.no_grad():
        assert torch.equal(model(ids_for()).logits, ref(ids_for()).logits)
    _, model = bf16_twin("llama")
    handle = ws.offload(model, gpu_memory=int(weight_bytes(model) * 0.75), device="cpu", compress="auto")
    assert not handle.placement.compressed  # no link to save on the CPU backend
    with pytest.raises(ValueError, match="compress"):
        ws.offload(bf16_twin("llama")[1], gpu_memory=10**9, device="cpu", compress="yes")


def _cost(ratio: float, blocks: int = 8, size: int = 400 << 20) -> ModelCost:
    tensors = ((size // 2, size // 2),) * blocks
    wire = tuple((int(a * ratio), int(b * ratio)) for a, b in tensors)
    return ModelCost(1 << 30, 1 << 29, (size,) * blocks, (size,) * blocks, 4096, tensors, tensor_wire=wire)


def test_cost_model_and_planner_weigh_compression():
    model = _cost(0.71)
    streamed = tuple(range(8))
    raw = predict(model, streamed, 2, (), 1, H200)
    coded = predict(model, streamed, 2, (), 1, H200, compressed=True)
    assert coded.ms < 0.8 * raw.ms  # link-bound: fewer bytes, the decode hides behind the copies
    budget = model.fixed_bytes + (1400 << 20)  # two slots and their landing buffers: all blocks stream
    for compress in (True, "auto"):
        placement = plan(model, budget, 1, H200, "stream", compress=compress)
        assert placement.compressed and placement.gpu_bytes <= budget
        assert placement.landing_bytes >= 0.71 * placement.slot_bytes
    assert not plan(model, budget, 1, H200, "stream", compress=False).compressed
    slow_decode = type(H200)(**{**H200.__dict__, "decode_s_per_byte": 1 / 5e9})  # slower than the link
    assert not plan(model, budget, 1, slow_decode, "stream", compress="auto").compressed
    assert not plan(_cost(0.99), budget, 1, H200, "stream", compress="auto").compressed


def test_one_slot_with_two_landing_buffers_keeps_the_link_busy():
    """One slot, compressed: with one landing buffer each group's copy waits for the last decode and
    compute, with two the next group lands meanwhile (link-bound again, at one slot less than two
    slots); the planner takes it where the slot it saves keeps more blocks resident."""
    model = _cost(0.71)
    streamed = tuple(range(8))
    link_ms = H200.copy_seconds(sum(model.wire_bytes(b) for b in streamed)) * 1e3
    ahead = predict(model, streamed, 1, (), 1, H200, compressed=True, n_landing=2)
    serial = predict(model, streamed, 1, (), 1, H200, compressed=True, n_landing=1)
    two_slots = predict(model, streamed, 2, (), 1, H200, compressed=True)
    assert ahead.ms < 1.1 * link_ms and ahead.ms < 0.9 * serial.ms
    assert ahead.ms == pytest.approx(two_slots.ms, rel=0.05)
    one = placement_of(model, streamed, 1, compressed=True)
    two = placement_of(model, streamed, 2, compressed=True)
    assert (one.n_landing, two.n_landing) == (2, 2)
    assert two.staging_bytes - one.staging_bytes == one.slot_bytes
    assert placement_of(model, streamed, 1, compressed=True, landing_buffers=1).n_landing == 1
    with pytest.raises(ValueError, match="landing_buffers=3"):
        placement_of(model, streamed, 1, compressed=True, landing_buffers=3)
    # a budget with room for two landing buffers and one slot, not two slots: all 8 blocks stream
    budget = model.fixed_bytes + one.staging_bytes + (1 << 20)
    got = plan(model, budget, 1, H200, "stream", compress=True)
    assert (got.n_slots, got.n_landing, len(got.streamed)) == (1, 2, 8)


def test_copies_run_ahead_of_decodes_and_decodes_take_turns_with_compute():
    """Each group's blob is copied once its landing buffer is free, not when its slot is, so the link
    runs back to back; a decode does not overlap compute (it shares the GPU: on the H200 a decode
    beside GEMMs lengthens them by more than its own time), so a forward takes about
    max(copies, decodes + compute), plus filling the pipeline: never the sum of copy and decode per
    group."""
    model = _cost(0.71, blocks=32)
    streamed = tuple(range(32))
    slow = type(H200)(**{**H200.__dict__, "decode_s_per_byte": 1 / 100e9})  # decode near copy and compute
    copy_ms = slow.copy_seconds(sum(model.wire_bytes(b) for b in streamed)) * 1e3
    decode_ms = slow.decode_seconds(sum(model.block_bytes)) * 1e3
    per_group = (copy_ms + decode_ms) / len(streamed)
    for tokens in (1, 4096):
        for n_slots, n_landing in ((2, None), (1, 2)):  # (one buffer: its copy waits for its decode)
            got = predict(model, streamed, n_slots, (), tokens, slow, compressed=True, n_landing=n_landing)
            busiest = max(copy_ms, decode_ms + got.compute_ms)
            assert busiest <= got.ms < busiest + 3 * per_group, (tokens, n_slots, n_landing, got.ms, busiest)
            if tokens == 1:  # little compute: copies and decodes overlap each other
                assert got.ms < 0.8 * (copy_ms + decode_ms)
    raw = predict(model, streamed, 2, (), 4096, slow)
    assert raw.ms < max(raw.link_ms, raw.compute_ms) + 3 * per_group  # raw: no decode to take turns with


# --- on a GPU: copy stream, landing buffers, decode stream, graphs ------------------------------------

def _gpu_twin(arch="llama"):
    ref = make_model(arch, dtype=torch.bfloat16).cuda()
    return ref, copy.deepcopy(ref)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_gpu_compressed_eager_graph_and_restore_are_exact(arch):
    from weightstream.placement.timing import capture_graph

    ref, model = _gpu_twin(arch)
    original = state_copy(model)
    budget = int(weight_bytes(model) * 0.7)
    gc.collect()  # a failed earlier test's model, freed by a collection during offload, would count here
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    handle = ws.offload(model, gpu_memory=budget, strategy="stream", compress=True)
    stats = handle.stats
    assert handle.placement.compressed and stats.wire_bytes < stats.wire_raw_bytes
    freed = before - torch.cuda.memory_allocated()  # streamed bytes left; slots and landing buffers came
    slack = 512 * sum(1 for _ in model.parameters())  # the caching allocator rounds each tensor to 512 B
    assert abs(freed - (stats.streamed_bytes - stats.staging_bytes)) <= slack
    with torch.no_grad():
        for seed in range(3):
            assert torch.equal(model(ids_for(seed, device="cuda")).logits,
                               ref(ids_for(seed, device="cuda")).logits)
        fref = lambda ids: ref(ids, use_cache=False).logits  # noqa: E731
        fmodel = lambda ids: model(ids, use_cache=False).logits  # noqa: E731
        replay_ref = capture_graph(fref, ids_for(0, device="cuda"))
        replay_model = capture_graph(fmodel, ids_for(0, device="cuda"))
    for seed in range(1, 4):
        replay_ref.static_in.copy_(ids_for(seed, device="cuda"))
        replay_model.static_in.copy_(ids_for(seed, device="cuda"))
        assert torch.equal(replay_model(), replay_ref())
    assert handle.stats.misses == 0
    handle.restore()
    assert all(torch.equal(v, original[k]) for k, v in model.state_dict().items())


@pytest.mark.gpu
def test_gpu_compressed_compiled_is_exact():
    ref, model = _gpu_twin()
    ws.offload(model, gpu_memory=int(weight_bytes(model) * 0.7), strategy="stream", compress=True)
    torch._dynamo.reset()
    with torch._inductor.config.patch(emulate_precision_casts=True):
        cref, cmodel = torch.compile(ref, fullgraph=True), torch.compile(model, fullgraph=True)
        with torch.no_grad():
            for seed in range(2):
                ids = ids_for(seed, device="cuda")
                assert torch.equal(cmodel(ids).logits, cref(ids).logits)
    torch._dynamo.reset()


def test_plan_report_shows_the_wire_for_a_meta_model():
    from weightstream.planview import format_report, plan_report

    raw = plan_report("llama-3-8b", "4GiB", strategy="stream")
    coded = plan_report("llama-3-8b", "4GiB", strategy="stream", compress=True)
    assert not raw["wire"]["compressed"] and coded["wire"]["compressed"]
    assert coded["wire"]["bytes"] <= 0.75 * coded["streamed"]["bytes"]  # predicted from HF-init weights
    assert coded["gpu_bytes"] <= 4 << 30
    assert coded["predicted"]["decode"]["ms"] < 0.85 * raw["predicted"]["decode"]["ms"]
    assert "compressed (ratio" in format_report(coded)


def test_groups_too_big_for_the_landing_buffer_stream_raw_and_no_triton_on_cpu():
    import sys

    from weightstream.placement.prepare import prepare
    from weightstream.wire.groups import encode_groups

    _, model = bf16_twin("llama")
    prep = prepare(model, int(weight_bytes(model) * 0.75), "cpu", strategy="stream", compress=True)
    groups, sizes = prep.groups, prep.group_bytes
    coded = encode_groups(groups, sizes, 10**9, torch.device("cpu"))
    assert all(enc is not None and enc.blob.is_meta for enc in coded)  # sizes only, nothing kept
    assert encode_groups(groups, sizes, min(e.wire_bytes for e in coded) - 1, torch.device("cpu")) == \
        [None] * len(groups)
    assert "weightstream.wire.triton_decoder" not in sys.modules  # the CPU path never imports Triton


def test_the_state_dict_of_a_compressed_model_is_the_true_weights():
    """The arena holds compressed blobs: state_dict() and parameters() must decode them, never hand
    out the blob's bytes as weights."""
    ref, model = bf16_twin("llama", torch.bfloat16)
    handle = ws.offload(model, gpu_memory=int(weight_bytes(model) * 0.6), device="cpu", strategy="stream",
                        compress=True)
    assert handle.placement.compressed and any(handle.engine.wire)
    want = ref.state_dict()
    guards = model.__dict__["_ws_guards"]
    got = model.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert guards._decoded == (None, None)  # no decoded group kept on the host afterwards
    named = dict(model.named_parameters())
    assert all(torch.equal(named[k], v) for k, v in ref.named_parameters())
    assert guards._decoded == (None, None)
