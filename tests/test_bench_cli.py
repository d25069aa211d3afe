"""`weightstream bench` on the command line: the report mode, a CPU smoke run, the refusal of a large
shape without CUDA, through both entry points."""

from __future__ import annotations

import json

import pytest
import torch

from weightstream.bench import cli
from weightstream.cli import main as weightstream_main


def test_report_mode_writes_the_page_and_plots(bench_stored, tmp_path):
    pytest.importorskip("matplotlib")
    md = tmp_path / "benchmarks.md"
    assert cli.main(["--report", bench_stored, "--md", str(md), "--png-dir", str(tmp_path / "png")]) == 0
    assert (tmp_path / "png" / "bench_tiny.png").stat().st_size > 0
    assert "](png/bench_tiny.png)" in md.read_text()


def test_bench_refuses_a_large_shape_without_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without CUDA")
    assert cli.main(["--shape", "llama-3-8b", "--out", "/nonexistent/never.json"]) == 1
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
    assert cli.main([*base, "--methods", "nope"]) == 1
    assert "choose from resident" in capsys.readouterr().err
    assert cli.main([*base, "--modes", "fast"]) == 1
    assert "graph-eager" in capsys.readouterr().err


def test_validate_mode_checks_stored_files(bench_stored, tmp_path, capsys):
    assert weightstream_main(["bench", "--validate", bench_stored]) == 0
    assert capsys.readouterr().out.startswith(f"valid {bench_stored}: ")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"results": []}))
    assert cli.main(["--validate", bench_stored, str(bad)]) == 1
    assert "INVALID" in capsys.readouterr().out
