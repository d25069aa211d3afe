"""The automatic tree shape: the argmax of the stated objective over cost curves and acceptance rates, a
link-bound verify picks a large tree and a compute-bound one a small one, the acceptance estimate, and
`generate(width="auto", depth="auto")` exact against plain greedy and the resident run."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import make_model
from hypothesis import given, settings
from hypothesis import strategies as st
from test_loop import off_gpu_blocks, offloaded, plain_greedy, repetitive_prompt

import weightstream as ws
from weightstream.errors import ArgumentError
from weightstream.speculative import DraftModel, SelfDraft
from weightstream.speculative.checks import max_depth
from weightstream.speculative.draft_linear import MAX_ROWS
from weightstream.speculative.shape_choice import (
    DEPTHS,
    MAX_TREE_TOKENS,
    candidates,
    choose_shape,
    draft_pass_ms,
    estimate_acceptance,
    expected_accepted,
    objective,
)
from weightstream.speculative.shape_costs import (
    SELF_DRAFT_RATIO,
    SELF_DRAFT_RATIO_LOW_BIT,
    _forward_ms,
    auto_shape,
    drafted_share,
    self_draft_scale,
)


@settings(max_examples=200, deadline=None)
@given(a=st.floats(0, 1), fixed=st.floats(0.1, 500), per_token=st.floats(0, 20), draft=st.floats(0, 50),
       draft_per_token=st.floats(0, 5), max_tokens=st.integers(2, 200), root=st.sampled_from([1, 2]))
def test_the_choice_is_the_argmax_of_the_objective(a, fixed, per_token, draft, draft_per_token, max_tokens,
                                                   root):
    def verify_ms(n: int) -> float:
        return fixed + per_token * n

    def draft_step_ms(w: int) -> float:
        return draft + draft_per_token * w

    choice = choose_shape(a, verify_ms, draft_step_ms, max_tokens=max_tokens, root=root)
    best = objective(a, choice.width, choice.depth, verify_ms, draft_step_ms, root)
    assert all(best >= objective(a, w, d, verify_ms, draft_step_ms, root)
               for w, d in candidates(max_tokens=max_tokens))
    assert choice.tokens <= max_tokens
    assert choice.tokens_per_second == pytest.approx(best * 1e3)
    # a pass drafts the root's step, then one step of `width` tokens for each further level
    want = draft_step_ms(root) + (choice.depth - 1) * draft_step_ms(choice.width)
    assert choice.draft_ms == pytest.approx(want)


def test_a_pass_counts_the_roots_step_at_its_own_tokens():
    """A self-draft's root step runs one token, a draft model's two; then width tokens a level."""
    def step(tokens: int) -> float:
        return {1: 10.0, 2: 12.0, 4: 30.0}[tokens]

    assert draft_pass_ms(4, 1, step) == 10.0
    assert draft_pass_ms(4, 3, step) == 10.0 + 2 * 30.0
    assert draft_pass_ms(4, 3, step, root=2) == 12.0 + 2 * 30.0


def test_a_link_bound_verify_picks_a_large_tree_and_a_compute_bound_one_a_small_one():
    link_bound = choose_shape(0.33, lambda n: 200.0, lambda w: 0.0)
    compute_bound = choose_shape(0.33, lambda n: 2.0 * n, lambda w: 0.0)
    # flat verify ms and free draft steps: the tree that accepts the most, one near the token cap
    most = max(expected_accepted(0.33, w, d) for w, d in candidates())
    assert link_bound.expected_accepted == most and link_bound.tokens > MAX_TREE_TOKENS - 10
    assert compute_bound.tokens <= 5
    assert link_bound.tokens > 10 * compute_bound.tokens


def test_a_costly_draft_step_makes_the_tree_shallower():
    free = choose_shape(0.2, lambda n: 100.0, lambda w: 0.0)
    costly = choose_shape(0.2, lambda n: 100.0, lambda w: 100.0)
    assert costly.depth < free.depth


def test_expected_accepted_follows_the_stated_model():
    assert expected_accepted(0.0, 8, 12) == 0.0
    assert expected_accepted(1.0, 1, 7) == 7.0
    p = 1 - (1 - 0.3) ** 4
    assert expected_accepted(0.3, 4, 3) == pytest.approx(p + p**2 + p**3)


def test_the_acceptance_estimate_moves_from_the_prior_toward_what_was_measured():
    prior = 0.2
    assert estimate_acceptance([], 4, 6, prior) == pytest.approx(prior)
    high = estimate_acceptance([6] * 50, 4, 6, prior)
    low = estimate_acceptance([0] * 50, 4, 6, prior)
    assert low < prior < high
    assert estimate_acceptance([0] * 10_000, 1, 6, prior) < 0.01


def test_bad_values_raise_argument_error():
    with pytest.raises(ArgumentError, match="probability"):
        choose_shape(1.5, lambda n: 1.0, lambda w: 0.0)
    with pytest.raises(ArgumentError, match="allow a smaller"):
        choose_shape(0.5, lambda n: 1.0, lambda w: 0.0, widths=(8,), depths=(12,),
                     max_tokens=MAX_TREE_TOKENS // 2)
    model = make_model("llama")
    ids = repetitive_prompt(1)
    for kwargs in ({"width": "wide"}, {"depth": "deep"}, {"width": 0, "depth": "auto"}, {"width": 2.5}):
        with pytest.raises(ArgumentError):
            ws.generate(model, ids, 4, **kwargs)


@pytest.mark.parametrize("draft", ["prompt-lookup", "self"])
def test_an_automatic_shape_gives_plain_greedy_and_the_resident_run(draft):
    ref = make_model("llama")
    model = offloaded(copy.deepcopy(ref))
    ids = repetitive_prompt(3)
    auto = ws.generate(model, ids, 16, draft=draft, width="auto", depth="auto", eos_token_id=[],
                       output_logits=True, rechoose_after=None)
    stats = auto.stats
    assert stats.predicted_tokens_per_second is not None and stats.predicted_tokens_per_second > 0
    assert "predicted" in str(stats)
    same = draft if draft == "prompt-lookup" else ws.SelfDraft(blocks=off_gpu_blocks(model))
    resident = ws.generate(ref, ids, 16, draft=same, width=stats.width, depth=stats.depth,
                           eos_token_id=[], output_logits=True)
    assert torch.equal(auto.tokens, resident.tokens)
    assert torch.equal(auto.logits, resident.logits)
    assert torch.equal(auto.tokens, plain_greedy(ref, ids, 16))
    assert resident.stats.predicted_tokens_per_second is None  # a shape given: nothing predicted


def test_one_dimension_auto_keeps_the_other_as_given():
    model = make_model("llama")
    stats = ws.generate(model, repetitive_prompt(2), 6, width=3, depth="auto", eos_token_id=[]).stats
    assert stats.width == 3 and 1 <= stats.depth <= DEPTHS[-1]


def test_the_shape_is_chosen_again_from_the_measured_acceptance_and_stays_exact():
    ref = make_model("llama")
    model = offloaded(copy.deepcopy(ref))
    draft = make_model("llama", seed=1)  # accepts almost nothing: far below the prior of a draft model
    ids = repetitive_prompt(3)
    out = ws.generate(model, ids, 12, draft=draft, width=2, depth="auto", eos_token_id=[],
                      rechoose_after=2)
    stats = out.stats
    assert torch.equal(out.tokens, plain_greedy(ref, ids, 12))
    auto = auto_shape(model, DraftModel(draft), 2, "auto", max_depth(model.config, ids.shape[1], 12),
                      False)
    first = auto.choose()
    assert auto.root == 2  # a draft model's first step of a pass runs two tokens (its cache lags one)
    assert first.draft_ms == pytest.approx(auto.draft_step_ms(2) + (first.depth - 1) * auto.draft_step_ms(2))
    assert stats.shapes[0][:2] == (first.width, first.depth) and stats.shapes[0][2] == 2
    assert stats.measured_acceptance == estimate_acceptance(stats.accepted[:2], first.width, first.depth,
                                                            auto.prior)
    again = auto.choose(stats.measured_acceptance)
    assert len(stats.shapes) == 2 and stats.shapes[1][:2] == (again.width, again.depth) == (stats.width,
                                                                                           stats.depth)
    assert again.tokens < first.tokens and sum(n for _, _, n in stats.shapes) == stats.passes
    assert "chosen again after 2 passes" in str(stats)
    kept = ws.generate(model, ids, 4, draft=draft, width=2, depth="auto", eos_token_id=[],
                       rechoose_after=None).stats
    assert kept.shapes == ((first.width, first.depth, kept.passes),) and kept.measured_acceptance is None
    with pytest.raises(ArgumentError, match="rechoose_after"):
        ws.generate(model, ids, 4, width="auto", rechoose_after=0)


def test_a_draft_predicted_slower_than_plain_decoding_warns_and_a_cheap_one_does_not():
    """A resident model drafting for itself: each draft step is predicted to cost what a verify forward
    costs, so no tree beats one token per pass: generate warns with both figures and the way out, and
    goes on exactly. Prompt lookup on an offloaded model (no draft step): no warning."""
    model = make_model("llama")
    ids = repetitive_prompt(3)
    with pytest.warns(UserWarning, match=r"predicted slower than plain decoding.*draft=None"):
        out = ws.generate(model, ids, 8, draft="self", width="auto", depth="auto", eos_token_id=[])
    stats = out.stats
    assert stats.predicted_tokens_per_second < stats.predicted_plain_tokens_per_second
    assert torch.equal(out.tokens, plain_greedy(model, ids, 8))
    offloaded_model = offloaded(make_model("llama"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        stats = ws.generate(offloaded_model, ids, 8, draft="prompt-lookup", width="auto", depth="auto",
                            eos_token_id=[]).stats
    assert stats.predicted_tokens_per_second > stats.predicted_plain_tokens_per_second


def test_a_self_draft_step_costs_its_drafted_blocks_as_measured_per_token_count():
    """Measured on an H100, a drafted block costs SELF_DRAFT_RATIO times its resident time where its
    layers dequantize for cuBLAS (more than MAX_ROWS tokens) and SELF_DRAFT_RATIO_LOW_BIT where they run
    the low-bit matmul: the predicted self-draft step is the resident forward scaled by the share of
    block bytes drafted, the blocks `SelfDraft.block_names` gives (off the GPU; every block of a
    resident model; the ones it names)."""
    model = offloaded(make_model("llama"))
    draft = SelfDraft(bits=4, group=64)
    share = drafted_share(model, draft)
    assert 0 < share <= 1 and ws.handle_of(model).placement.streamed
    auto = auto_shape(model, draft, "auto", "auto", None, False)
    assert auto.root == 1  # the self-draft's first step runs the root alone
    resident_ms = _forward_ms(model, False, resident=True)
    for w in (1, 4):
        ratio = SELF_DRAFT_RATIO_LOW_BIT if w <= MAX_ROWS else SELF_DRAFT_RATIO
        want = resident_ms(w) * (1 - share + share * ratio)
        assert auto.draft_step_ms(w) == pytest.approx(want, rel=1e-9)
        assert auto.draft_step_ms(w) > resident_ms(w)
    assert self_draft_scale(0.0, 1) == 1.0 and self_draft_scale(0.0, 4) == 1.0
    assert self_draft_scale(1.0, MAX_ROWS) == SELF_DRAFT_RATIO_LOW_BIT
    assert self_draft_scale(1.0, MAX_ROWS + 1) == SELF_DRAFT_RATIO > SELF_DRAFT_RATIO_LOW_BIT
    resident = make_model("llama")
    assert drafted_share(resident, draft) == 1.0  # a resident model's self-draft drafts every block
    one = draft.block_names(model)[:1]
    assert 0 < drafted_share(model, SelfDraft(bits=4, group=64, blocks=one)) < share
