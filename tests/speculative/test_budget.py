"""One gpu_memory for the model and its draft (`speculative/budget.py`): the split fits the budget over
budgets and draft settings, a budget too small names what it needs (and that much suffices), the
offloaded model and the built draft take what was planned, generation with the split equals plain
greedy, and `weightstream plan --speculate` shows the split."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import hf_config, make_model, weight_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_loop import plain_greedy, repetitive_prompt

import weightstream as ws
from weightstream.cli import main
from weightstream.errors import BudgetError
from weightstream.speculative import DraftModel, offload_with_draft, plan_split
from weightstream.speculative.shape_choice import MAX_TREE_TOKENS, PRIOR_ACCEPTANCE


@pytest.fixture(scope="module")
def llama():
    return make_model("llama")


def drafts(draft_model):
    return {"prompt-lookup": "prompt-lookup", "none": None, "self": "self",
            "int4-g64": ws.SelfDraft(bits=4, group=64), "int8": ws.SelfDraft(bits=8),
            "model": draft_model}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fraction=st.floats(0.05, 1.3),
       kind=st.sampled_from(["prompt-lookup", "none", "self", "int4-g64", "int8", "model"]),
       strategy=st.sampled_from(["stream", "auto"]))
def test_the_split_fits_the_budget_or_names_a_budget_that_does(llama, fraction, kind, strategy):
    draft_model = make_model("llama", seed=1)
    draft = drafts(draft_model)[kind]
    budget = int(weight_bytes(llama) * fraction)
    try:
        split = plan_split(llama, budget, draft, device="cpu", strategy=strategy)
    except BudgetError as err:
        assert err.minimum_bytes > budget
        try:  # the bytes the error names are enough
            split = plan_split(llama, err.minimum_bytes, draft, device="cpu", strategy=strategy)
        except BudgetError as again:  # the model alone does not fit there: the draft was not the limit
            assert "draft" not in str(err) and again.minimum_bytes >= err.minimum_bytes
            return
        budget = err.minimum_bytes
    p = split.placement
    assert split.resident_bytes + split.staging_bytes + split.draft_bytes == split.total_bytes <= budget
    assert (split.resident_bytes, split.staging_bytes) == (p.resident_bytes, p.staging_bytes)
    assert p.gpu_bytes <= split.weights_budget == budget - split.draft_bytes
    if kind in ("prompt-lookup", "none"):
        assert split.draft_bytes == 0
    elif kind == "model":
        assert split.draft_bytes == weight_bytes(draft_model)
    else:
        off = len(p.streamed) + len(p.uva)
        assert split.drafted_blocks == off and (split.draft_bytes > 0) == (off > 0)


@pytest.mark.parametrize("draft", [ws.SelfDraft(bits=4, group=64), ws.SelfDraft(bits=8, group=64), "model"])
def test_generation_with_the_split_equals_plain_greedy_and_takes_what_was_planned(llama, draft):
    model = copy.deepcopy(llama)
    if draft == "model":
        draft = make_model("llama", seed=1)
    budget = int(weight_bytes(model) * 0.8)
    if isinstance(draft, torch.nn.Module):
        budget += weight_bytes(draft)
    ids = repetitive_prompt(4)
    split = offload_with_draft(model, budget, draft, device="cpu", strategy="stream")
    stats = ws.handle_of(model).stats
    assert (stats.resident_bytes, stats.staging_bytes) == (split.resident_bytes, split.staging_bytes)
    out = ws.generate(model, ids, 12, draft=draft, width=2, depth=3, eos_token_id=[])
    assert torch.equal(out.tokens, plain_greedy(llama, ids, 12))
    built = out.stats.draft_bytes - (DraftModel(draft).device_bytes() - DraftModel(draft).weight_bytes()
                                     if isinstance(draft, torch.nn.Module) else 0)
    if isinstance(draft, ws.SelfDraft):
        assert len(ws.handle_of(model).streamed_blocks) == split.drafted_blocks > 0
        # every 2-D weight of a drafted block is copied; other tensors only where off the GPU (planned
        # as if the whole block were: an upper bound)
        assert 0 < out.stats.draft_bytes <= split.draft_bytes
        if split.placement.part == 0:
            assert out.stats.draft_bytes == split.draft_bytes
    else:
        assert split.draft_bytes == weight_bytes(draft) and built <= out.stats.draft_bytes
    assert stats.resident_bytes + stats.staging_bytes + split.draft_bytes <= budget
    ws.handle_of(model).restore()


def test_a_draft_that_does_not_fit_names_what_it_needs_and_nothing_is_offloaded(llama):
    model = copy.deepcopy(llama)
    small = int(weight_bytes(model) * 0.45)  # the model's least (one third) fits, not the draft
    with pytest.raises(BudgetError) as err:
        offload_with_draft(model, small, ws.SelfDraft(bits=8), device="cpu", strategy="stream")
    text = str(err.value)
    assert "cannot hold the self int8 g128 draft beside the model's weights" in text
    assert f"({err.value.minimum_bytes} bytes)" in text and "SelfDraft(bits=4)" in text
    assert "low-bit copies of the 4 blocks" in text
    with pytest.raises(ws.WeightstreamError):
        ws.handle_of(model)  # the model stayed as it was
    split = offload_with_draft(model, err.value.minimum_bytes, ws.SelfDraft(bits=8), device="cpu",
                               strategy="stream")
    assert split.total_bytes <= err.value.minimum_bytes
    ws.handle_of(model).restore()

    big = make_model("llama", seed=2)
    with pytest.raises(BudgetError, match="the draft model's weights.*a smaller draft model, draft='self' or "
                                          "draft='prompt-lookup'"):
        plan_split(llama, weight_bytes(big) // 2, big, device="cpu")


def test_the_model_alone_not_fitting_keeps_the_planner_s_own_message(llama):
    with pytest.raises(BudgetError, match="outside the repeated blocks"):
        plan_split(llama, 1000, "self", device="cpu", strategy="stream")


def test_plan_speculate_prints_the_split(tmp_path, capsys):
    hf_config("llama").save_pretrained(tmp_path / "model")
    model = str(tmp_path / "model")
    budget = 450_000  # 80% of the weights
    assert main(["plan", model, "--gpu-memory", str(budget), "--dtype", "float32", "--speculate",
                 "self"]) == 0
    text = capsys.readouterr().out
    assert "budget split with the self int4 g128 draft: target resident" in text and "+ staging" in text
    assert "predicted speculative decode (modelled: the self int4 g128 draft's prior acceptance 0.44" in text
    assert main(["plan", model, "--gpu-memory", str(budget), "--dtype", "float32", "--speculate", "self",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    spec = report["speculative"]
    guess = spec["predicted"]  # the shape generate(width="auto", depth="auto") would choose first
    assert guess["prior_acceptance"] == PRIOR_ACCEPTANCE["self-int4"] and guess["draft_ms"] > 0
    assert guess["tokens"] == 1 + guess["width"] * guess["depth"] <= MAX_TREE_TOKENS
    assert guess["tokens_per_s"] == pytest.approx(
        (1 + guess["expected_accepted"]) / (guess["verify_ms"] + guess["draft_ms"]) * 1e3, rel=1e-2)
    # plain decoding: one forward in a loop a token (the report's decode ms, rounded to 0.01 ms)
    assert 1e3 / guess["plain_tokens_per_s"] == pytest.approx(report["predicted"]["decode"]["ms"], abs=0.006)
    assert guess["speedup"] == pytest.approx(guess["tokens_per_s"] / guess["plain_tokens_per_s"], rel=1e-2)
    assert main(["plan", model, "--gpu-memory", str(budget), "--dtype", "float32", "--speculate",
                 "prompt-lookup", "--json"]) == 0
    lookup = json.loads(capsys.readouterr().out)["speculative"]["predicted"]
    assert lookup["draft_ms"] == 0 and lookup["prior_acceptance"] == PRIOR_ACCEPTANCE["prompt-lookup"]
    assert spec["target_resident_bytes"] + spec["staging_bytes"] + spec["draft_bytes"] == spec["total_bytes"]
    assert spec["total_bytes"] <= budget == spec["gpu_memory"] and spec["draft_bytes"] > 0
    assert report["resident"]["bytes"] == spec["target_resident_bytes"]
    assert report["gpu_bytes"] <= spec["weights_budget"]

    hf_config("llama").save_pretrained(tmp_path / "draft")
    assert main(["plan", model, "--gpu-memory", "2MB", "--dtype", "float32", "--speculate",
                 str(tmp_path / "draft"), "--json"]) == 0
    spec = json.loads(capsys.readouterr().out)["speculative"]
    assert spec["draft"] == "model" and spec["draft_bytes"] == spec["gpu_memory"] - spec["weights_budget"]
    assert spec["predicted"] is None  # a draft model's own forward is not planned here
    assert main(["plan", model, "--gpu-memory", "250000", "--dtype", "float32", "--strategy", "stream",
                 "--speculate", "self"]) == 2
    assert "cannot hold the self int4 g128 draft" in capsys.readouterr().err


@pytest.mark.parametrize("asked", [dict(expert_copies=True), dict(expert_cache=False)])
def test_a_split_refuses_the_expert_options_it_does_not_plan_and_offloads_nothing(llama, asked):
    """The budget split beside a draft plans without expert copies and with the GPU expert cache where
    predicted faster: `offload_with_draft` refuses what it would drop, before anything moves."""
    model = copy.deepcopy(llama)
    with pytest.raises(ws.ArgumentError, match=f"{next(iter(asked))}=.*with the SelfDraft draft"):
        offload_with_draft(model, int(weight_bytes(model) * 0.8), ws.SelfDraft(bits=8), device="cpu",
                           strategy="stream", **asked)
    with pytest.raises(ws.WeightstreamError):
        ws.handle_of(model)  # the model stayed as it was
