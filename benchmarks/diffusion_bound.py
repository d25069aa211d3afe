"""Per-step ms of every method of diffusion bench runs against the bound max(compute, transfer).

    python3 benchmarks/diffusion_bound.py benchmarks/results/suite_flux-dev-transformer.json ...

compute = the resident model's median in the same phase and mode (every weight on the GPU); transfer =
the bytes a method moves over the host->GPU link per step / the pinned rate measured at the start of
the run (`link_bound_ms`). A streaming method can be no faster than the larger of the two.
"""

from __future__ import annotations

import json
import sys


def rows(doc: dict) -> list[dict]:
    """One entry per measured row: method, budget, mode, ms, compute, transfer, bound, ratio, exact."""
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


def table(docs: list[dict]) -> str:
    """A markdown table of `rows` of every document, with each run's link rate."""
    lines = ["| shape | budget | method | mode | ms/step | compute ms | transfer ms | bound ms | x bound "
             "| exact |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for doc in docs:
        for r in rows(doc):
            def f(x, d=1):
                return "-" if x is None else f"{x:.{d}f}"
            budget = "-" if r["budget_GiB"] is None else f"{r['budget_GiB']:.2f} GiB"
            ms = f(r["ms"]) if r["ms"] is not None else (r["note"] or "-")[:60]
            lines.append(f"| {r['shape']} | {budget} | {r['method']} | {r['mode']} | {ms} "
                         f"| {f(r['compute_ms'])} | {f(r['transfer_ms'])} | {f(r['bound_ms'])} "
                         f"| {f(r['ratio'], 3)} | {r['exact']} |")
    rates = ", ".join(f"{d['shape']['name']} {d['h2d_bandwidth_GBps']:.1f} GB/s" for d in docs
                      if d.get("h2d_bandwidth_GBps"))
    return "\n".join(lines) + f"\n\nMeasured pinned host->GPU rate: {rates or '-'}"


if __name__ == "__main__":
    documents = []
    for path in sys.argv[1:]:
        with open(path) as fh:
            documents.append(json.load(fh))
    print(table(documents))
