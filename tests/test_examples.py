"""The examples run: `examples/flux_offload.py --tiny` offloads a tiny Flux pipeline under half its bytes on
the CPU, prints per-step ms, and its image equals the resident pipeline's (`--check`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("diffusers")
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_flux_example_tiny_mode_runs_and_matches_the_resident_pipeline(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    image = tmp_path / "noise.png"
    command = [sys.executable, str(ROOT / "examples" / "flux_offload.py"), "--tiny", "--device", "cpu",
               "--check", "--out", str(image)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "random weights" in out and "noise" in out
    assert "step   1:" in out and "step   2:" in out and "ms per step" in out
    assert "transformer (x2 per generation)" in out  # planned for the 2 steps it runs
    assert "identical to the resident pipeline's image" in out
    assert image.stat().st_size > 0


def test_flux_example_says_what_it_needs_before_building_anything():
    """Full size without CUDA: refused at once, before anything is built, with the way out (exit 2)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    command = [sys.executable, str(ROOT / "examples" / "flux_offload.py"), "--device", "cpu"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "needs a CUDA GPU" in result.stdout and "--tiny --device cpu" in result.stdout
    assert "random weights" not in result.stdout  # nothing was built


@pytest.mark.parametrize("environment, argv, message", [
    ({}, [], "run under torchrun"),
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0"}, ["--device", "tpu"], "give cuda"),
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0", "CUDA_VISIBLE_DEVICES": ""},
     ["--device", "cuda"], "start fewer ranks, or run with --device cpu"),
])
def test_tensor_parallel_example_says_what_it_needs_before_starting_ranks(environment, argv, message):
    """Without torchrun, with an unknown device, or with fewer GPUs than ranks: one line with the way
    out, exit 2, before any process group starts."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK")}
    env.update(environment, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    command = [sys.executable, str(ROOT / "examples" / "tp_offload.py"), *argv]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stdout and len(result.stdout.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr


def test_flux_example_refuses_a_host_with_too_little_memory_before_building(monkeypatch, capsys):
    """The host-memory branch of the example's own check: the tiny pipeline's weights against a host
    that has fewer bytes available: one line with the way out, nothing built."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("flux_offload", ROOT / "examples" / "flux_offload.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.setattr(example, "available_host_bytes", lambda: 1024)
    real_build = example.build_pipeline

    def sizes_only(tiny, *args, **kwargs):
        assert kwargs.get("device") == "meta", "the check built more than the meta sizes"
        return real_build(tiny, *args, **kwargs)

    monkeypatch.setattr(example, "build_pipeline", sizes_only)
    assert example.need_what_it_takes(True, torch.device("cpu")) is False
    out = capsys.readouterr().out
    assert "of host memory to build" in out and "1.00 KiB is available" in out and "--tiny" in out
