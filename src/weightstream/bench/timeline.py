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


DECODE_KERNEL = "_decode_kernel"  # wire/triton_decoder.py's kernel: its launches are named after it


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


def row_spans(events, row: str) -> list[tuple[float, float]]:
    """`row`'s activities as disjoint (start, end) spans, in order."""
    spans: list[tuple[float, float]] = []
    for start, stop in sorted((float(s), float(e)) for r, _, s, e in events if r == row):
        if spans and start <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], stop))
        else:
            spans.append((start, stop))
    return spans


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The spans where both disjoint, ordered span lists `a` and `b` are covered."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, stop = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < stop:
            out.append((start, stop))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(spans) -> float:
    return sum(stop - start for start, stop in spans)


def idle_causes(events, min_wait_ms: float = 0.05) -> dict[str, float]:
    """What the compute row's idle time within the span was, in ms: waiting while a decode kernel ran
    ("decoding"), waiting while a copy ran and no decode ("copying"), or anything else ("other": idle
    spans shorter than `min_wait_ms`, the host's gaps between an eager forward's launches, wherever a
    copy happened to run, and longer ones with nothing on the GPU)."""
    start = min(float(s) for _, _, s, _ in events)
    stop = max(float(e) for *_, e in events)
    idle, cursor = [], start
    for a, b in row_spans(events, "compute"):
        if a > cursor:
            idle.append((cursor, a))
        cursor = max(cursor, b)
    if stop > cursor:
        idle.append((cursor, stop))
    waits = [(a, b) for a, b in idle if b - a >= min_wait_ms]
    decoding = _length(_overlap(waits, row_spans(events, "decode")))
    busy = row_spans([("busy", "", a, b) for row, _, a, b in events if row in ("decode", "copy")], "busy")
    copying = _length(_overlap(waits, busy)) - decoding
    return {"compute_idle_decoding_ms": decoding, "compute_idle_copying_ms": copying,
            "compute_idle_other_ms": _length(idle) - decoding - copying}


def kernel_gaps(events, max_gap_ms: float = 0.05) -> tuple[list[float], list[float]]:
    """The gaps (us) between consecutive compute activities, up to `max_gap_ms` and not where a decode
    runs, split into those a host->GPU copy spans from end to end and the others: does the link's
    traffic delay the start of kernels? (It does: docs/diffusion.md, "H100 figures".)"""
    copies, decodes = row_spans(events, "copy"), row_spans(events, "decode")
    compute = sorted((float(s), float(e)) for row, _, s, e in events if row == "compute")

    def covered(t: float, spans) -> bool:
        return any(a <= t <= b for a, b in spans)

    during, idle = [], []
    for (_, end), (start, _) in zip(compute, compute[1:], strict=False):
        gap = start - end
        if 0 <= gap <= max_gap_ms and not covered(end, decodes):
            (during if covered(end, copies) and covered(start, copies) else idle).append(gap * 1e3)
    return during, idle


def summary(events) -> dict[str, float]:
    """One timeline in figures: its span and each row's busy ms (copy, decode, compute), the compute
    row's idle ms within the span (where compute waited for copies or decodes) and what ran meanwhile
    (`idle_causes`)."""
    if not events:
        return {}
    span = max(float(e) for *_, e in events) - min(float(s) for _, _, s, _ in events)
    rows = {row: busy_ms(events, row) for row in ("copy", "decode", "compute")}
    return {"span_ms": span, **{f"{row}_ms": ms for row, ms in rows.items()},
            "compute_idle_ms": span - rows["compute"], **idle_causes(events)}


def record_timeline(handle_or_model, forward_fn: Callable[[], object]) -> list[tuple[str, str, float, float]]:
    """Run forward_fn() once under torch.profiler (CUDA activities) and return its GPU timeline as
    (stream, label, start_ms, end_ms) tuples (see `timeline_events`). Call it warm: the first forward
    compiles and allocates. An offloaded model's call after another (eager, or compiled without CUDA
    graphs) starts with its first groups copied by the call before, before the profiler started: the
    timeline holds the copies of the next call's first groups instead. On a CPU model or handle it
    returns [] (there is no copy stream)."""
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
    """Profile one more call and keep its copy/compute timeline in the document's `timelines` (an
    offloaded method at the first budget only; the resident model too, the baseline of its kernels and
    of the gaps between them); a profiler failure is logged, never raised (it must not cost the
    measurement)."""
    if row.budget_bytes is not None and row.budget_bytes != doc["budgets"][0]:
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
