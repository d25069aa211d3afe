"""The one result schema of `weightstream bench`: a document with a header and `ResultRow`s, its
validation, and writing and reading it.

Result document (`validate` checks it; sizes in bytes, times in ms, bandwidth in GB/s of 1e9 bytes):
    kind: the `--kind` that wrote it, suite, pipeline, load or codec (optional: older files lack it)
    command, date, gpu, torch, transformers, weightstream, python: strings
    h2d_bandwidth_GBps: float (None on CPU); shape: {name, config fields, dtype}; weight_bytes: int
    versions: {accelerate, diffusers: version or None}; inductor_emulate_precision_casts: bool
    build_device, build_note, reference ("resident" or "first weightstream method"), budgets, phases
    skipped_methods: {method: reason} (import missing, needs CUDA, does not fit)
    timelines: [{method, phase, budget_bytes, mode, events: [[stream, label, start_ms, end_ms], ...],
        summary: {span_ms, copy_ms, decode_ms, compute_ms, compute_idle_ms, compute_idle_decoding_ms,
        compute_idle_copying_ms, compute_idle_other_ms} (optional; files before 2026-12-05 lack the
        last three)}];
        stream is "copy", "decode" or "compute"; eager and compiled weightstream rows at the first budget
    aborted: why the run stopped early (only when a method could not be undone)
    max_seconds: the run's time budget (None: none); measurements past it are rows with `skipped`
    method_seconds: each method's time limit per budget and phase, preparation included (None: none);
        a method past it has rows with `error` "did not finish within ..." and the run goes on
    lora: {rank, targets, adapter_bytes} of the unfused LoRA adapter the model carried (`--lora`), or
        None / absent: none
    note, command_note: optional text added by hand after the run (e.g. that a shell timeout cut it)
    converted_from: the script whose older format the document was converted from (bench_core.py,
        bench_plan.py, bench_load.py; converted once, written back in this schema)
    results: [ResultRow as a dict, ...]: method, phase, budget_bytes, mode, median_ms, min_ms, max_ms,
        reps, tokens_per_s, link_bound_ms, ratio, exact, error, skipped (required), and context fields;
        weightstream rows also wire_bytes, wire_raw_bytes, wire_ratio (optional: older files lack them;
        set together, wire <= raw, ratio = wire / raw). link_bytes, and so the link bound, count wire
        bytes: a compressed group's blob, not its raw bytes
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

# eager; compiled = torch.compile(fullgraph=True, dynamic=False); graph = a CUDA graph captured from the
# compiled call; graph-eager = a CUDA graph captured from the eager forward (no compile: the planner sweep)
MODES = ("eager", "compiled", "graph", "graph-eager")
DEFAULT_MODES = ("eager", "compiled", "graph")


@dataclass
class ResultRow:
    """One measurement: a method, at one budget, in one phase and mode. Exactly one of `median_ms`,
    `error` and `skipped` is set. Times in ms; sizes in bytes."""

    method: str
    phase: str
    budget_bytes: int | None  # GPU bytes for weights given to the method; None: it takes no budget
    mode: str
    median_ms: float | None = None
    min_ms: float | None = None
    max_ms: float | None = None
    reps: int | None = None
    tokens_per_s: float | None = None  # tokens per forward (batch x new tokens) / median
    link_bound_ms: float | None = None  # bytes over the host->GPU link per forward / bandwidth
    ratio: float | None = None  # median / link bound; 1.0 = as fast as the link allows
    exact: bool | None = None  # torch.equal against the reference; None for the reference itself
    error: str | None = None  # first line of the exception, instead of a number
    skipped: str | None = None  # why this mode does not run here
    tokens: int | None = None
    reference: str | None = None  # what `exact` compares against, e.g. "resident eager"
    max_abs_diff: float | None = None
    link_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    first_call_s: float | None = None  # wall time of the first warm-up call, compile included
    setup: dict = field(default_factory=dict)  # what the method's prepare reported
    # weightstream rows: the streamed groups' bytes on the link (compressed where they are), the same
    # groups' raw bytes, and wire / raw (1.0 when nothing is compressed); None for other methods
    wire_bytes: int | None = None
    wire_raw_bytes: int | None = None
    wire_ratio: float | None = None


_NUM = (int, float)
_DOC_TYPES = {
    "command": (str,), "date": (str,), "gpu": (str,), "torch": (str,), "h2d_bandwidth_GBps": (*_NUM, None),
    "shape": (dict,), "weight_bytes": (int,), "results": (list,),
}
_ROW_TYPES = {
    "method": (str,), "phase": (str,), "budget_bytes": (int, None), "mode": (str,),
    "median_ms": (*_NUM, None), "min_ms": (*_NUM, None), "max_ms": (*_NUM, None), "reps": (int, None),
    "tokens_per_s": (*_NUM, None), "link_bound_ms": (*_NUM, None), "ratio": (*_NUM, None),
    "exact": (bool, None), "error": (str, None), "skipped": (str, None),
}

# optional: rows written before compression on the wire lack them
_OPTIONAL_ROW_TYPES = {"wire_bytes": (int, None), "wire_raw_bytes": (int, None), "wire_ratio": (*_NUM, None)}


def _check_type(where: str, value, allowed: tuple) -> None:
    ok = (value is None and None in allowed) or (
        value is not None and not (isinstance(value, bool) and bool not in allowed)
        and isinstance(value, tuple(t for t in allowed if t is not None))
    )
    if not ok:
        names = ", ".join("None" if t is None else t.__name__ for t in allowed)
        raise ValueError(f"{where}: expected {names}, got {value!r}")


def _validate_row(i: int, row) -> None:
    if not isinstance(row, dict):
        raise ValueError(f"results[{i}]: expected a dict, got {type(row).__name__}")
    for key, allowed in _ROW_TYPES.items():
        if key not in row:
            raise ValueError(f"results[{i}].{key}: missing")
        _check_type(f"results[{i}].{key}", row[key], allowed)
    for key, allowed in _OPTIONAL_ROW_TYPES.items():
        _check_type(f"results[{i}].{key}", row.get(key), allowed)
    _validate_wire(i, row)
    if row["mode"] not in MODES:
        raise ValueError(f"results[{i}].mode: {row['mode']!r} is not one of {', '.join(MODES)}")
    outcomes = [k for k in ("median_ms", "error", "skipped") if row[k] is not None]
    if len(outcomes) != 1:
        raise ValueError(f"results[{i}].median_ms: exactly one of median_ms, error, skipped must be set, "
                         f"got {outcomes or 'none'}")


def _validate_wire(i: int, row: dict) -> None:
    """The wire fields come together: 0 <= wire_bytes <= wire_raw_bytes and the ratio is their quotient."""
    wire, raw, ratio = (row.get(k) for k in _OPTIONAL_ROW_TYPES)
    if wire is None and raw is None and ratio is None:
        return
    if None in (wire, raw, ratio):
        raise ValueError(f"results[{i}].wire_ratio: wire_bytes, wire_raw_bytes and wire_ratio are set "
                         f"together, got {wire!r}, {raw!r}, {ratio!r}")
    if not 0 <= wire <= raw:
        raise ValueError(f"results[{i}].wire_bytes: {wire} must be between 0 and wire_raw_bytes ({raw})")
    if abs(ratio - (wire / raw if raw else 1.0)) > 1e-6:
        raise ValueError(f"results[{i}].wire_ratio: {ratio} is not wire_bytes / wire_raw_bytes")


def validate(doc) -> dict:
    """Check a result document against the schema (module docstring, `ResultRow`); return it.
    Raises ValueError naming the first bad field, e.g. "results[3].exact"."""
    if not isinstance(doc, dict):
        raise ValueError(f"document: expected a dict, got {type(doc).__name__}")
    for key, allowed in _DOC_TYPES.items():
        if key not in doc:
            raise ValueError(f"{key}: missing")
        _check_type(key, doc[key], allowed)
    for i, row in enumerate(doc["results"]):
        _validate_row(i, row)
    return doc


def write_json(doc: dict, path: str) -> None:
    """Overwrite `path` with the document (through a temporary file: a kill never leaves half a file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def load_results(paths: list[str]) -> list[dict]:
    """Read and validate stored result documents. Raises ValueError naming the file and the first bad
    field."""
    docs = []
    for path in paths:
        with open(path) as f:
            try:
                docs.append(validate(json.load(f)))
            except ValueError as err:
                raise ValueError(f"{path}: {err}") from err
    return docs


def validate_files(paths: list[str]) -> int:
    """`weightstream bench --validate FILE...`: read and validate each file;
    print one line per file ("valid PATH: N rows, M measured" or "INVALID PATH: field: why"); return
    the exit status (1 when any file is invalid)."""
    status = 0
    for path in paths:
        try:
            doc = load_results([path])[0]
        except (ValueError, OSError) as err:
            print(f"INVALID {err}")
            status = 1
            continue
        measured = sum(r["median_ms"] is not None for r in doc["results"])
        print(f"valid {path}: {len(doc['results'])} rows, {measured} measured")
    return status
