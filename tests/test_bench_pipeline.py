"""benchmarks/bench_pipeline.py --tiny on the CPU, weightstream only (compress=True, and raw with
--raw-too): the whole tiny Flux pipeline offloaded under 60% of its bytes gives latents and an image
torch.equal to the resident pipeline's, and the run writes its JSON, log and markdown table."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
ROOT = Path(__file__).resolve().parent.parent


def script(name: str):
    """benchmarks/NAME.py as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench_pipeline():
    return script("bench_pipeline")


def test_tiny_pipeline_offloaded_is_exact_against_the_resident_one(tmp_path):
    bench = bench_pipeline()
    pipe = bench.example().build_pipeline(True)
    total = sum(bench.module_bytes(m) for m in pipe.components.values() if isinstance(m, torch.nn.Module))
    # compress=True needs room for the landing buffers of what shrinks (the VAE's convolutions)
    rc = bench.main(["--tiny", "--device", "cpu", "--peers", "none", "--strategy", "stream",
                     "--compress", "true", "--raw-too", "--gpu-memory", str(total * 3 // 5),
                     "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "pipeline_tiny.json").read_text())
    rows = {r["method"]: r for r in doc["rows"]}
    assert set(rows) == {"resident", "weightstream", "weightstream-raw"}
    assert doc["config"]["compress"] is True
    for method, compress in (("weightstream", True), ("weightstream-raw", False)):
        ws_row = rows[method]
        assert rows["resident"]["status"] == ws_row["status"] == "ok"
        assert ws_row["timing"] == "measured" and ws_row["steps_timed"] == doc["config"]["steps"] == 2
        assert ws_row["exact_latents"] is True and ws_row["exact_image"] is True
        assert ws_row["exact_warmup"] is True
        assert ws_row["setup"]["compress"] is compress
        components = ws_row["setup"]["components"]
        streamed = [n for n, c in components.items() if c["streamed_blocks"]]
        assert "transformer" in streamed  # the budget really made it stream
        for c in components.values():  # a compressed component's groups cross the link smaller
            assert c["compressed"] == (c["wire_bytes"] < c["wire_raw_bytes"]) and c["compressed"] <= compress
        assert compress is False or any(c["compressed"] for c in components.values())
    assert "| weightstream |" in (tmp_path / "pipeline_tiny.md").read_text()
    assert "[weightstream]" in (tmp_path / "pipeline_tiny.log").read_text()


def test_the_predicted_pipeline_split_script_prints_every_budget_and_mode(tmp_path, capsys):
    out = tmp_path / "plan.md"
    args = ["--tiny", "--budgets", "100KiB,1KiB", "--decode-gbps", "990", "--out", str(out)]
    assert script("plan_flux_pipeline").main(args) == 0
    text = out.read_text()
    split, alone = text.split("The transformer alone")
    rows = [line for line in split.splitlines() if line.startswith("| 1")]
    assert len(rows) == 6  # two budgets x (False, True, auto)
    steps = [line for line in alone.splitlines() if line.startswith("| 1")]
    assert len(steps) == 2 and "ms/call" in steps[0] and "does not fit" in steps[1]
    assert all("does not fit" in r for r in rows if r.startswith("| 1KiB"))  # below every component's minimum
    fits = [r for r in rows if r.startswith("| 100KiB")]
    assert all("ms/call" in r and "does not fit" not in r for r in fits)
    assert "decode 990 GB/s" in capsys.readouterr().out
