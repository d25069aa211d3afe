"""The engine on a real GPU: async copies on a side stream, compile, CUDA graphs, memory really freed.

Run with `pytest -m gpu` on a CUDA machine; skipped elsewhere.
"""

from __future__ import annotations

import copy
import gc
import warnings

import pytest
import torch
from conftest import make_model, state_copy, weight_bytes
from test_offload import Toy, check_peek_model

import weightstream as ws
from weightstream.engine.guards import live_parameters
from weightstream.placement.blocks import find_blocks
from weightstream.placement.plan import placement_of
from weightstream.placement.prepare import prepare
from weightstream.placement.probe import H200
from weightstream.placement.timing import capture_graph

pytestmark = pytest.mark.gpu


def gpu_model(arch="llama", seed=0):
    return make_model(arch, seed, dtype=torch.bfloat16).cuda()


def ids_for(seed=0, batch=2, length=16):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (batch, length), generator=gen).cuda()


def streaming_all_budget(model) -> int:
    """Budget that keeps only what is outside the decoder layers, plus two slots."""
    layers = [b.module for b in find_blocks(model)]
    inside = {id(t) for layer in layers for t in list(layer.parameters()) + list(layer.buffers())}
    outside = {id(t): t for t in list(model.parameters()) + list(model.buffers()) if id(t) not in inside}
    fixed = sum(t.numel() * t.element_size() for t in outside.values())
    per_layer = sum(-(-p.numel() * p.element_size() // 256) * 256 for p in layers[0].parameters())
    return fixed + 2 * per_layer + 256 * 64


@pytest.fixture
def eager_rounding():
    """Inductor rounds to bf16 wherever eager does (see docs/exactness.md). Without this, the resident
    compiled graph fuses a layer's residual add into the next layer's norm and skips one bf16 rounding
    that the block boundary, where the schedule ops sit, keeps."""
    torch._dynamo.reset()
    with torch._inductor.config.patch(emulate_precision_casts=True):
        yield
    torch._dynamo.reset()


def twins(arch="llama"):
    ref = gpu_model(arch)
    return ref, copy.deepcopy(ref)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mixtral"])
def test_eager_exact_and_streamed_bytes_leave_the_gpu(arch):
    ref, model = twins(arch)
    gc.collect()  # earlier tests' cycles, else freed mid-offload and counted as offloaded
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    handle = ws.offload(model, gpu_memory=streaming_all_budget(model), strategy="stream", profile=H200)
    stats = handle.stats
    assert stats.groups >= 2  # streams most blocks (the planner picks the slot count)
    freed = before - torch.cuda.memory_allocated()
    slack = 512 * sum(1 for _ in model.parameters())  # the caching allocator rounds each tensor to 512 B
    assert abs(freed - (stats.streamed_bytes - stats.staging_bytes)) <= slack
    # the arena holds what crosses the link: each group's layout, or its blob where it is compressed
    assert stats.wire_bytes <= stats.pinned_bytes <= 1.02 * stats.wire_bytes + 4096
    assert stats.wire_bytes <= stats.wire_raw_bytes and stats.streamed_bytes <= stats.wire_raw_bytes
    for seed in range(3):
        with torch.no_grad():
            assert torch.equal(model(ids_for(seed)).logits, ref(ids_for(seed)).logits)
    assert handle.stats.misses == 0


def test_compiled_fullgraph_exact(eager_rounding):
    ref, model = twins()
    ws.offload(model, gpu_memory=streaming_all_budget(model), strategy="stream", profile=H200)
    torch._dynamo.utils.counters.clear()
    cref, cmodel = torch.compile(ref, fullgraph=True), torch.compile(model, fullgraph=True)
    with torch.no_grad():
        for seed in range(3):
            assert torch.equal(cmodel(ids_for(seed)).logits, cref(ids_for(seed)).logits)
    assert not torch._dynamo.utils.counters["graph_break"]


def logits_fn(model):
    """A plain function of the input ids (no KV cache), for graph capture."""

    def forward(ids):
        return model(ids, use_cache=False).logits

    return forward


def capture(fn, ids):
    """timing.capture_graph under no_grad: a replay function whose input is written via .static_in."""
    with torch.no_grad():
        return capture_graph(fn, ids)


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("streamed", [(0, 1, 2), (0, 1, 2, 3)])
def test_a_loop_of_forwards_prefetches_across_them_and_stays_exact(compress, streamed):
    """Each forward's last releases start copying (and, compressed, decoding) the next forward's first
    groups, in its run order also where an odd number of groups goes through two slots, and nothing
    synchronizes between forwards: every call of a loop with new inputs must still match the resident
    model, the first call the only one that enters with nothing staged."""
    ref, model = twins()
    cost = prepare(model, gpu_memory=2**40, compress=compress).cost
    placement = placement_of(cost, streamed, 2, compressed=compress)
    handle = ws.offload(model, gpu_memory=placement.gpu_bytes, placement=placement)
    assert handle.placement.compressed == compress and handle.stats.groups == len(streamed)
    inputs = [ids_for(seed) for seed in range(6)]
    with torch.no_grad():
        outs = [model(x).logits for x in inputs]  # enqueued back to back, no host synchronization
        wants = [ref(x).logits for x in inputs]
    for out, want in zip(outs, wants, strict=True):
        assert torch.equal(out, want)
    stats = handle.stats
    assert stats.misses == 0 and stats.prologues == 1
    handle.restore()


def test_raw_and_compressed_groups_sharing_slots_stay_exact_in_any_order(monkeypatch):
    """Groups 0-2 stream raw (copies on the copy stream) and group 3 compressed (decodes on the decode
    stream) through two slots, as where some groups do not shrink: forwards back to back and layers
    called by hand out of order, so raw copies and decodes go into the same slots with no compute
    between them (tests/engine/test_stream_order.py checks their ordering with fake streams)."""
    import sys

    engine = sys.modules["weightstream.handle"]
    encode = engine.encode_groups
    monkeypatch.setattr(engine, "encode_groups", lambda *a, **k: [None, None, None] + encode(*a, **k)[3:])
    ref, model = twins()
    cost = prepare(model, gpu_memory=2**40, compress=True).cost
    placement = placement_of(cost, (0, 1, 2, 3), 2, compressed=True)
    handle = ws.offload(model, gpu_memory=placement.gpu_bytes, placement=placement)
    assert handle.engine.wire[:3] == [None] * 3 and handle.engine.wire[3] is not None  # the mix it is about
    hidden = torch.randn(2, 16, 64, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pos = model.model.rotary_emb(hidden, torch.arange(16, device="cuda")[None])
        outs, wants = [], []
        for step in range(3):
            outs.append(model(ids_for(step)).logits)
            wants.append(ref(ids_for(step)).logits)
            for i in (0, 2, 1, 3, 3, 0):
                outs.append(model.model.layers[i](hidden, position_embeddings=pos, attention_mask=None))
                wants.append(ref.model.layers[i](hidden, position_embeddings=pos, attention_mask=None))
    for out, want in zip(outs, wants, strict=True):
        assert torch.equal(out, want)
    handle.restore()


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("n_slots", [1, 2])
def test_manual_cuda_graph_replay_is_exact_and_self_contained(compiled, n_slots, eager_rounding):
    ref, model = twins()
    cost = prepare(model, gpu_memory=2**40).cost  # forced: one slot is where the replay bug showed
    placement = placement_of(cost, tuple(range(len(cost.block_bytes))), n_slots)
    handle = ws.offload(model, gpu_memory=placement.gpu_bytes, placement=placement)
    fref, fmodel = logits_fn(ref), logits_fn(model)
    if compiled:
        fref, fmodel = torch.compile(fref, fullgraph=True), torch.compile(fmodel, fullgraph=True)
    replay_ref, replay_model = capture(fref, ids_for(0)), capture(fmodel, ids_for(0))
    for seed in range(1, 4):
        replay_ref.static_in.copy_(ids_for(seed))
        replay_model.static_in.copy_(ids_for(seed))
        out_ref, out_model = replay_ref(), replay_model()
        torch.cuda.synchronize()
        assert torch.equal(out_model, out_ref)
        # an unexpected eager call between replays gets the right weights and leaves none stale
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hidden = torch.randn(2, 16, 64, device="cuda", dtype=torch.bfloat16)
            pos = model.model.rotary_emb(hidden, torch.arange(16, device="cuda")[None])
            got = model.model.layers[seed](hidden, position_embeddings=pos, attention_mask=None)
            want = ref.model.layers[seed](hidden, position_embeddings=pos, attention_mask=None)
            assert torch.equal(got, want)
    assert handle.stats.prologues >= 4  # every call after a replay entered a pass of its own


def test_reduce_overhead_is_exact(eager_rounding):
    ref, model = twins()
    ws.offload(model, gpu_memory=streaming_all_budget(model), strategy="stream", profile=H200)
    cref = torch.compile(ref, fullgraph=True, mode="reduce-overhead")
    cmodel = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        for seed in range(5):
            a = cref(ids_for(seed), use_cache=False).logits.clone()
            b = cmodel(ids_for(seed), use_cache=False).logits.clone()
            assert torch.equal(a, b)


def test_generate_same_tokens_and_restore():
    ref, model = twins()
    original = state_copy(model)
    with torch.no_grad():
        model(ids_for())  # cuBLAS allocates its workspace on the first matmul: keep it out of the count
    gc.collect()  # earlier tests' cycles, else freed mid-offload and counted as offloaded
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    handle = ws.offload(model, gpu_memory=streaming_all_budget(model), strategy="stream", profile=H200)
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids_for(1, 1), **kwargs), ref.generate(ids_for(1, 1), **kwargs))
    handle.restore()
    assert all(torch.equal(v, original[k]) for k, v in model.state_dict().items())
    assert all(p.is_cuda for p in model.parameters())
    assert abs(torch.cuda.memory_allocated() - before) <= 512 * sum(1 for _ in model.parameters())


def test_unexpected_orders_and_two_models_on_gpu():
    torch.manual_seed(0)
    ref_a = Toy(n=6, dim=256).eval().requires_grad_(False).cuda()
    ref_b = Toy(n=6, dim=256).eval().requires_grad_(False).cuda()
    a, b = copy.deepcopy(ref_a), copy.deepcopy(ref_b)
    ws.offload(a, gpu_memory=800_000, strategy="stream", profile=H200)
    ws.offload(b, gpu_memory=800_000, strategy="stream", profile=H200)
    x = torch.randn(8, 256, device="cuda")
    with torch.no_grad(), pytest.warns(UserWarning, match="out of the learned order"):
        for order in ([0, 1, 2, 2, 3, 4, 5], [5, 3, 1], list(range(6)), [0, 0, 4]):
            a.order = ref_a.order = order
            assert torch.equal(a(x), ref_a(x))
            assert torch.equal(b(x), ref_b(x))


def test_pageable_memory_works_eagerly_and_refuses_graph_capture():
    ref, model = twins()
    handle = ws.offload(model, gpu_memory=streaming_all_budget(model), pin_memory=False, strategy="stream",
                        profile=H200)
    assert handle.stats.pinned_bytes == 0
    with torch.no_grad():
        assert torch.equal(model(ids_for()).logits, ref(ids_for()).logits)
    with pytest.raises(ws.WeightstreamError, match="pin_memory=True"):
        capture(logits_fn(model), ids_for())


def assert_exact_eager_compiled_and_in_a_graph(ref, model):
    """model's logits equal ref's eager, compiled with fullgraph=True, and replayed from a CUDA graph
    captured on one input and replayed on another."""
    with torch.no_grad():
        assert torch.equal(model(ids_for(1)).logits, ref(ids_for(1)).logits)
        cref, cmodel = torch.compile(ref, fullgraph=True), torch.compile(model, fullgraph=True)
        assert torch.equal(cmodel(ids_for(2)).logits, cref(ids_for(2)).logits)
    replay_ref, replay_model = capture(logits_fn(ref), ids_for(3)), capture(logits_fn(model), ids_for(3))
    replay_ref.static_in.copy_(ids_for(4))
    replay_model.static_in.copy_(ids_for(4))
    out_ref, out_model = replay_ref(), replay_model()
    torch.cuda.synchronize()
    assert torch.equal(out_model, out_ref)


@pytest.mark.parametrize("strategy", ["uva", "auto"])
def test_zero_copy_and_auto_are_exact_eager_compiled_and_in_a_graph(strategy, eager_rounding):
    ref, model = twins()
    gc.collect()  # earlier tests' cycles, else freed mid-offload and counted as offloaded
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    handle = ws.offload(model, gpu_memory=streaming_all_budget(model), strategy=strategy, profile=H200)
    stats = handle.stats
    assert stats.uva_bytes > 0 or strategy == "auto"
    freed = before - torch.cuda.memory_allocated()
    slack = 512 * sum(1 for _ in model.parameters())
    assert abs(freed - (stats.streamed_bytes + stats.uva_bytes - stats.staging_bytes)) <= slack
    assert_exact_eager_compiled_and_in_a_graph(ref, model)
    handle.restore()
    assert all(p.is_cuda for p in model.parameters())


def part_placement_budget(model) -> int:
    """A budget at which the planner (on the reference H200 profile) streams only each streamed block's
    largest tensors and keeps the rest of it resident."""
    for percent in range(30, 96, 5):
        budget = weight_bytes(model) * percent // 100
        try:
            if prepare(model, budget, next(model.parameters()).device, strategy="stream",
                       profile=H200).placement.part:
                return budget
        except ws.BudgetError:  # below the smallest budget that streaming allows
            continue
    raise AssertionError("no budget gave a parameter-granular placement")


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_streaming_part_of_each_block_is_exact_eager_compiled_and_in_a_graph(arch, eager_rounding):
    """Parameter-granular placement on the CUDA path: the streamed tensors leave the GPU, the rest of each
    block stays, and outputs are bit-identical eager, compiled (fullgraph) and replayed from a graph."""
    ref, model = twins(arch)
    budget = part_placement_budget(model)
    gc.collect()  # earlier tests' cycles, else freed mid-offload and counted as offloaded
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    handle = ws.offload(model, gpu_memory=budget, strategy="stream", profile=H200)
    part, stats = handle.placement.part, handle.stats
    assert part and stats.groups >= 1
    freed = before - torch.cuda.memory_allocated()
    slack = 512 * sum(1 for _ in model.parameters())
    assert abs(freed - (stats.streamed_bytes - stats.staging_bytes)) <= slack
    blocks, slots = dict(model.named_modules()), {s.untyped_storage().data_ptr() for s in handle.engine.slots}
    for name in handle.streamed_blocks:
        in_slots = [t.untyped_storage().data_ptr() in slots for t in live_parameters(blocks[name])]
        assert sum(in_slots) == part  # exactly `part` tensors live in the slots, the rest stay resident
        assert all(t.is_cuda for t in live_parameters(blocks[name]))
    assert_exact_eager_compiled_and_in_a_graph(ref, model)
    handle.restore()
    assert all(p.is_cuda for p in model.parameters())


def test_a_captured_graph_keeps_its_input_alive():
    """timing.capture_graph copies its input; once the caller's tensors are gone, the allocator must not
    hand that copy's memory to new tensors (the graph would read their bytes)."""
    table = torch.nn.Embedding(16, 4).cuda()
    replay = capture_graph(table, torch.arange(16, device="cuda"))
    gc.collect()
    junk = [torch.full((16,), 15, dtype=torch.long, device="cuda") for _ in range(256)]
    assert torch.equal(replay(), table(torch.arange(16, device="cuda")))
    del junk


@pytest.mark.parametrize("direct", [True, False])
def test_eager_blocks_on_the_gpu_keep_weight_views_and_see_the_callers_tensors(direct, monkeypatch):
    """On real streams: a block returning a view of its weight (in a slot the next group's copy
    overwrites, asynchronously) still gives its own bytes, direct (`ops.eager`: the view is copied
    before the release) and through the ops (their copies, made before the release too); direct, the
    blocks compute from the caller's tensors and their in-place writes reach it, as resident."""
    monkeypatch.setattr(ws.engine.streamed, "EAGER_DIRECT", direct)
    check_peek_model("cuda", n=6, dim=256, forwards=3, profile=H200, compress=False)


def test_gpu_memory_auto_on_a_real_gpu_is_free_memory_minus_the_headroom_and_exact():
    """The default budget read from the driver: what is free now minus max(2 GiB, 10% of the card);
    a small model fits whole under it, so nothing streams and the output equals the resident model."""
    from weightstream.config import AUTO_HEADROOM_BYTES, AUTO_HEADROOM_FRACTION, OffloadConfig

    device = torch.device("cuda", torch.cuda.current_device())
    gc.collect()  # earlier tests' engines, whose finalizers free GPU memory, go now rather than mid-test
    torch.cuda.empty_cache()
    free_before, total = torch.cuda.mem_get_info(device)
    budget = OffloadConfig().gpu_memory
    free_after, _ = torch.cuda.mem_get_info(device)
    headroom = max(AUTO_HEADROOM_BYTES, int(AUTO_HEADROOM_FRACTION * total))
    # the driver's free memory read between the two readings (equal unless something else ran)
    assert min(free_before, free_after) - headroom <= budget <= max(free_before, free_after) - headroom
    assert OffloadConfig().device.type == "cuda"  # the current device, named without its index

    ref = gpu_model()
    model = make_model("llama", 0, dtype=torch.bfloat16)  # on the CPU: offload places it
    ids = ids_for()
    with torch.no_grad():
        expected = ref(ids).logits
        handle = ws.offload(model)
        assert 0 < handle.config.gpu_memory <= total - headroom
        assert torch.equal(model(ids).logits, expected)
    assert handle.stats.streamed_bytes == 0
    handle.restore()


class _ConvBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(32, 32, 3, padding=1)
        self.lin = torch.nn.Parameter(torch.randn(32, 32).t() / 6)  # a transposed weight

    def forward(self, x):
        y = torch.tanh(self.conv(x))
        return x + torch.einsum("bchw,cd->bdhw", y, self.lin)


class _ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_ConvBlock() for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("strategy", ["stream", "uva"])
def test_channels_last_and_transposed_weights_keep_their_layout_and_bits_on_the_gpu(strategy):
    """cuDNN and cuBLAS choose kernels by layout: weights placed as rows gave other bits than the
    resident channels_last convolutions and transposed matrices. Eager and from a CUDA graph."""
    torch.manual_seed(0)
    ref = _ConvNet().to("cuda", memory_format=torch.channels_last).eval().requires_grad_(False)
    model = copy.deepcopy(ref)
    before = torch.cuda.memory_allocated()
    try:
        handle = ws.offload(model, gpu_memory=0, strategy=strategy)
    except ws.BudgetError as e:
        handle = ws.offload(model, gpu_memory=e.minimum_bytes, strategy=strategy)
    assert len(handle.placement.streamed) + len(handle.placement.uva) == 4
    assert torch.cuda.memory_allocated() < before  # the blocks' weights left the GPU
    x = torch.randn(2, 32, 16, 16, device="cuda").contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        want = ref(x)
        assert torch.equal(model(x), want)
        assert [p.stride() for p in model.parameters()] == [p.stride() for p in ref.parameters()]
        replay = capture_graph(model, x)
        assert torch.equal(replay(), want)
    handle.restore()
    assert [p.stride() for p in model.parameters()] == [p.stride() for p in ref.parameters()]
