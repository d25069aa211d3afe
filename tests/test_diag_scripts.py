"""The eager-host diagnoses on the CPU backend (the scripts the device runs; benchmarks/): they must
still run, and what they count must be the engine's real calls."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..")


def run(script: str, tmp_path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", script), "--shape", "tiny", "--device", "cpu",
           "--budget", "0.5", "--strategy", "stream", "--reps", "2", "--out", str(tmp_path), *args]
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=300)
    return (tmp_path / script.replace(".py", ".log")).read_text()


def test_diag_host_sync_times_one_wait_and_one_release_per_streamed_group(tmp_path):
    log = run("diag_host_sync.py", tmp_path)
    groups = int(re.search(r"stream, (\d+) groups", log).group(1))
    assert groups > 0
    assert f"engine.wait: {groups} calls" in log and f"engine.release: {groups} calls" in log


def test_diag_eager_host_reports_resident_and_offloaded(tmp_path):
    log = run("diag_eager_host.py", tmp_path, "--top", "5")
    assert re.search(r"^resident: host [\d.]+ ms to enqueue", log, re.M)
    assert re.search(r"^offloaded: stream, \d+ groups", log, re.M)
    assert log.count("blocking runtime calls:") == 2


def test_diag_profiler_residue_times_both_forwards_before_and_after_a_profiler_session(tmp_path):
    log = run("diag_profiler_residue.py", tmp_path)
    for when in ("before any profiler", "after one profiler session"):
        assert re.search(rf"^{when}, resident: host [\d.]+ ms to enqueue, [\d.]+ ms back to back", log, re.M)
        assert re.search(rf"^{when}, offloaded \(stream, [1-9]\d* groups\): host [\d.]+ ms", log, re.M)


def test_the_cache_forward_skips_transformers_packed_sequence_check(monkeypatch):
    """`--cache` exists to drop the one host synchronization per forward that transformers' mask code
    runs for the bench's cache-less forward (found on the H100 in session 33): the check that holds it
    runs without the cache and not with it, and both forwards give the same next-token logits."""
    import torch
    import transformers.masking_utils as masking

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from diag_eager_host import build

    calls = []
    check = masking.find_packed_sequence_indices
    monkeypatch.setattr(masking, "find_packed_sequence_indices",
                        lambda *a, **k: calls.append(1) or check(*a, **k))
    device = torch.device("cpu")
    _, _, plain = build("tiny", "decode-b1", device)
    _, _, cached = build("tiny", "decode-b1", device, cache=True)
    a = plain()
    assert len(calls) == 1
    b = cached()
    assert len(calls) == 1
    torch.testing.assert_close(a, b)  # two attention paths (no cache, empty cache): not bit for bit
