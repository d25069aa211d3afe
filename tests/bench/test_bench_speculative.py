"""`weightstream bench --kind speculative` on the CPU: verify-pass rows per tree size, and with a
checkpoint the plain and speculative generation rows (speculative tokens equal to plain)."""

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
    assert [r["phase"] for r in rows] == ["verify-1", "verify-4", "verify-16"]
    assert all(r["method"] == "ws-verify" and r["median_ms"] > 0 and r["error"] is None for r in rows)
    assert [r["tokens"] for r in rows] == [1, 4, 16]


def test_a_checkpoint_adds_plain_and_speculative_generation_rows_with_the_plain_tokens(tmp_path, checkpoint):
    folder, _ = checkpoint
    doc = run(tmp_path, "--checkpoint", str(folder), "--trees", "2", "--new-tokens", "6", "--prompts", "2",
              "--tree", "2x2", "--budgets", "0.5")
    rows = {r["method"]: r for r in doc["results"]}
    assert set(rows) == {"ws-verify", "ws-plain", "ws-speculative-prompt-lookup", "ws-speculative-int4-g64"}
    assert rows["ws-plain"]["exact"] is None and rows["ws-plain"]["phase"] == "generate-6"
    for method in ("ws-speculative-prompt-lookup", "ws-speculative-int4-g64"):
        assert rows[method]["exact"] is True and rows[method]["setup"]["tree"] == "2x2"
        setup = rows[method]["setup"]
        assert setup["identical_share"] == 1.0 and setup["first_difference"] == [None, None]
        assert rows[method]["tokens_per_s"] > 0 and "accepted_per_pass" in rows[method]["setup"]


@pytest.mark.parametrize("argv, message", [
    (["--kind", "speculative", "--shape", "tiny", "--trees", "0"], "--trees: give at least 1"),
    (["--kind", "speculative", "--shape", "tiny", "--trees", "a"], "give whole numbers"),
    (["--kind", "speculative", "--shape", "tiny", "--modes", "graph-eager"], "runs eager, compiled or graph"),
    (["--kind", "speculative", "--shape", "tiny", "--tree", "3"], "give WIDTHxDEPTH"),
    (["--kind", "load", "--shape", "tiny", "--trees", "4"], "--trees does not apply to --kind load"),
])
def test_mistakes_are_one_line_and_exit_2(argv, message, tmp_path, capsys):
    assert main(["bench", "--device", "cpu", *argv, "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
