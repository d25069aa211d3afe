"""Readers for result files written before the one schema, by the scripts the bench package replaced:
`bench_core.py` (`results` a dict per method and phase), `bench_plan.py` (`points`) and `bench_load.py`
(`host_tier`, `disk_tier`). `upgrade` turns each into a document of `schema.py` with rows as the
bench writes them now, so `load_results`, the report and the plots read every file on record.

What the old files lack is left None (e.g. a sweep point's link bytes); what they hold beyond the
schema goes into the row's `setup`. Old core ratios for prefill were to max(resident, link bound):
the converted `ratio` is median / link bound like every row, the old value kept as
`setup.legacy_ratio`.
"""

from __future__ import annotations

import re
from dataclasses import asdict

from ..sizes import parse_size
from .measure import fill_row
from .schema import ResultRow

_CORE_METHODS = {"resident": "resident", "stream": "ws-stream", "uva": "uva-vllm-style",
                 "accelerate": "accelerate-cpu_offload"}
_CORE_MODES = ("eager", "compiled", "graph")
_HEADER_KEYS = ("command", "date", "gpu", "torch", "transformers", "weightstream", "python",
                "h2d_bandwidth_GBps", "inductor_emulate_precision_casts")


def upgrade(doc: dict) -> dict:
    """`doc` itself when it is of the current schema, else the converted document; an unknown layout
    is returned unchanged (validation then names what is missing)."""
    if not isinstance(doc, dict) or isinstance(doc.get("results"), list):
        return doc
    if isinstance(doc.get("results"), dict):
        return from_core(doc)
    if "points" in doc:
        return from_plan(doc)
    if "host_tier" in doc:
        return from_load(doc)
    return doc


def _option(command: str, flag: str, default: str) -> str:
    """The value given to `flag` on a recorded command line, or `default`."""
    match = re.search(rf"{re.escape(flag)}[ =](\S+)", command)
    return match.group(1) if match else default


def _header(doc: dict, source: str, shape: dict, weight_bytes: int, rows: list[dict]) -> dict:
    head = {k: doc[k] for k in _HEADER_KEYS if k in doc}
    head.setdefault("date", "not recorded")
    budgets = list(dict.fromkeys(r["budget_bytes"] for r in rows if r["budget_bytes"] is not None))
    phases = list(dict.fromkeys(r["phase"] for r in rows))
    return {**head, "converted_from": source, "shape": shape, "weight_bytes": weight_bytes,
            "budgets": budgets, "phases": phases, "reference": "resident", "skipped_methods": {},
            "timelines": [], "results": rows}


def _timed(row: ResultRow, entry: dict, bandwidth: float | None) -> None:
    """Fill a row's numbers from an old timed entry (median_ms and the fields the schema knows)."""
    keys = ("median_ms", "min_ms", "max_ms", "reps", "first_call_s", "peak_allocated_bytes", "max_abs_diff")
    fill_row(row, {k: entry[k] for k in keys if k in entry}, bandwidth)


def from_core(doc: dict) -> dict:
    """A `bench_core.py` document: one row per method, phase (`decode` = decode-b1, `prefill` =
    prefill-N) and mode."""
    rows, skipped, bandwidth = [], {}, doc.get("h2d_bandwidth_GBps")
    for old, result in doc["results"].items():
        method = _CORE_METHODS.get(old, old)
        if "skipped" in result:
            skipped[method] = result["skipped"]
            continue
        setup = {**result.get("setup", {}), "teardown": result.get("teardown")}
        budget = setup.get("budget_bytes")
        for phase in ("decode", "prefill"):
            if phase not in result and "error" not in result:
                continue
            part = result.get(phase, {"error": result.get("error")})
            tokens = part.get("tokens", 1)
            name = "decode-b1" if phase == "decode" else f"prefill-{tokens}"
            for mode in _CORE_MODES if "error" not in part else ("eager",):
                entry = part.get(mode) if "error" not in part else {"error": part["error"]}
                if entry is None:
                    continue
                row = ResultRow(method, name, budget, mode, tokens=tokens, link_bytes=setup.get("link_bytes"),
                                setup=setup)
                if "median_ms" in entry:
                    _timed(row, entry, bandwidth)
                    row.setup = {**setup, "repeatable": entry.get("repeatable"),
                                 "legacy_ratio": entry.get("ratio")}
                    row.exact = entry.get("exact")
                    row.reference = "self" if old == "resident" else entry.get("reference")
                else:
                    row.error, row.skipped = entry.get("error"), entry.get("skipped")
                rows.append(asdict(row))
    out = _header(doc, "bench_core.py", doc["shape"], doc["weight_bytes"], rows)
    out["skipped_methods"] = skipped
    out["versions"] = {"accelerate": doc.get("accelerate")}
    return out


def from_plan(doc: dict) -> dict:
    """A `bench_plan.py` sweep: one row per budget, phase and strategy (method `ws-<strategy>`); decode
    was a CUDA graph of the eager forward (mode graph-eager), prefill eager; the placement and the
    prediction go into the setup as the bench records them now."""
    cuda = not doc.get("gpu", "").startswith("none")
    rows = []
    for p in doc["points"]:
        name = "decode-b1" if p["phase"] == "decode" else f"prefill-{p['tokens']}"
        mode = "graph-eager" if p["phase"] == "decode" and cuda else "eager"
        setup = {"fraction": p["fraction"]}
        if "placement" in p:
            part = f" (each block's {p['part']} largest tensors)" if p.get("part") else ""
            setup.update(placement=f"{p['placement']}: {p['streamed']} streamed{part} / {p['slots']} slots, "
                                   f"{p['uva']} zero copy",
                         prediction={"ms": p["predicted_ms"], "bound": p["bound"]})
        if "same_placement_as" in p:
            setup["same_placement_as"] = p["same_placement_as"]
        row = ResultRow(f"ws-{p['strategy']}", name, p["budget_bytes"], mode, tokens=p["tokens"], setup=setup)
        if "median_ms" in p:
            times = p["times_ms"]
            _timed(row, {"median_ms": p["median_ms"], "min_ms": min(times), "max_ms": max(times),
                         "reps": len(times)}, None)
            row.exact, row.reference = p.get("exact"), "resident eager"
        else:
            row.error = p.get("error", "not measured")
        rows.append(asdict(row))
    shape = {"name": _option(doc["command"], "--shape", "llama-3-8b"), "dtype": "bfloat16"}
    out = _header(doc, "bench_plan.py", shape, doc["weight_bytes"], rows)
    out["profile"] = doc.get("profile")
    return out


def from_load(doc: dict) -> dict:
    """A `bench_load.py` document: one decode-b1 eager row for the host tier (`ws-from_pretrained`) and
    one for the disk tier (`ws-from_pretrained-disk`), the load figures in their setups."""
    budget = parse_size(_option(doc["command"], "--gpu-memory", "4GiB"))
    reps = int(_option(doc["command"], "--reps", "5"))
    bandwidth = doc.get("h2d_bandwidth_GBps")
    common = {k: doc[k] for k in ("save_s", "checkpoint_bytes", "page_cache_dropped") if k in doc}
    rows = []
    for method, key in (("ws-from_pretrained", "host_tier"), ("ws-from_pretrained-disk", "disk_tier")):
        tier = doc.get(key)
        if tier is None:
            continue
        stats = tier.get("stats", {})
        row = ResultRow(method, "decode-b1", budget, "eager", tokens=1,
                        link_bytes=stats.get("streamed_bytes"),
                        reference="resident eager", exact=tier.get("exact"),
                        setup={**common, **{k: v for k, v in tier.items() if k not in ("exact",)}})
        _timed(row, {"median_ms": tier["decode_ms_median"], "reps": reps}, bandwidth)
        row.min_ms = row.max_ms = None  # not recorded
        rows.append(asdict(row))
    stats = doc["host_tier"]["stats"]
    shape = {"name": _option(doc["command"], "--shape", "llama-3-8b"), "dtype": "bfloat16"}
    weight_bytes = stats["resident_bytes"] + stats["streamed_bytes"]
    return _header(doc, "bench_load.py", shape, weight_bytes, rows)



