"""The run: every method x budget x phase x mode on one model, each prepared, timed, compared and undone.

One process builds the model once, measures the pinned host->GPU link, then for each method of the
registry, GPU budget, phase and mode: prepares the model, times one forward after warm-up, checks it
bit for bit against the reference of the same phase and mode, and undoes the method (instance
attributes its hooks left are dropped; every tensor must be back home, or the run stops). The JSON is
rewritten after every measurement, so a run stopped by a time limit keeps what it measured.

Reference: a shape whose weights fit the GPU (weights + HEADROOM_BYTES free) is built there, and the
`resident` method gives the reference of every phase and mode. A shape that does not fit is built on
the CPU in bf16: host memory must hold all its weights, and `restore()` back to the CPU briefly holds
the streamed bytes twice. Then there is no resident run: the first weightstream method to run a phase
and mode gives its reference (labelled e.g. "ws-stream eager") and exactness is weightstream against
weightstream.
"""

from __future__ import annotations

import datetime
import platform
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from .. import __version__
from ..errors import OffloadStateError
from ..offload import handle_of
from ..placement.experts import routers
from ..placement.timing import capture_graph
from ..sizes import format_size, parse_size
from . import methods as registry
from .limits import check_limits, limit_or_none
from .lora import add_lora
from .measure import compare_outputs, fill_row, h2d_bandwidth, measure
from .memory import check_home, home_device, module_bytes, release_memory
from .methods import Method, Undo
from .phases import Phase, parse_phase
from .profile import store_profile
from .progress import first_line, log
from .report import describe, fmt
from .schema import MODES, ResultRow, write_json
from .shapes import (
    Shape,
    build_device,
    build_model,
    check_phase,
    check_shape,
    get_shape,
    resolve_phase,
    shape_weight_bytes,
)
from .timeline import store_timeline


@dataclass
class Suite:
    """What one run works on. `refs` maps (phase, mode) to (label, output on the CPU)."""

    device: torch.device
    model: nn.Module
    home: torch.device
    phases: list[Phase]
    inputs: dict[str, torch.Tensor]
    modes: list[str]
    reps: int
    bandwidth: float | None
    doc: dict
    out_path: str
    timeline: bool
    shape: Shape
    refs: dict[tuple[str, str], tuple[str, torch.Tensor]] = field(default_factory=dict)
    stop_at: float | None = None  # time.monotonic() after which no method is prepared any more
    method_seconds: float | None = None  # each method's limit per budget and phase
    profile_dir: str | None = None  # --profile: where each measured row's profiler trace goes

    def forward_fn(self, phase: Phase | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
        """One forward of the model on an input, as its model kind runs it: a plain function closing
        over the model and its kind (what torch.compile and graph capture are given); for a `generate-N`
        phase, the kind's whole generation of N tokens."""
        model, kind = self.model, self.shape.model
        if phase is not None and phase.kind == "generate":
            return lambda x: kind.generate(model, x, phase.seq)
        return lambda x: kind.forward(model, x)


def mode_skip(suite: Suite, method: Method, mode: str, phase: Phase | None = None) -> str | None:
    """Why `method` does not run in `mode` here, or None (an unsupported `compiled` is tried anyway)."""
    if phase is not None and phase.kind == "generate" and mode != "eager":
        return ("a generation runs eager only (its KV cache grows every step: no one graph to compile or "
                "capture)")
    graph = mode.startswith("graph")
    if graph and suite.device.type != "cuda":
        return "CUDA graphs need a CUDA device"
    if graph and mode not in method.modes:
        return f"{method.name} does not support CUDA graphs: {method.about}"
    return None


def method_skip(suite: Suite, method: Method) -> str | None:
    """Why `method` cannot run at all here, or None."""
    if method.cuda_only and suite.device.type != "cuda":
        return f"{method.name} needs a CUDA device"
    if method.name == "resident" and suite.home != suite.device:
        return f"the model does not fit {suite.device} ({suite.doc['build_note']})"
    return None


def compare(suite: Suite, method: Method, row: ResultRow, out: torch.Tensor) -> None:
    """Set row.exact against the reference of the same phase and mode; the first output of a method
    that may give references becomes the reference when there is none yet."""
    key = (row.phase, row.mode)
    if key not in suite.refs:
        if method.gives_reference:
            suite.refs[key] = (f"{method.name} {row.mode}", out.detach().cpu().clone())
            row.reference = "self"
        else:
            row.reference = "none (no resident or weightstream output for this phase and mode)"
        return
    label, ref = suite.refs[key]
    row.reference = label
    row.exact, row.max_abs_diff = compare_outputs(out, ref)


ROTATING_TOKENS = 64  # a mixture of experts' timed calls cycle through inputs of this many tokens in all


def rotating_inputs(suite: Suite, phase: Phase) -> torch.Tensor | None:
    """For a mixture of experts (a model with routers), inputs of the phase's shape stacked, at least
    two and ROTATING_TOKENS tokens in all, the first the phase's own, the rest fixed random token ids:
    its timed calls cycle through them, so a GPU expert cache is measured on routing that changes from
    call to call as it does in generation (the same token again and again would be served from the
    cache every time), and the routers' choices counted over them are enough to fit a skew at decode.
    None for any other model or phase, whose calls all take the phase's one input."""
    if phase.kind == "generate" or not routers(suite.model):
        return None
    x = suite.inputs[phase.name]
    count = max(2, -(-ROTATING_TOKENS // x.numel()))
    gen = torch.Generator().manual_seed(ROTATING_TOKENS + x.numel())
    others = torch.randint(suite.model.config.vocab_size, (count - 1, *x.shape), generator=gen,
                           dtype=x.dtype)
    return torch.cat([x[None], others.to(x.device)])


def make_call(suite: Suite, mode: str, x: torch.Tensor, compiled: Callable,
              phase: Phase | None = None, bank: torch.Tensor | None = None) -> Callable[[], torch.Tensor]:
    """The zero-argument forward to time in `mode` (eager: of `phase`, a generation where it is one).
    With `bank` (`rotating_inputs`), each call first copies the next of its inputs into the one input
    buffer the forward reads (a graph's static input), and `call.first()` runs the bank's first input,
    the phase's own (the output compared with the reference)."""
    if bank is not None:
        x = x.clone()
    if mode == "eager":
        forward = suite.forward_fn(phase)
        call = lambda: forward(x)  # noqa: E731
    elif mode == "compiled":
        call = lambda: compiled(x)  # noqa: E731
    else:
        call = capture_graph(suite.forward_fn() if mode == "graph-eager" else compiled, x)
        x = call.static_in
    if bank is None:
        return call
    at = [0]

    def cycling() -> torch.Tensor:
        at[0] = (at[0] + 1) % len(bank)
        x.copy_(bank[at[0]])
        return call()

    def first() -> torch.Tensor:
        at[0] = 0
        x.copy_(bank[0])
        return call()

    cycling.first = first
    return cycling


def _counters(model: nn.Module) -> tuple[int, int, int] | None:
    """The offload handle's (misses, prologues, copies) so far, or None when the model has none."""
    try:
        stats = handle_of(model).stats
    except OffloadStateError:
        return None
    return stats.misses, stats.prologues, stats.copies


def expert_fields(suite: Suite, phase: Phase, bank: torch.Tensor | None) -> dict:
    """For an offloaded mixture of experts: `expert_bytes_per_token` (expert bytes read over the link per
    token), `expert_hit_rate` (the share of the experts reached found in a GPU expert cache, where
    there is one) and `routing_skew_fit` (the Zipf exponent that fits the routers' choices,
    `OffloadHandle.routing_skew`), counted over eager forwards of the inputs the timed calls cycled
    through (`bank`), after them (the counters add kernels, so the timed calls run without them; the
    caches are warm by then); {} for any other model, a model not offloaded, or a generation phase."""
    if phase.kind == "generate" or bank is None:
        return {}
    try:
        handle = handle_of(suite.model)
    except OffloadStateError:
        return {}
    handle.count_experts()
    try:
        forward = suite.forward_fn()
        with torch.no_grad():
            for x in bank:
                forward(x)
        stats = handle.stats
        fitted = handle.routing_skew()
    finally:
        handle.count_experts(False)
    fields = {"expert_bytes_per_token": stats.expert_bytes_per_token,
              "expert_hit_rate": stats.expert_hit_rate, "routing_skew_fit": fitted}
    return {k: v for k, v in fields.items() if v is not None}


def run_mode(suite: Suite, method: Method, phase: Phase, row: ResultRow, compiled: Callable) -> None:
    """Time one mode into `row`, check it against the reference, add the link bound; for an offloaded
    model also the engine's misses, pass prologues and copies per timed call (`engine_per_call`)."""
    bank = rotating_inputs(suite, phase)
    call = make_call(suite, row.mode, suite.inputs[phase.name], compiled, phase, bank)
    warm: list = []
    entry, out = measure(call, suite.reps, suite.device, on_warm=lambda: warm.append(_counters(suite.model)))
    after = _counters(suite.model)
    if bank is not None:  # the reference's output is of the phase's own input
        out = call.first()
    fill_row(row, entry, suite.bandwidth)
    compare(suite, method, row, out)
    if warm and warm[0] is not None and after is not None:
        names = ("misses", "prologues", "copies")
        row.setup = {**row.setup, "engine_per_call": {
            k: (b - a) / entry["reps"] for k, a, b in zip(names, warm[0], after, strict=True)}}
    experts = expert_fields(suite, phase, bank)
    if experts:
        row.setup = {**row.setup, **experts}
    if suite.timeline and row.mode in ("eager", "compiled") and phase.kind != "generate" and (
            method.name.startswith("ws-") or method.name == "resident"):
        store_timeline(suite.doc, row, suite.model, call)
    if suite.profile_dir:
        store_profile(suite.profile_dir, suite.doc, row, call, suite.device)


def add_row(suite: Suite, row: ResultRow) -> None:
    """Append a finished row, print it, and rewrite the JSON."""
    suite.doc["results"].append(asdict(row))
    log(describe(row))
    write_json(suite.doc, suite.out_path)


def _over_time(suite: Suite) -> str:
    return f"did not finish within the method's --method-seconds ({suite.method_seconds:g} s)"


def method_limit(suite: Suite, until: float | None):
    """The running method's time limit (`until` from time.monotonic()), or none when `until` is None."""
    return limit_or_none(until, _over_time(suite) if until is not None else "")


def phase_setup(suite: Suite, phase: Phase, setup: dict) -> dict:
    """The setup as the rows of `phase` record it: a generation's rows have no one forward's link bytes
    (their bound is not one forward's bytes); a model kind with its own `link_bytes` (an
    encoder-decoder's decoder step) gives an offloaded model's bytes per forward."""
    if phase.kind == "generate":
        return {**setup, "link_bytes": None}
    own = getattr(suite.shape.model, "link_bytes", None)
    if own is not None and "link_bytes" in setup:
        try:
            handle = handle_of(suite.model)
        except OffloadStateError:
            return setup
        return {**setup, "link_bytes": own(handle), "all_groups_link_bytes": setup["link_bytes"]}
    return setup


def wire_fields(setup: dict) -> dict:
    """The row's wire_bytes, wire_raw_bytes and wire_ratio from a weightstream setup (none otherwise)."""
    return {k: setup[k] for k in ("wire_bytes", "wire_raw_bytes", "wire_ratio") if k in setup}


def run_modes(suite: Suite, method: Method, phase: Phase, budget: int | None, setup: dict,
              until: float | None) -> None:
    """Every selected mode of one prepared method and phase; a failure is recorded, not raised. A mode
    not started by `until` (time.monotonic(); None: no limit) is skipped."""
    compiled = torch.compile(suite.forward_fn(), fullgraph=True, dynamic=False)
    setup = phase_setup(suite, phase, setup)
    for mode in suite.modes:
        row = ResultRow(method.name, phase.name, budget, mode, tokens=phase.tokens,
                        link_bytes=setup.get("link_bytes"), setup=setup, **wire_fields(setup))
        row.skipped = mode_skip(suite, method, mode, phase)
        if row.skipped is None and until is not None and time.monotonic() > until:
            row.skipped = f"not run: {_over_time(suite)}"
        if row.skipped is None:
            try:
                with method_limit(suite, until):
                    run_mode(suite, method, phase, row, compiled)
            except Exception as exc:  # record and go on: the rest of the run still counts
                row = ResultRow(method.name, phase.name, budget, mode, tokens=phase.tokens,
                                error=first_line(exc), link_bytes=row.link_bytes, setup=setup,
                                **wire_fields(setup))
        add_row(suite, row)
    del compiled
    release_memory(suite.device)  # drop compiled code and graphs before the weights move back


def run_prepared(suite: Suite, method: Method, phase: Phase, budget: int | None) -> bool:
    """Prepare `method` for one budget and phase, run its modes, undo it. False when the model could
    not be put back (the run must stop: every later number would be suspect)."""
    snapshot = {id(m): set(m.__dict__) for m in suite.model.modules()}
    until = None if suite.method_seconds is None else time.monotonic() + suite.method_seconds
    try:
        with method_limit(suite, until):
            setup, undo = method.prepare(suite.model, budget, phase.planned, suite.device)
    except Exception as exc:
        for mode in suite.modes:
            add_row(suite, ResultRow(method.name, phase.name, budget, mode, tokens=phase.tokens,
                                     error=f"prepare: {first_line(exc)}"))
        return _undo(suite, method, lambda: suite.model.to(suite.home), snapshot)  # best effort
    run_modes(suite, method, phase, budget, setup, until)
    return _undo(suite, method, undo, snapshot)


def _undo(suite: Suite, method: Method, undo: Undo, snapshot: dict[int, set]) -> bool:
    """Undo a method, drop instance attributes its hooks left on the modules (a stale instance `forward`
    would shadow weightstream's block class), and check every tensor is home."""
    try:
        undo()
        for m in suite.model.modules():
            for key in set(m.__dict__) - snapshot.get(id(m), set(m.__dict__)):
                del m.__dict__[key]
        release_memory(suite.device)
        check_home(suite.model, suite.home)
        return True
    except Exception as exc:
        suite.doc["aborted"] = f"{method.name}: undo failed: {first_line(exc)}"
        log(suite.doc["aborted"])
        write_json(suite.doc, suite.out_path)
        return False


def run_method(suite: Suite, method: Method, budgets: list[int]) -> bool:
    """Every budget (once when the method takes none) and phase of one method; False to stop the run."""
    reason = method_skip(suite, method)
    if reason:
        suite.doc["skipped_methods"][method.name] = reason
        log(f"{method.name}: skipped ({reason})")
        return True
    log(f"== {method.name}: {method.about}")
    for budget in budgets if method.uses_budget else [None]:
        for phase in suite.phases:
            if suite.stop_at is not None and time.monotonic() > suite.stop_at:
                reason = f"not run: the run's --max-seconds were spent ({suite.doc['max_seconds']} s)"
                for mode in suite.modes:
                    add_row(suite, ResultRow(method.name, phase.name, budget, mode, tokens=phase.tokens,
                                             skipped=reason))
                continue
            if not run_prepared(suite, method, phase, budget):
                return False
    return True


def resolve_budget(budget: int | float | str, weight_bytes: int) -> int:
    """Bytes from a budget: a float or a bare number in (0, 1] is a fraction of the weight bytes;
    anything else is a size ("8GiB", "500MB", an int of bytes)."""
    if isinstance(budget, str):
        try:
            value = float(budget)
        except ValueError:
            return parse_size(budget)
        budget = value if value <= 1 else int(value)
    if isinstance(budget, float):
        if not 0 < budget <= 1:
            raise ValueError(f"budget {budget}: a fraction must be in (0, 1]; else give a size like '8GiB'")
        return int(budget * weight_bytes)
    return parse_size(budget)


def header(shape: str, device: torch.device, model: nn.Module, bandwidth: float | None, command: str,
           kind: str = "suite") -> dict:
    """The result document of a run on a model of `shape` before any measurement (`kind`: the run's
    `--kind`)."""
    return base_header(device, bandwidth, command, kind, get_shape(shape).record(), module_bytes(model),
                       str(home_device(model)))


def base_header(device: torch.device, bandwidth: float | None, command: str, kind: str, shape: dict,
                weight_bytes: int, build_device: str) -> dict:
    """The result document before any measurement: what ran where, with which versions; `shape` is
    the document's `shape` entry (name and fields), `weight_bytes` the bytes measured on."""
    import torch._inductor.config
    import transformers

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"none (cpu {platform.machine()})"
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "kind": kind, "command": command, "date": now.isoformat(timespec="seconds"),
        "gpu": gpu, "torch": torch.__version__, "transformers": transformers.__version__,
        "weightstream": __version__, "python": platform.python_version(),
        "versions": {m.requires: registry.version_of(m.requires) for m in registry.METHODS if m.requires},
        "inductor_emulate_precision_casts": bool(torch._inductor.config.emulate_precision_casts),
        "h2d_bandwidth_GBps": bandwidth,
        # how each call was timed (timing.time_calls): in a loop, no synchronization between calls
        "timing": "back-to-back",
        "shape": shape, "weight_bytes": weight_bytes, "build_device": build_device,
        "skipped_methods": {}, "timelines": [], "results": [],
    }


def run_suite(
    shape: str,
    budgets: list[int | float | str],
    phases: list[str],
    methods: list[str],
    modes: list[str],
    reps: int,
    device: str | torch.device,
    out_path: str,
    *,
    seed: int = 0,
    timeline: bool = True,
    emulate_precision_casts: bool = False,
    command: str | None = None,
    max_seconds: float | None = None,
    method_seconds: float | None = None,
    profile_dir: str | None = None,
    lora: int | None = None,
) -> dict:
    """Run every method x budget x phase x mode on one model of `shape` and write the result document
    to `out_path` after each measurement; return the document.

    budgets: fractions of the weight bytes (0.25) or sizes ("8GiB", bytes). phases: `decode-bN`,
    `prefill-N`. methods: names from the registry (run in registry order; unknown names raise, known
    ones that cannot run here are listed in `skipped_methods`). modes: eager, compiled, graph,
    graph-eager. reps: timed calls per measurement. device: "cuda" or "cpu". timeline: keep a profiler
    timeline of each weightstream method's eager and compiled forward at the first budget, and of the
    resident model's (CUDA only).
    emulate_precision_casts: set Inductor's flag of that name for every compile, so compiled code
    rounds to bf16 where eager does (benchmarks/README.md: without it, fusion across block boundaries
    can differ by one ulp). max_seconds: prepare no method after this many seconds from the start; the
    measurements not made are recorded as skipped (a run ends cleanly inside a command's time limit;
    one method and phase already started runs to its end). method_seconds: stop a method that has not
    finished one budget and phase (preparation and every mode) within this many seconds; its
    unfinished modes are recorded as errors or skipped, it is undone, and the run goes on with the
    next (needs the main thread of a POSIX process: a SIGALRM timer). profile_dir: after each
    measurement, the host's time to enqueue a call and one profiled call (`profile.py`: its trace
    written there, its figures in the row's `setup["profile"]`). lora: the rank of an unfused LoRA
    adapter added to the model before any method runs (`lora.py`; None: none), recorded as `lora`.
    """
    import torch._inductor.config

    previous = torch._inductor.config.emulate_precision_casts
    torch._inductor.config.emulate_precision_casts = emulate_precision_casts
    try:
        return _run(shape, budgets, phases, methods, modes, reps, _resolve(device), out_path, seed, timeline,
                    command, max_seconds, method_seconds, profile_dir, lora)
    finally:
        torch._inductor.config.emulate_precision_casts = previous


def _run(shape, budgets, phases, methods, modes, reps, device, out_path, seed, timeline, command,
         max_seconds, method_seconds, profile_dir, lora) -> dict:
    """The body of `run_suite`, with the Inductor flag set."""
    _check_names(methods, [m.name for m in registry.METHODS], "method")
    _check_names(modes, list(MODES), "mode")
    check_limits(max_seconds, method_seconds)
    stop_at = None if max_seconds is None else time.monotonic() + max_seconds
    suite = _start(shape, budgets, [parse_phase(p) for p in phases], modes, reps, device, out_path, seed,
                   timeline, command, lora)
    suite.stop_at, suite.method_seconds, suite.profile_dir = stop_at, method_seconds, profile_dir
    suite.doc["max_seconds"], suite.doc["method_seconds"] = max_seconds, method_seconds
    suite.doc["skipped_methods"] = {k: v for k, v in registry.unavailable().items() if k in methods}
    write_json(suite.doc, out_path)
    for method in registry.METHODS:
        if method.name in methods and method.name in suite.doc["skipped_methods"]:
            log(f"{method.name}: skipped ({suite.doc['skipped_methods'][method.name]})")
        elif method.name in methods and not run_method(suite, method, suite.doc["budgets"]):
            break
    write_json(suite.doc, out_path)
    return suite.doc


def _start(shape, budgets, phases, modes, reps, device, out_path, seed, timeline, command,
           lora: int | None = None) -> Suite:
    """Measure the link, build the model where it fits (with its LoRA adapter), make the inputs and the
    document header."""
    check_shape(get_shape(shape), device)
    phases = [resolve_phase(get_shape(shape), p) for p in phases]  # a diffusion step's tokens
    for phase in phases:
        check_phase(get_shape(shape), phase)
    weights = shape_weight_bytes(shape)
    budget_bytes = [resolve_budget(b, weights) for b in budgets]
    bandwidth = h2d_bandwidth(device) if device.type == "cuda" else None
    log(f"host->GPU pinned bandwidth: {fmt(bandwidth, 1)} GB/s")
    where, note = build_device(weights, device)
    model = build_model(shape, where, seed)
    log(f"{shape}: {format_size(weights)} of bf16 weights on {where} ({note})")
    adapter = None if lora is None else add_lora(model, lora, seed)
    if adapter:
        log(f"unfused LoRA of rank {lora} on {', '.join(adapter['targets'])}: "
            f"{format_size(adapter['adapter_bytes'])}")
    doc = header(shape, device, model, bandwidth, command or shlex.join(sys.argv))
    doc["lora"] = adapter
    doc.update(budgets=budget_bytes, phases=[p.name for p in phases], build_note=note,
               reference="resident" if where == device else "first weightstream method")
    s = get_shape(shape)
    inputs = s.model.inputs(model, phases, device, seed)
    return Suite(device, model, where, phases, inputs, list(modes), reps, bandwidth, doc, out_path, timeline,
                 s)


def _resolve(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _check_names(given: list[str], known: list[str], what: str) -> None:
    bad = [x for x in given if x not in known]
    if bad or not given:
        raise ValueError(f"{what}s {bad or given!r}: choose from {', '.join(known)}")
