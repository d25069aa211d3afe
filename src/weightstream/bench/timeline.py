"""Profiler timelines: one forward's GPU activities as (stream, label, start_ms, end_ms) rows: host->GPU
copies on the "copy" row, the compressed groups' decode kernels on "decode" and everything else on
"compute", to see whether copies and decodes hide behind compute."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..offload import OffloadHandle, handle_of
from .progress import first_line, log


def _cuda_device_of(obj) -> torch.device | None:
    """The CUDA device of a handle or a model, or None when it is not on CUDA."""
    if isinstance(obj, OffloadHandle):
        return obj.device if obj.device.type == "cuda" else None
    try:
        return _cuda_device_of(handle_of(obj))
    except Exception:
        pass
    return next((t.device for t in [*obj.parameters(), *obj.buffers()] if t.device.type == "cuda"), None)


DECODE_KERNEL = "_decode_kernel"  # codec_triton's kernel: its launches are named after it


def row_of(name: str) -> str:
    """The timeline row of a GPU activity: "copy" (host->GPU), "decode" (weightstream's decoder of
    compressed groups) or "compute" (everything else)."""
    if "Memcpy HtoD" in name:
        return "copy"
    return "decode" if DECODE_KERNEL in name else "compute"


def timeline_events(profile_events) -> list[tuple[str, str, float, float]]:
    """(stream, label, start_ms, end_ms) of the GPU activities among torch.profiler events, each on the
    row `row_of` gives it. Times are from the first activity."""
    from torch.autograd import DeviceType

    gpu = [e for e in profile_events if getattr(e, "device_type", None) == DeviceType.CUDA]
    if not gpu:
        return []
    t0 = min(e.time_range.start for e in gpu)
    rows = [(row_of(e.name), e.name[:80],
             (e.time_range.start - t0) / 1e3, (e.time_range.end - t0) / 1e3) for e in gpu]
    return sorted(rows, key=lambda r: r[2])


def busy_ms(events, row: str) -> float:
    """Milliseconds in which `row` has at least one activity (overlapping spans counted once)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted((float(s), float(e)) for r, _, s, e in events if r == row):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def summary(events) -> dict[str, float]:
    """One timeline in figures: its span and each row's busy ms (copy, decode, compute), and the
    compute row's idle ms within the span (where compute waited for copies or decodes)."""
    if not events:
        return {}
    span = max(float(e) for *_, e in events) - min(float(s) for _, _, s, _ in events)
    rows = {row: busy_ms(events, row) for row in ("copy", "decode", "compute")}
    return {"span_ms": span, **{f"{row}_ms": ms for row, ms in rows.items()},
            "compute_idle_ms": span - rows["compute"]}


def record_timeline(handle_or_model, forward_fn: Callable[[], object]) -> list[tuple[str, str, float, float]]:
    """Run forward_fn() once under torch.profiler (CUDA activities) and return its GPU timeline as
    (stream, label, start_ms, end_ms) tuples (see `timeline_events`). Call it warm: the first forward
    compiles and allocates. On a CPU model or handle it returns [] (there is no copy stream)."""
    from torch.profiler import ProfilerActivity, profile

    device = _cuda_device_of(handle_or_model)
    if device is None:
        return []
    for activities in ([ProfilerActivity.CUDA], [ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        with profile(activities=activities) as prof:
            forward_fn()
            torch.cuda.synchronize(device)
        events = timeline_events(prof.events())
        if events:  # some builds report GPU activities only alongside CPU ones
            return events
    return []


def store_timeline(doc: dict, row, model, call: Callable[[], torch.Tensor]) -> None:
    """Profile one more call and keep its copy/compute timeline in the document's `timelines` (first
    budget only); a profiler failure is logged, never raised (it must not cost the measurement)."""
    if row.budget_bytes != doc["budgets"][0]:
        return
    try:
        events = record_timeline(model, call)
    except Exception as exc:  # a profiler problem must not cost the measurement
        log(f"timeline of {row.method} {row.phase}: {first_line(exc)}")
        return
    if events:
        figures = summary(events)
        doc["timelines"].append({"method": row.method, "phase": row.phase, "mode": row.mode,
                                 "budget_bytes": row.budget_bytes, "events": events, "summary": figures})
        log(f"timeline of {row.method} {row.phase} {row.mode}: "
            + ", ".join(f"{k} {v:.1f}" for k, v in figures.items()))
