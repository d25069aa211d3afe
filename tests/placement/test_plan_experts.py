"""The planner on mixtures of experts: zero-copy blocks that read only their routed experts in place
(the rest of each resident), chosen where the cost model predicts them faster; the predicted bytes over
the link per forward; every placement valid. Pure logic."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightstream.errors import ArgumentError, BudgetError
from weightstream.placement.cost import ModelCost, predict
from weightstream.placement.layout import pack
from weightstream.placement.plan import host_need, placement_of, plan
from weightstream.placement.probe import H200


def moe(fixed: int, blocks: list[tuple[list[int], list[int]]], experts: int, top_k: int,
        width: int = 0) -> ModelCost:
    """A model whose blocks hold dense tensors then routed expert tensors (each block: (dense sizes,
    routed sizes)), `top_k` of `experts` per token."""
    sizes = tuple(tuple(d + r) for d, r in blocks)
    routed_at = tuple(tuple(range(len(d), len(d) + len(r))) for d, r in blocks)
    routed = tuple(sum(r) for _, r in blocks)
    return ModelCost(fixed, fixed // 2, tuple(map(sum, sizes)), tuple(pack(list(t))[1] for t in sizes),
                     width, sizes, routed if any(routed) else (), experts, top_k,
                     routed_tensors=routed_at if any(routed) else ())


block_st = st.tuples(st.lists(st.integers(1, 2 * 10**7), min_size=1, max_size=3),
                     st.lists(st.integers(10**6, 2 * 10**8), min_size=0, max_size=2))
moe_st = st.builds(
    lambda fixed, blocks, routing, width: moe(fixed, blocks, *routing, width),
    st.integers(0, 10**8), st.lists(block_st, min_size=1, max_size=8),
    st.sampled_from([(8, 2), (64, 6), (128, 8), (32, 4)]), st.sampled_from([0, 2048]))


def total(model: ModelCost) -> int:
    return model.fixed_bytes + sum(model.block_bytes)


@settings(max_examples=200, deadline=None)
@given(model=moe_st, budget=st.integers(0, 2 * 10**9), tokens=st.sampled_from([1, 4, 64, 2048]),
       strategy=st.sampled_from(["auto", "uva", "stream"]),
       host=st.one_of(st.none(), st.integers(0, 2 * 10**9)))
def test_every_placement_fits_and_places_every_tensor_once(model, budget, tokens, strategy, host):
    try:
        p = plan(model, budget, tokens, H200, strategy, host_bytes=host)
    except BudgetError:
        return
    assert p.gpu_bytes <= budget
    assert host is None or host_need(model, p.streamed, p.uva, p.part, p.uva_experts) <= host
    assert not set(p.streamed) & set(p.uva) and set(p.uva_experts) <= set(p.uva)
    assert all(model.experts_apart(i) for i in p.uva_experts)
    assert p.uva_bytes == sum(model.routed_bytes[i] if i in p.uva_experts else model.block_bytes[i]
                              for i in p.uva)
    streamed = sum(model.streamed_bytes(i, p.part) for i in p.streamed)
    # each tensor once: resident (whole blocks, the rest of part-streamed and experts-only blocks, the
    # fixed part), streamed, or read in place
    assert p.resident_bytes + streamed + p.uva_bytes == total(model)
    off = set(p.streamed) | set(p.uva)
    resident = model.fixed_bytes + sum(b for i, b in enumerate(model.block_bytes) if i not in off)
    resident += sum(model.block_bytes[i] - model.streamed_bytes(i, p.part) for i in p.streamed)
    resident += sum(model.block_bytes[i] - model.routed_bytes[i] for i in p.uva_experts)
    assert p.resident_bytes == resident
    if strategy == "stream":
        assert not p.uva
    again = predict(model, p.streamed, p.n_slots, p.uva, tokens, H200, p.part, p.compressed, p.n_landing,
                    p.uva_experts, p.expert_cache, p.expert_slots)
    assert again.again_ms == p.prediction.again_ms


@settings(max_examples=100, deadline=None)
@given(model=moe_st, budget=st.integers(0, 2 * 10**9), extra=st.integers(0, 10**9),
       tokens=st.sampled_from([1, 64, 2048]))
def test_more_budget_never_predicts_slower_and_auto_beats_uva(model, budget, extra, tokens):
    try:
        small = plan(model, budget, tokens, H200)
        uva = plan(model, budget, tokens, H200, "uva")
    except BudgetError:
        return
    assert round(plan(model, budget + extra, tokens, H200).prediction.again_ms, 6) <= \
        round(small.prediction.again_ms, 6)
    assert round(small.prediction.again_ms, 6) <= round(uva.prediction.again_ms, 6)
    # reading experts apart only adds candidates
    whole = plan(model, budget, tokens, H200, "uva", experts_apart=False)
    assert round(uva.prediction.again_ms, 6) <= round(whole.prediction.again_ms, 6)


# a qwen3-30b-a3b-like block: 38 MB of attention and router, 1.2 GB of 128 experts, top 8
QWEN_BLOCK = ([16_777_216, 2_097_152, 2_097_152, 16_777_216, 524_288], [805_306_368, 402_653_184])
QWEN = moe(1_245_708_288 + 4096, [QWEN_BLOCK] * 48, 128, 8, width=2048)


def test_predicted_link_bytes_are_dense_in_full_plus_routed_experts_at_top_k_of_e():
    dense, routed = sum(QWEN_BLOCK[0]), sum(QWEN_BLOCK[1])
    uva = tuple(range(10, 48))
    whole = predict(QWEN, (), 0, uva, 1, H200)
    apart = predict(QWEN, (), 0, uva, 1, H200, uva_experts=uva)
    assert whole.link_bytes == pytest.approx(38 * (dense + routed * 8 / 128))
    assert apart.link_bytes == pytest.approx(38 * routed * 8 / 128)
    assert apart.link_ms < whole.link_ms and apart.ms < whole.ms
    # at 2048 tokens nearly every expert is reached: 1 - (1 - 8/128)^2048 of them
    prefill = predict(QWEN, (), 0, uva, 2048, H200, uva_experts=uva)
    assert prefill.link_bytes == pytest.approx(38 * routed * (1 - (1 - 8 / 128) ** 2048))
    # a streamed block moves every byte of its group
    streamed = predict(QWEN, (47,), 1, (), 1, H200)
    assert streamed.link_bytes == QWEN.block_bytes[47]


def test_experts_apart_is_chosen_where_it_predicts_faster_and_not_where_the_dense_part_does_not_fit():
    budget = 8 * 2**30
    p = plan(QWEN, budget, tokens=1)
    whole = plan(QWEN, budget, tokens=1, experts_apart=False)
    assert p.uva_experts and whole.uva and not whole.uva_experts
    assert p.prediction.again_ms < 0.8 * whole.prediction.again_ms
    # every off-GPU block with its dense part resident: the link carries routed bytes alone
    assert set(p.uva_experts) == set(p.uva) and not p.streamed
    assert p.prediction.link_bytes == pytest.approx(len(p.uva) * sum(QWEN_BLOCK[1]) * 8 / 128)
    # with the fixed part and little more, the dense tensors of 48 blocks do not fit: whole blocks
    tight = plan(QWEN, QWEN.fixed_bytes + 10**8, tokens=1, strategy="uva")
    assert len(tight.uva) == 48 and len(tight.uva_experts) < 48
    # at 2048 tokens every expert is reached: streaming them through slots wins
    assert plan(QWEN, budget, tokens=2048).kind == "stream"


def test_a_forced_placement_must_name_blocks_with_experts_apart():
    dense_only = moe(1000, [([100, 200], [])] * 3, 8, 2)
    with pytest.raises(ArgumentError, match="uva_experts"):
        placement_of(dense_only, (), 0, (0, 1), uva_experts=(0,))
    with pytest.raises(ArgumentError, match="uva_experts"):
        placement_of(QWEN, (), 0, (0, 1), uva_experts=(2,))  # not a zero-copy block


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v2-lite", "gpt-oss-20b"])
def test_published_shapes_read_experts_in_place_at_decode(name):
    """On the built-in shapes at 8 GiB (reference profile): dense tensors resident, routed experts read
    in place, predicted faster than whole zero-copy blocks."""
    pytest.importorskip("transformers")
    from weightstream.placement.prepare import prepare
    from weightstream.placement.shapes import meta_model

    model = meta_model(name)
    prep = prepare(model, 8 * 2**30, "cpu", allow_meta=True, tokens=1, profile=H200)
    whole = prepare(model, 8 * 2**30, "cpu", allow_meta=True, tokens=1, profile=H200, experts_apart=False)
    p, cost = prep.placement, prep.cost
    assert p.uva_experts and p.prediction.again_ms < whole.placement.prediction.again_ms
    # the zero-copy groups hold exactly the routed expert tensors of those blocks
    for block, group in zip(p.uva, prep.uva_groups, strict=True):
        if block in p.uva_experts:
            assert sum(e.nbytes for e, _ in group) == cost.routed_bytes[block]
            assert all(len(e.shape) == 3 and e.shape[0] == cost.experts for e, _ in group)
