"""Readings of stored results that run nothing (no GPU needed):

- `weightstream bench --bound RESULTS...` (`bound_table`, formerly `benchmarks/diffusion_bound.py`):
  each row's ms against the bound max(compute, transfer), compute = the resident model's median in the
  same phase and mode (eager where that mode has none), transfer = the row's link bound (its bytes over
  the host->GPU link at the rate measured at the start of its run). A streaming method can be no faster
  than the larger of the two; `x bound` = ms / bound.
- `weightstream bench --waits RESULTS...` (`waits_text`, formerly `benchmarks/timeline_waits.py`): for
  each stored timeline, the span, each row's busy ms and the compute row's idle ms split by what ran
  meanwhile (a decode, a copy, or neither: the host's gaps between launches), recomputed from the
  stored events (so older files read the same); the idle ms before the first compute after the first
  copy began (the wait for the first streamed group); and the median gap between consecutive kernels
  while a copy runs and while the link idles.
"""

from __future__ import annotations

import statistics

from .schema import load_results
from .timeline import kernel_gaps, row_spans, summary


def bound_rows(doc: dict) -> list[dict]:
    """One entry per row: method, budget, mode, ms, compute, transfer, bound, ratio, exact, note."""
    resident = {(r["phase"], r["mode"]): r["median_ms"] for r in doc["results"]
                if r["method"] == "resident" and r.get("median_ms")}
    out = []
    for r in doc["results"]:
        compute = resident.get((r["phase"], r["mode"])) or resident.get((r["phase"], "eager"))
        transfer = r.get("link_bound_ms") or 0.0
        bound = max(compute or 0.0, transfer) or None
        out.append({"shape": doc["shape"]["name"], "phase": r["phase"], "method": r["method"],
                    "budget_GiB": None if r["budget_bytes"] is None else r["budget_bytes"] / 2**30,
                    "mode": r["mode"], "ms": r.get("median_ms"), "compute_ms": compute,
                    "transfer_ms": transfer, "bound_ms": bound,
                    "ratio": r["median_ms"] / bound if r.get("median_ms") and bound else None,
                    "exact": r.get("exact"), "note": r.get("error") or r.get("skipped")})
    return out


def _num(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def bound_table(docs: list[dict]) -> str:
    """A markdown table of `bound_rows` of every document, with each run's link rate."""
    lines = ["| shape | phase | budget | method | mode | ms | compute ms | transfer ms | bound ms | x bound "
             "| exact |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for doc in docs:
        for r in bound_rows(doc):
            budget = "-" if r["budget_GiB"] is None else f"{r['budget_GiB']:.2f} GiB"
            ms = _num(r["ms"]) if r["ms"] is not None else (r["note"] or "-").replace("|", "/")[:60]
            lines.append(f"| {r['shape']} | {r['phase']} | {budget} | {r['method']} | {r['mode']} | {ms} "
                         f"| {_num(r['compute_ms'])} | {_num(r['transfer_ms'])} | {_num(r['bound_ms'])} "
                         f"| {_num(r['ratio'], 3)} | {r['exact']} |")
    rates = ", ".join(f"{d['shape']['name']} {d['h2d_bandwidth_GBps']:.1f} GB/s" for d in docs
                      if d.get("h2d_bandwidth_GBps"))
    return "\n".join(lines) + f"\n\nMeasured pinned host->GPU rate: {rates or '-'}"


def first_wait(events) -> float:
    """ms compute sat idle from the first copy's start to the end of the first streamed group's wait:
    the first compute idle span that holds a copy."""
    copies = row_spans(events, "copy")
    if not copies:
        return 0.0
    cursor = None
    for a, b in row_spans(events, "compute"):
        if cursor is not None and a > copies[0][0] and cursor < copies[0][1]:
            return a - max(cursor, copies[0][0])
        cursor = b
    return 0.0


def waits_text(paths: list[str]) -> str:
    """The `--waits` report of every timeline stored in the result files at `paths`."""
    lines = []
    for path, doc in zip(paths, load_results(paths), strict=True):
        if not doc.get("timelines"):
            lines.append(f"{path}: no timelines stored (run without --no-timeline)")
        for t in doc.get("timelines", []):
            events = [tuple(e) for e in t["events"]]
            budget = t.get("budget_bytes")
            where = f" budget {budget / 2**30:.2f} GiB" if budget else ""
            lines.append(f"{path}: {t['method']} {t['phase']} {t.get('mode', 'eager')}{where}")
            lines.append("  " + ", ".join(f"{k} {v:.1f}" for k, v in summary(events).items())
                         + f", first_group_wait_ms {first_wait(events):.1f}")
            during, idle = kernel_gaps(events)
            parts = [f"{name}: {statistics.median(g):.1f} us median of {len(g)}"
                     for name, g in (("during a copy", during), ("link idle", idle)) if g]
            if parts:
                lines.append("  gaps between kernels under 50 us, " + "; ".join(parts))
    return "\n".join(lines)
