"""`weightstream bench --profile DIR`: where one call's host time goes, after each measurement.

For every measured row (any mode, CPU or CUDA), after its timing and comparison:
- `host_enqueue_ms`: the median host time to issue one call, each started on an idle device (perf_counter
  around the Python call): where it is well below the row's median, the host is not what holds the call
  up; where it is about the median, the call is host-bound (formerly `benchmarks/diag_eager_host.py`);
- on CUDA, `sync_calls`: the synchronizing CUDA calls torch's sync debug mode reports over one call
  (formerly `diag_host_sync.py`; the bench's cache-less LM forward has one, transformers'
  packed-sequence check);
- one call under torch.profiler (CPU activities, and CUDA on a GPU): its Chrome trace written to DIR
  (open it in Perfetto or chrome://tracing), the CUDA runtime calls that block the host (synchronize,
  blocking copies, allocations) with counts and host ms, and the top ops by self CPU time.

All of it goes into the row's `setup["profile"]`; a failure is logged there, never raised. A profiler
session leaves overhead in the process (docs/diagnostics.md: 6-8 ms more per eager 8B decode
afterwards on an H100, with or without TEARDOWN_CUPTI=1), so rows measured after a profiled one may
be slower than without --profile: profile in a run of its own, not in one whose figures are recorded.
"""

from __future__ import annotations

import os
import re
import statistics
import time
import warnings
from collections import Counter
from collections.abc import Callable

import torch

from ..placement.timing import sync
from .progress import first_line, log

BLOCKING = ("Synchronize", "cudaMemcpy", "cuMemcpy", "cudaFree", "cudaMalloc", "cudaHostAlloc",
            "cudaHostRegister", "cudaHostUnregister")  # runtime calls that may block the host
TOP_OPS = 10
HOST_CALLS = 5  # calls timed for host_enqueue_ms


def host_enqueue_ms(call: Callable[[], object], device: torch.device, calls: int = HOST_CALLS) -> float:
    """Median host ms to issue one call, each started on an idle device."""
    times = []
    for _ in range(calls):
        sync(device)
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
    sync(device)
    return statistics.median(times)


def sync_calls(call: Callable[[], object], device: torch.device) -> list[str]:
    """The synchronizing CUDA calls torch's sync debug mode warns about over one call (first lines)."""
    sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sync(device)
    return [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)
            and "prototype" not in str(w.message)]


def profiled(call: Callable[[], object], device: torch.device, trace_path: str) -> dict:
    """One call under torch.profiler; its Chrome trace at `trace_path`; blocking runtime calls and the
    top ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        call()
        sync(device)
    prof.export_chrome_trace(trace_path)
    blocking: Counter = Counter()
    blocking_ms: Counter = Counter()
    for e in prof.events():
        if any(b in e.name for b in BLOCKING) and "Async" not in e.name:
            blocking[e.name] += 1
            blocking_ms[e.name] += (e.time_range.end - e.time_range.start) / 1e3
    ops = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:TOP_OPS]
    return {"trace": trace_path,
            "blocking_calls": {name: {"count": n, "host_ms": blocking_ms[name]}
                               for name, n in blocking.items()},
            "top_ops": [{"name": a.key, "calls": a.count, "self_cpu_ms": a.self_cpu_time_total / 1e3}
                        for a in ops]}


def trace_name(doc: dict, row) -> str:
    """The trace's file name: shape, method, phase, mode and budget of the row."""
    budget = "none" if row.budget_bytes is None else str(row.budget_bytes)
    stem = "_".join((doc["shape"]["name"], row.method, row.phase, row.mode, budget))
    return re.sub(r"[^A-Za-z0-9._-]+", "-", stem) + ".trace.json"


def store_profile(folder: str, doc: dict, row, call: Callable[[], object], device: torch.device) -> None:
    """Profile one measured row's call (module docstring) into `row.setup["profile"]`; never raises."""
    figures: dict = {}
    try:
        os.makedirs(folder, exist_ok=True)
        figures["host_enqueue_ms"] = host_enqueue_ms(call, device)
        if device.type == "cuda":
            figures["sync_calls"] = sync_calls(call, device)
        figures.update(profiled(call, device, os.path.join(folder, trace_name(doc, row))))
        blocking = ", ".join(f"{k} x{v['count']}" for k, v in figures["blocking_calls"].items()) or "none"
        log(f"profile of {row.method} {row.phase} {row.mode}: host {figures['host_enqueue_ms']:.2f} ms to "
            f"enqueue (median {row.median_ms:.2f} ms), blocking calls: {blocking}")
    except Exception as exc:  # a profiler problem must not cost the measurement
        figures["error"] = first_line(exc)
        log(f"profile of {row.method} {row.phase} {row.mode}: {figures['error']}")
    row.setup = {**row.setup, "profile": figures}
