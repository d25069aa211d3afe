"""The planner: budget, placement, monotonicity, strategy choice. Pure logic: property tests."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightstream.errors import ArgumentError, BudgetError, WeightstreamError
from weightstream.placement.cost import ModelCost
from weightstream.placement.layout import pack
from weightstream.placement.plan import host_need, plan, spread
from weightstream.placement.probe import H200

blocks_st = st.lists(st.integers(min_value=1, max_value=10**8), min_size=1, max_size=12)
model_st = st.builds(
    lambda fixed, blocks, pad, width: ModelCost(
        fixed, fixed // 2, tuple(blocks), tuple(b + pad for b in blocks), width),
    st.integers(0, 10**8), blocks_st, st.integers(0, 4096), st.sampled_from([0, 1024, 8192]))



def _with_tensors(fixed, blocks, width):
    """A model whose blocks are lists of tensor sizes: parameter-granular placement is possible."""
    sizes = tuple(tuple(t) for t in blocks)
    return ModelCost(fixed, fixed // 2, tuple(map(sum, sizes)), tuple(pack(list(t))[1] for t in sizes), width,
                     sizes)


tensors_model_st = st.builds(
    _with_tensors, st.integers(0, 10**8),
    st.lists(st.lists(st.integers(1, 5 * 10**7), min_size=1, max_size=5), min_size=1, max_size=10),
    st.sampled_from([0, 4096]))
model_st = st.one_of(model_st, tensors_model_st)
tokens_st = st.sampled_from([1, 16, 512, 2048])
strategy_st = st.sampled_from(["auto", "stream", "uva"])


@settings(max_examples=200, deadline=None)
@given(model=model_st, budget=st.integers(0, 2 * 10**9), tokens=tokens_st, strategy=strategy_st)
def test_placement_respects_budget_and_places_each_block_once(model, budget, tokens, strategy):
    try:
        p = plan(model, budget, tokens, H200, strategy)
    except BudgetError as err:
        assert budget < err.minimum_bytes
        return
    sizes = model.block_bytes
    assert p.gpu_bytes <= budget
    assert not set(p.streamed) & set(p.uva)
    assert len(set(p.streamed)) == len(p.streamed) and len(set(p.uva)) == len(p.uva)
    assert all(0 <= i < len(sizes) for i in p.streamed + p.uva)
    if not p.part:
        resident = [b for i, b in enumerate(sizes) if i not in p.streamed and i not in p.uva]
        assert p.resident_bytes == model.fixed_bytes + sum(resident)
    assert p.resident_bytes + p.offloaded_bytes == model.fixed_bytes + sum(sizes)
    assert p.uva_bytes == sum(sizes[i] for i in p.uva)
    if strategy == "stream":
        assert not p.uva
    if strategy == "uva":
        assert not p.streamed and p.n_slots == 0
    if p.streamed:
        assert p.slot_bytes == max(model.staging(i, p.part) for i in p.streamed)
        assert 1 <= p.n_slots <= min(2, len(p.streamed))
    streamed = sum(model.streamed_bytes(i, p.part) for i in p.streamed)
    assert p.resident_bytes + streamed + p.uva_bytes == model.fixed_bytes + sum(sizes)
    assert p.streamed_bytes == streamed and p.offloaded_bytes == streamed + p.uva_bytes
    assert p.requested_strategy == strategy and p.kind in ("resident", "stream", "uva", "mix")
    assert p.part == 0 or (model.tensor_bytes and not p.uva)


@settings(max_examples=200, deadline=None)
@given(model=model_st, budget=st.integers(0, 2 * 10**9), extra=st.integers(0, 10**9), tokens=tokens_st,
       strategy=strategy_st)
def test_more_budget_never_predicts_slower(model, budget, extra, tokens, strategy):
    try:
        small = plan(model, budget, tokens, H200, strategy)
    except BudgetError:
        return
    large = plan(model, budget + extra, tokens, H200, strategy)
    # what plan minimizes, to a nanosecond (a warm forward is a difference of two simulated ends)
    assert round(large.prediction.again_ms, 6) <= round(small.prediction.again_ms, 6)


@settings(max_examples=100, deadline=None)
@given(model=model_st, budget=st.integers(0, 2 * 10**9), tokens=tokens_st)
def test_auto_is_never_predicted_slower_than_either_strategy(model, budget, tokens):
    for strategy in ("stream", "uva"):
        try:
            other = plan(model, budget, tokens, H200, strategy)
        except BudgetError:
            continue
        assert round(plan(model, budget, tokens, H200, "auto").prediction.again_ms, 6) <= \
            round(other.prediction.again_ms, 6)


LLAMA_8B = ModelCost(fixed_bytes=2_101_346_304, head_bytes=1_050_673_152, block_bytes=(436_224_000,) * 32)


def test_everything_fits_means_nothing_moves():
    p = plan(LLAMA_8B, 17 * 10**9)
    assert p.streamed == p.uva == () and p.kind == "resident"


def test_decode_at_a_small_budget_streams_and_prefill_too():
    budget = LLAMA_8B.fixed_bytes + 2 * 436_224_000
    decode = plan(LLAMA_8B, budget, tokens=1)
    assert decode.kind == "stream" and decode.prediction.bound == "link"
    # at decode compute is tiny: one block fewer on the link beats overlapping copy with compute
    assert (len(decode.streamed), decode.n_slots) == (31, 1)
    prefill = plan(LLAMA_8B, budget, tokens=2048)
    # at 2048 tokens a block computes ~2 ms: two slots overlap it with the copies; zero copy re-reads
    # the weights per tile and would be ~8x slower
    assert prefill.kind == "stream" and (len(prefill.streamed), prefill.n_slots) == (32, 2)


def test_zero_copy_wins_when_two_slots_cost_more_than_they_save():
    # budget one block short of resident: streaming needs two slots and so evicts three blocks;
    # zero copy evicts one block and needs no staging
    budget = LLAMA_8B.fixed_bytes + 31 * 436_224_000
    p = plan(LLAMA_8B, budget, tokens=1)
    assert p.kind == "uva" and len(p.uva) == 1


def test_budget_error_names_the_minimum():
    model = ModelCost(1000, 500, (100, 100))
    with pytest.raises(BudgetError, match=r"at least .*\(1100 bytes\)"):
        plan(model, 1099, strategy="stream")
    assert plan(model, 1100, strategy="stream").n_slots == 1
    with pytest.raises(BudgetError, match=r"\(1000 bytes\)"):
        plan(model, 999)  # zero copy needs no staging: the fixed part alone
    with pytest.raises(ArgumentError, match="strategy"):
        plan(model, 10**6, strategy="fast")
    assert issubclass(BudgetError, WeightstreamError) and issubclass(BudgetError, ValueError)


@settings(max_examples=150, deadline=None)
@given(model=model_st, budget=st.integers(0, 2 * 10**9), host=st.integers(0, 2 * 10**9), tokens=tokens_st,
       strategy=strategy_st)
def test_a_host_budget_is_never_exceeded_and_auto_fits_wherever_streaming_does(model, budget, host, tokens,
                                                                                strategy):
    """With host memory limited (from_pretrained's cpu_memory), every placement keeps its zero-copy
    blocks plus the streamed groups or the disk tier's two bounce buffers within it, and auto (which can
    stream) finds a placement wherever streaming alone does."""
    try:
        p = plan(model, budget, tokens, H200, strategy, host_bytes=host)
    except BudgetError as err:
        assert err.minimum_bytes >= 0
        if strategy == "auto":
            with pytest.raises(BudgetError):
                plan(model, budget, tokens, H200, "stream", host_bytes=host)
        return
    assert host_need(model, p.streamed, p.uva, p.part) <= host
    assert p.gpu_bytes <= budget


def test_a_host_budget_smaller_than_the_zero_copy_blocks_makes_auto_stream():
    """The reported case: auto picks zero copy for decode, but host memory cannot hold the blocks read
    in place; with the host budget given it streams instead (groups beyond it stay on disk). On the
    H200 profile zero copy (about 49 GB/s at one token) wins only with one block off the GPU, now that
    a forward's first copies overlap the forward before; a link where zero copy reads at 1.25x the copy
    rate makes it win with four."""
    block = 436_224_000
    profile = dataclasses.replace(H200, uva={m: 0.8 * H200.copy_s_per_byte for m in H200.uva})
    budget = LLAMA_8B.fixed_bytes + 28 * block  # 4 blocks off the GPU: zero copy reads them in place
    assert plan(LLAMA_8B, budget, profile=profile).kind == "uva"
    assert len(plan(LLAMA_8B, budget, profile=profile).uva) == 4
    host = 3 * block  # holds 3 of the 4 blocks, or the disk tier's two bounce buffers and one more
    p = plan(LLAMA_8B, budget, profile=profile, host_bytes=host)
    assert p.kind == "mix" or p.kind == "stream"
    assert host_need(LLAMA_8B, p.streamed, p.uva, p.part) <= host
    with pytest.raises(BudgetError, match="cpu_memory") as info:
        plan(LLAMA_8B, budget, profile=profile, strategy="uva", host_bytes=host)
    assert info.value.minimum_bytes == 4 * block


@given(n=st.integers(1, 64), data=st.data())
def test_spread_gives_k_distinct_indices(n, data):
    k = data.draw(st.integers(0, n))
    picked = spread(n, k)
    assert len(picked) == k and all(0 <= i < n for i in picked)


def test_streaming_the_largest_tensors_of_every_block_fills_the_budget_closer():
    # four blocks of a 2048-byte "MLP" between two 256-byte tensors; a budget of 4096 bytes. Whole
    # blocks need a 2560-byte slot and leave no room for a resident block: all 10240 bytes stream.
    # Streaming each block's MLP through one 2048-byte slot keeps the eight small tensors resident.
    model = _with_tensors(0, [[256, 2048, 256]] * 4, 0)
    p = plan(model, budget=4096, tokens=1, profile=H200, strategy="stream")
    assert p.part == 1 and p.streamed == (0, 1, 2, 3) and p.n_slots == 1
    assert p.resident_bytes == 8 * 256 and p.slot_bytes == 2048 and p.gpu_bytes == 4096


def test_mixture_of_experts_decode_reads_routed_experts_in_place_and_prefill_streams():
    """On the Mixtral-8x7B shape at 25% of its weights, one token reaches 2 of 8 experts per block: zero
    copy reads about a quarter of the expert bytes, while a copy moves all of them (measured on the H200:
    398.9 ms for zero copy against 1341.4 ms streaming). At 2048 tokens every expert is reached and
    streaming wins."""
    pytest.importorskip("transformers")
    from weightstream.placement.prepare import prepare
    from weightstream.placement.shapes import meta_model

    model = meta_model("mixtral-8x7b")
    budget = int(0.25 * sum(p.numel() * p.element_size() for p in model.parameters()))
    decode = prepare(model, budget, "cpu", allow_meta=True, tokens=1)
    expert_bytes = 32 * 3 * 8 * 4096 * 14336 * 2
    assert sum(decode.cost.routed_bytes) == expert_bytes
    assert (decode.cost.experts, decode.cost.top_k) == (8, 2)
    assert decode.placement.kind == "uva" and decode.placement.prediction.ms < 500
    prefill = prepare(model, budget, "cpu", allow_meta=True, tokens=2048)
    assert prefill.placement.kind == "stream"
    dense = prepare(meta_model("llama-3-8b"), 4 * 2**30, "cpu", allow_meta=True)
    assert dense.cost.routed_bytes == () and dense.cost.experts == 0
