"""One measurement: warm-up, timed calls (through `weightstream.placement.timing`, the one way to time), the
bit-for-bit comparison with a reference (the one way to compare outputs), and the link bound.

GPU times are CUDA-event milliseconds between consecutive calls of a loop with no synchronization in
between (`timing.time_calls`): the steady state, where an offloaded model's last blocks have started
copying the next call's first groups. Each timed call still moves all its bytes over the link, so
bytes / link bandwidth stays a bound on it. On a CPU the host clock stands in, so the CPU tests run
the same code.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from ..placement.probe import copy_seconds_per_byte
from ..placement.timing import sync, time_calls

SLOW_CALL_S = 1.0  # a warm call slower than this (seconds) is timed SLOW_REPS times at most
SLOW_REPS = 3
WARMUP_CALLS = 2


def measure(fn: Callable[[], torch.Tensor], reps: int, device: torch.device,
            on_warm: Callable[[], None] | None = None) -> tuple[dict, torch.Tensor]:
    """WARMUP_CALLS untimed calls (the first may compile), then `reps` timed ones (SLOW_REPS at most
    when a warm call takes over SLOW_CALL_S); `on_warm()` is called between the two. Returns the timing
    fields (median_ms, min_ms, max_ms, reps, first_call_s in seconds, peak_allocated_bytes) and the last
    output."""
    walls = []
    for _ in range(WARMUP_CALLS):
        t0 = time.perf_counter()
        fn()
        sync(device)
        walls.append(time.perf_counter() - t0)
    reps = min(reps, SLOW_REPS) if walls[-1] > SLOW_CALL_S else reps
    if on_warm is not None:
        on_warm()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, out = time_calls(fn, reps, device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    entry = {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "reps": reps,
             "first_call_s": walls[0], "peak_allocated_bytes": peak}
    return entry, out


def compare_outputs(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float | None]:
    """(torch.equal of `out` and `ref` on the CPU, max |out - ref| when they differ in values and agree
    in shape, else None)."""
    out = out.detach().cpu()
    exact = torch.equal(out, ref)
    if exact or out.shape != ref.shape:
        return exact, None
    return exact, (out.float() - ref.float()).abs().max().item()


def link_bound_ms(link_bytes: int | None, bandwidth_GBps: float | None) -> float | None:
    """Milliseconds to move `link_bytes` over the host->GPU link at `bandwidth_GBps` (1e9 bytes/s);
    None without a bandwidth or bytes."""
    if not bandwidth_GBps or not link_bytes:
        return None
    return link_bytes / (bandwidth_GBps * 1e9) * 1e3


def fill_row(row, entry: dict, bandwidth_GBps: float | None) -> None:
    """Set a result row's timing fields from `entry` (as `measure` returns it), its tokens/s (row.tokens
    per median), its link bound from row.link_bytes and the bandwidth, and ratio = median / bound."""
    for key, value in entry.items():
        setattr(row, key, value)
    row.tokens_per_s = row.tokens / (row.median_ms / 1e3)
    row.link_bound_ms = link_bound_ms(row.link_bytes, bandwidth_GBps)
    if row.link_bound_ms:
        row.ratio = row.median_ms / row.link_bound_ms


def h2d_bandwidth(device: torch.device, nbytes: int = 2**30) -> float:
    """Host->GPU copy speed from pinned memory in GB/s (1e9 bytes): the probe's median of 10 copies of
    `nbytes` after 3 warm-ups, timed with CUDA events."""
    return 1e-9 / copy_seconds_per_byte(device, nbytes)
