"""`weightstream bench --kind speculative` on the CPU: verify-pass rows per tree size, self-draft step rows,
and with a checkpoint the plain and speculative generation rows (speculative tokens equal to plain)."""

from __future__ import annotations

import json

import pytest

from weightstream.bench.schema import validate
from weightstream.cli import main


def run(tmp_path, *argv: str) -> dict:
    out = tmp_path / "spec.json"
    assert main(["bench", "--kind", "speculative", "--device", "cpu", "--modes", "eager", "--reps", "2",
                 "--context", "16", *argv, "--out", str(out)]) == 0
    return validate(json.loads(out.read_text()))


def test_verify_rows_are_timed_for_each_tree_size(tmp_path):
    doc = run(tmp_path, "--shape", "tiny", "--trees", "1,4,16")
    rows = doc["results"]
    assert doc["kind"] == "speculative"
    assert [r["phase"] for r in rows] == ["verify-1", "verify-4", "verify-16", "draft-step-1", "draft-step-4"]
    assert [r["method"] for r in rows] == ["ws-verify"] * 3 + ["ws-self-draft"] * 2
    assert all(r["median_ms"] > 0 and r["error"] is None for r in rows)
    assert [r["tokens"] for r in rows] == [1, 4, 16, 1, 4]
    assert rows[-1]["link_bytes"] == 0 and rows[-1]["setup"]["draft"] == "self int4 g128"
    # on the CPU every drafted Linear dequantizes (the low-bit matmul is CUDA's, for one-token steps)
    assert [r["setup"]["linear"] for r in rows[-2:]] == ["dequantize + matmul"] * 2


def test_a_checkpoint_adds_plain_and_speculative_generation_rows_with_the_plain_tokens(tmp_path, checkpoint):
    folder, _ = checkpoint
    doc = run(tmp_path, "--checkpoint", str(folder), "--trees", "2", "--new-tokens", "6", "--prompts", "2",
              "--tree", "2x2", "--budgets", "0.75")  # less: the embeddings and int8 copies overflow
    rows = {r["method"]: r for r in doc["results"]}
    drafts = ("ws-speculative-prompt-lookup", *(f"ws-speculative-self-int{b}-g128" for b in (4, 8)))
    assert set(rows) == {"ws-verify", "ws-self-draft", "ws-plain", *drafts}
    assert rows["ws-plain"]["exact"] is None and rows["ws-plain"]["phase"] == "generate-6"
    for bits in (4, 8):  # the draft's copies are in the budget: the weights got less of it
        setup = rows[f"ws-speculative-self-int{bits}-g128"]["setup"]
        assert 0 < setup["draft_bytes"] and setup["weights_gpu_memory"] < rows["ws-plain"]["budget_bytes"]
    for method in drafts:
        assert rows[method]["exact"] is True and rows[method]["setup"]["tree"] == "2x2"
        setup = rows[method]["setup"]
        assert setup["identical_share"] == 1.0 and setup["first_difference"] == [None, None]
        assert rows[method]["tokens_per_s"] > 0 and "accepted_per_pass" in rows[method]["setup"]
    assert "chat template" in doc["prompts"]
    assert doc["shape"]["name"] == folder.name and doc["shape"]["path"] == str(folder)  # no path in names


def test_a_tokenizer_without_a_chat_template_gets_the_passage_as_plain_text(checkpoint):
    """A GGUF converted by transformers may come without its chat template (Gemma-3-270M's): the bench
    frames the passage as plain text instead of failing, and the document says which form it used."""
    from weightstream.bench.speculative_run import ASK, prompt_form, prompt_ids

    _, tokenizer = checkpoint
    text = "w5 w6 w7"
    chat = prompt_ids(tokenizer, text)
    assert "chat template" in prompt_form(tokenizer)
    tokenizer.chat_template = None
    plain = prompt_ids(tokenizer, text)
    assert "plain text" in prompt_form(tokenizer)
    want = tokenizer(ASK + text + "\n\n", return_tensors="pt")["input_ids"]
    assert plain.shape[0] == 1 and plain.tolist() == want.tolist()
    assert chat.tolist() != plain.tolist()


@pytest.mark.slow
def test_generation_rows_run_in_the_modes_asked_and_compiled_ones_keep_the_plain_tokens(tmp_path, checkpoint):
    folder, _ = checkpoint
    doc = run(tmp_path, "--checkpoint", str(folder), "--trees", "2", "--new-tokens", "6", "--prompts", "2",
              "--tree", "2x2", "--budgets", "0.75", "--modes", "compiled")
    generation = [r for r in doc["results"] if r["phase"] == "generate-6"]
    drafts = ("prompt-lookup", "self-int4-g128", "self-int8-g128")
    assert {r["method"] for r in generation} == {"ws-plain", *(f"ws-speculative-{d}" for d in drafts)}
    assert {r["mode"] for r in generation} == {"compiled"}
    for row in generation:
        assert row["error"] is None and row["exact"] in ((None,) if row["method"] == "ws-plain" else (True,))


def test_an_automatic_tree_records_the_shape_chosen_for_each_prompt(tmp_path, checkpoint):
    folder, _ = checkpoint
    doc = run(tmp_path, "--checkpoint", str(folder), "--trees", "2", "--new-tokens", "6", "--prompts", "2",
              "--tree", "auto", "--budgets", "0.75")
    rows = [r for r in doc["results"] if r["phase"] == "generate-6" and r["method"] != "ws-plain"
            and r["error"] is None]
    assert rows
    for row in rows:
        assert row["exact"] is True and row["setup"]["tree"] == "auto"
        shapes = row["setup"]["shapes"]
        assert len(shapes) == 2 and all(1 <= int(s.split("x")[0]) <= 8 for s in shapes)


def test_a_checkpoint_in_bf16_reports_the_share_of_identical_prompts(tmp_path, checkpoint):
    """In bf16 a near-tie may flip a token (docs/speculative.md): the rows report the share of prompts
    identical to plain greedy and where each first differs, and the run exits 0 either way."""
    folder, _ = checkpoint
    doc = run(tmp_path, "--checkpoint", str(folder), "--trees", "2", "--new-tokens", "6", "--prompts", "3",
              "--tree", "2x2", "--budgets", "1.0", "--checkpoint-dtype", "bfloat16")
    assert doc["shape"]["dtype"] == "torch.bfloat16"
    generation = [r for r in doc["results"] if r["phase"] == "generate-6" and r["method"] != "ws-plain"]
    assert len(generation) == 3
    for row in generation:
        setup = row["setup"]
        assert 0.0 <= setup["identical_share"] <= 1.0 and len(setup["first_difference"]) == 3
        assert row["exact"] == (setup["identical_share"] == 1.0)
        assert all(d is None or 0 <= d < 6 for d in setup["first_difference"])


@pytest.mark.parametrize("argv, message", [
    (["--kind", "speculative", "--shape", "tiny", "--trees", "0"], "--trees: give at least 1"),
    (["--kind", "speculative", "--shape", "tiny", "--trees", "a"], "give whole numbers"),
    (["--kind", "speculative", "--shape", "tiny", "--modes", "graph-x"], "runs eager, compiled, graph or"),
    (["--kind", "speculative", "--shape", "tiny", "--modes", "graph-eager"], "run it on a CUDA device"),
    (["--kind", "speculative", "--shape", "tiny", "--tree", "3"], "give WIDTHxDEPTH"),
    (["--kind", "load", "--shape", "tiny", "--trees", "4"], "--trees does not apply to --kind load"),
    (["--kind", "speculative", "--shape", "tiny", "--checkpoint-dtype", "bfloat16"], "give one, or leave it"),
])
def test_mistakes_are_one_line_and_exit_2(argv, message, tmp_path, capsys):
    assert main(["bench", "--device", "cpu", *argv, "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.gpu
def test_graph_eager_rows_replay_a_capture_of_the_eager_forward_with_its_logits(tmp_path):
    """`--modes graph-eager`: each verify and draft-step row replays a CUDA graph of the eager forward
    (no compile); a replay's logits equal an eager run's of the same inputs over the same cache."""
    import copy

    import torch

    from weightstream.bench.memory import module_bytes
    from weightstream.bench.shapes import build_model
    from weightstream.offload import offload
    from weightstream.speculative.cache import TreeCache
    from weightstream.speculative.tree import causal_mask
    from weightstream.speculative.verify import TreeForward

    out = tmp_path / "spec.json"
    assert main(["bench", "--kind", "speculative", "--device", "cuda", "--shape", "tiny", "--modes",
                 "graph-eager", "--reps", "3", "--context", "16", "--trees", "1,8", "--out", str(out)]) == 0
    rows = validate(json.loads(out.read_text()))["results"]
    assert [(r["method"], r["mode"]) for r in rows] == [("ws-verify", "graph-eager")] * 2 + [
        ("ws-self-draft", "graph-eager")] * 2
    assert all(r["error"] is None and r["median_ms"] > 0 for r in rows)
    assert [r["setup"]["linear"] for r in rows[2:]] == ["low-bit matmul", "dequantize + matmul"]
    model = build_model("tiny", torch.device("cuda"), 0).eval().requires_grad_(False)
    twin = copy.deepcopy(model)
    offload(model, gpu_memory=module_bytes(model) // 2, device="cuda")
    ids = torch.arange(5) % 7
    args = (ids, torch.arange(5) + 16, torch.arange(5) + 16, causal_mask(16, 5, 32))
    logits = []
    for m in (model, twin):
        forward = TreeForward(m, TreeCache(m.config.num_hidden_layers, 32), "cuda", m.dtype)
        forward.prefill(torch.arange(16) % 11)
        if m is model:
            logits.append(forward.captured(*args)().clone())
        else:
            logits.append(forward.run(*args))
    assert torch.equal(logits[0], logits[1])
