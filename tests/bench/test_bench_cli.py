"""`weightstream bench` on the command line: the report mode, a CPU smoke run, the refusal of a large
shape without CUDA and of every other mistake (one line, exit status 2), through both entry points."""

from __future__ import annotations

import json

import pytest
import torch

from weightstream.bench import cli
from weightstream.cli import main as weightstream_main


@pytest.mark.slow
def test_report_mode_writes_the_page_and_plots(bench_stored, tmp_path):
    pytest.importorskip("matplotlib")
    md = tmp_path / "benchmarks.md"
    assert cli.main(["--report", bench_stored, "--md", str(md), "--png-dir", str(tmp_path / "png")]) == 0
    assert (tmp_path / "png" / "bench_tiny.png").stat().st_size > 0
    assert "](png/bench_tiny.png)" in md.read_text()


def test_bench_refuses_a_large_shape_without_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without CUDA")
    assert cli.main(["--shape", "llama-3-8b", "--out", "/nonexistent/never.json"]) == 2
    assert "--shape tiny" in capsys.readouterr().err


def test_weightstream_bench_runs_a_cpu_smoke_run_and_prints_the_table(tmp_path, capsys):
    out = tmp_path / "smoke.json"
    argv = ["bench", "--device", "cpu", "--shape", "tiny", "--budgets", "0.5", "--phases", "decode-b1",
            "--methods", "resident,ws-auto", "--modes", "eager", "--reps", "1", "--out", str(out)]
    assert weightstream_main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["command"] == "weightstream bench " + " ".join(argv[1:])
    assert [r["method"] for r in doc["results"]] == ["resident", "ws-auto"] and doc["results"][1]["exact"]
    printed = capsys.readouterr().out
    assert "| shape | phase | budget | method | mode |" in printed and "| ws-auto | eager |" in printed


def test_an_unknown_method_or_mode_is_refused_with_the_choices(tmp_path, capsys):
    base = ["--device", "cpu", "--shape", "tiny", "--out", str(tmp_path / "x.json")]
    assert cli.main([*base, "--methods", "nope"]) == 2
    assert "choose from resident" in capsys.readouterr().err
    assert cli.main([*base, "--modes", "fast"]) == 2
    assert "graph-eager" in capsys.readouterr().err


def test_validate_mode_checks_stored_files(bench_stored, tmp_path, capsys):
    assert weightstream_main(["bench", "--validate", bench_stored]) == 0
    assert capsys.readouterr().out.startswith(f"valid {bench_stored}: ")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"results": []}))
    assert cli.main(["--validate", bench_stored, str(bad)]) == 1
    assert "INVALID" in capsys.readouterr().out


MISTAKES = {  # name: (argv, what the one line must say); each refused before a model is built
    "--device cuda without CUDA": (["--device", "cuda"], "CUDA is not available here"),
    "--device tpu": (["--device", "tpu"], "give cuda, cuda:N or cpu"),
    "--reps 0": (["--reps", "0"], "--reps 0: time at least 1 forward"),
    "--reps -2": (["--reps", "-2"], "--reps -2: time at least 1 forward"),
    "--max-seconds 0": (["--max-seconds", "0"], "--max-seconds 0: give a positive number of seconds"),
    "--method-seconds -1": (["--method-seconds", "-1"], "--method-seconds -1: give a positive number"),
    "--budgets 0": (["--budgets", "0"], "a fraction must be in (0, 1]"),
    "--budgets empty": (["--budgets", ","], "--budgets is empty"),
    "--phases decode": (["--phases", "decode"], "phase 'decode': write decode-bN"),
    "--methods nope": (["--methods", "nope"], "choose from resident"),
    "--report missing file": (["--report", "/nonexistent/suite.json"], "No such file"),
}


@pytest.mark.parametrize("name", MISTAKES)
def test_every_mistake_ends_in_one_line_and_exit_status_2(name, tmp_path, capsys, monkeypatch):
    argv, says = MISTAKES[name]
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from weightstream.bench import runner

    def never(*args, **kwargs):
        raise AssertionError("the mistake was found only after the run started")

    monkeypatch.setattr(runner, "_start", never)
    defaults = ["--shape", "tiny", "--out", str(tmp_path / "x.json")]
    if "--device" not in argv:
        defaults += ["--device", "cpu"]
    assert weightstream_main(["bench", *defaults, *argv]) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("weightstream bench: ") and says in lines[0], err
