"""`examples/moe_offload.py --tiny --device cpu --check` runs: a tiny Mixtral offloaded at half its bytes
with its routed experts copied and held compressed, its greedy tokens equal to the resident model's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_moe_example_holds_the_experts_compressed_and_matches_the_resident_model():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    command = [sys.executable, str(ROOT / "examples" / "moe_offload.py"), "--tiny", "--device", "cpu",
               "--check", "--tokens", "4"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "random weights" in out and "held compressed, ratio 0." in out
    assert "4 steps: median" in out and "tokens/s" in out
    assert "greedy tokens identical to the resident model's" in out
    assert "copied raw" not in result.stderr  # every expert's blob fits the planned landing buffer
