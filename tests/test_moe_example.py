"""`examples/moe_offload.py --tiny --device cpu --check` runs: a tiny Mixtral offloaded at half its bytes
with its routed experts copied and held compressed, its greedy tokens equal to the resident model's."""

from __future__ import annotations

import runpy
import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def test_the_moe_example_holds_the_experts_compressed_and_matches_the_resident_model(capsys, monkeypatch):
    argv = ["moe_offload.py", "--tiny", "--device", "cpu", "--check", "--tokens", "4"]
    monkeypatch.setattr(sys, "argv", argv)
    with torch.random.fork_rng(), warnings.catch_warnings(record=True) as caught, \
            pytest.raises(SystemExit) as done:  # the example seeds torch: the RNG is given back after it
        warnings.simplefilter("always")
        runpy.run_path(str(ROOT / "examples" / "moe_offload.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert done.value.code == 0, out
    assert "random weights" in out and "held compressed, ratio 0." in out
    assert "4 steps: median" in out and "tokens/s" in out
    assert "greedy tokens identical to the resident model's" in out
    # every expert's blob fits the planned landing buffer
    assert not any("copied raw" in str(w.message) for w in caught)
