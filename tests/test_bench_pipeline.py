"""benchmarks/bench_pipeline.py --tiny on the CPU, weightstream only: the whole tiny Flux pipeline
offloaded under half its bytes (every component streaming) gives latents and an image torch.equal to the
resident pipeline's, and the run writes its JSON, log and markdown table."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("diffusers")
ROOT = Path(__file__).resolve().parent.parent


def bench_pipeline():
    spec = importlib.util.spec_from_file_location("bench_pipeline", ROOT / "benchmarks" / "bench_pipeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_pipeline_offloaded_is_exact_against_the_resident_one(tmp_path):
    rc = bench_pipeline().main(["--tiny", "--device", "cpu", "--peers", "none", "--strategy", "stream",
                                "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "pipeline_tiny.json").read_text())
    rows = {r["method"]: r for r in doc["rows"]}
    assert set(rows) == {"resident", "weightstream"}
    ws_row = rows["weightstream"]
    assert rows["resident"]["status"] == ws_row["status"] == "ok"
    assert ws_row["timing"] == "measured" and ws_row["steps_timed"] == doc["config"]["steps"] == 2
    assert ws_row["exact_latents"] is True and ws_row["exact_image"] is True
    assert ws_row["exact_warmup"] is True
    streamed = [n for n, c in ws_row["setup"]["components"].items() if c["streamed_blocks"]]
    assert "transformer" in streamed  # the budget really made it stream
    assert "| weightstream |" in (tmp_path / "pipeline_tiny.md").read_text()
    assert "[weightstream]" in (tmp_path / "pipeline_tiny.log").read_text()
