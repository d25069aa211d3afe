"""Profiler timelines: one forward's GPU activities as (stream, label, start_ms, end_ms) rows, host->GPU
copies on the "copy" row and everything else on "compute", to see whether copies hide behind compute."""

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


def timeline_events(profile_events) -> list[tuple[str, str, float, float]]:
    """(stream, label, start_ms, end_ms) of the GPU activities among torch.profiler events: host->GPU
    copies ("Memcpy HtoD") on the "copy" row, every other kernel, copy or memset on "compute". Times
    are from the first activity."""
    from torch.autograd import DeviceType

    gpu = [e for e in profile_events if getattr(e, "device_type", None) == DeviceType.CUDA]
    if not gpu:
        return []
    t0 = min(e.time_range.start for e in gpu)
    rows = [("copy" if "Memcpy HtoD" in e.name else "compute", e.name[:80],
             (e.time_range.start - t0) / 1e3, (e.time_range.end - t0) / 1e3) for e in gpu]
    return sorted(rows, key=lambda r: r[2])


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
        doc["timelines"].append({"method": row.method, "phase": row.phase, "mode": row.mode,
                                 "budget_bytes": row.budget_bytes, "events": events})
