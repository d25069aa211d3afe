"""benchmarks/bench_load.py on the CPU: a tiny checkpoint saved, loaded into place (host tier) and read
from its files every forward (disk tier), both exact, written as rows of the one schema."""

from __future__ import annotations

import os
import subprocess
import sys

from weightstream.bench.schema import load_results

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_bench_load_writes_two_exact_rows_of_the_schema(tmp_path):
    out = tmp_path / "load.json"
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_load.py"), "--device", "cpu", "--shape",
           "tiny", "--no-drop-page-cache", "--dir", str(tmp_path / "ckpt"), "--gpu-memory", "200KB",
           "--reps", "1", "--out", str(out)]
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=300)
    (doc,) = load_results([str(out)])
    host, disk = doc["results"]
    assert (host["method"], disk["method"]) == ("ws-from_pretrained", "ws-from_pretrained-disk")
    assert host["exact"] is True and disk["exact"] is True
    assert host["setup"]["stats"]["disk_bytes"] == 0 < disk["setup"]["stats"]["disk_bytes"]
    assert disk["setup"]["disk_to_gpu_GBps_steady"] > 0 and not (tmp_path / "ckpt").exists()
