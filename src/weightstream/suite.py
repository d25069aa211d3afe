"""`weightstream bench`: every offload method on the same random bf16 weights, in one process.

One command builds a model of a built-in shape once, measures the pinned host->GPU link, then for each
method of the registry, GPU budget, phase and execution mode: prepares the model, times one forward
with CUDA events after warm-up, checks it bit for bit (`torch.equal`) against the reference of the same
phase and mode, and undoes the method. The JSON is rewritten after every measurement, so a run stopped
by a time limit keeps what it measured. `--report` turns stored JSON into a markdown table and plots
without running anything.

    weightstream bench --shape llama-3-8b --budgets 0.25,0.5,0.75 --out benchmarks/results/suite_8b.json
    weightstream bench --report benchmarks/results/suite_*.json --md docs/benchmarks.md --png-dir docs/

Phases: one forward `model(ids, use_cache=False).logits` on fixed random ids, without a KV cache, so a
decode step costs its weight traffic but not attention over a context. `decode-bN`: 1 new token for N
sequences; `prefill-N`: N tokens of one sequence. Modes: `eager`; `compiled` =
`torch.compile(fullgraph=True, dynamic=False)`; `graph` = a CUDA graph captured from the compiled call,
replayed. A method that does not support `compiled` is still tried there (the failure under fullgraph
is the finding, recorded as `error`); an unsupported `graph` is skipped.

Reference: a shape whose weights fit the GPU (weights + HEADROOM_BYTES free) is built there, and the
`resident` method gives the reference of every phase and mode. A shape that does not fit is built on
the CPU in bf16: host memory must hold all its weights, and `restore()` back to the CPU briefly holds
the streamed bytes twice. Then there is no resident run: the first weightstream method to run a phase
and mode gives its reference (labelled e.g. "ws-stream eager") and exactness is weightstream against
weightstream.

Result document (`validate` checks it; sizes in bytes, times in ms, bandwidth in GB/s of 1e9 bytes):
    command, date, gpu, torch, transformers, weightstream, python: strings
    h2d_bandwidth_GBps: float (None on CPU); shape: {name, config fields, dtype}; weight_bytes: int
    versions: {accelerate, diffusers: version or None}; inductor_emulate_precision_casts: bool
    build_device, build_note, reference ("resident" or "first weightstream method"), budgets, phases
    skipped_methods: {method: reason} (import missing, needs CUDA, does not fit)
    timelines: [{method, phase, budget_bytes, mode, events: [[stream, label, start_ms, end_ms], ...]}]
    aborted: why the run stopped early (only when a method could not be undone)
    max_seconds: the run's time budget (None: none); measurements past it are rows with `skipped`
    method_seconds: each method's time limit per budget and phase, preparation included (None: none);
        a method past it has rows with `error` "did not finish within ..." and the run goes on
    note, command_note: optional text added by hand after the run (e.g. that a shell timeout cut it)
    results: [ResultRow as a dict, ...]: method, phase, budget_bytes, mode, median_ms, min_ms, max_ms,
        reps, tokens_per_s, link_bound_ms, ratio, exact, error, skipped (required), and context fields
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import importlib
import json
import os
import platform
import re
import shlex
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from . import __version__
from .blocks import find_blocks
from .offload import OffloadHandle, handle_of, offload
from .probe import copy_seconds_per_byte
from .shapes import SHAPES
from .sizes import format_size, parse_size
from .timing import capture_graph, sync, time_calls

MODES = ("eager", "compiled", "graph")
DEFAULT_PHASES = ("decode-b1", "decode-b64", "prefill-2048")
# A test-sized Llama, local to the suite (not a planning shape): CPU smoke runs of the whole harness.
TINY = dict(
    model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=256,
)
TINY_MOE = dict(  # the same, as a Mixtral: expert weights fused per block, routing by the input
    model_type="mixtral", hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=256, num_local_experts=4, num_experts_per_tok=2,
)
SUITE_SHAPES = {**SHAPES, "tiny": TINY, "tiny-moe": TINY_MOE}
HEADROOM_BYTES = 6 * 2**30  # GPU memory kept free for activations when deciding whether a shape fits
SLOW_CALL_S = 1.0  # a warm call slower than this (seconds) is timed SLOW_REPS times at most
SLOW_REPS = 3
WARMUP_CALLS = 2
_T0 = time.monotonic()


# --- the result schema ----------------------------------------------------------------------------
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
    if row["mode"] not in MODES:
        raise ValueError(f"results[{i}].mode: {row['mode']!r} is not one of {', '.join(MODES)}")
    outcomes = [k for k in ("median_ms", "error", "skipped") if row[k] is not None]
    if len(outcomes) != 1:
        raise ValueError(f"results[{i}].median_ms: exactly one of median_ms, error, skipped must be set, "
                         f"got {outcomes or 'none'}")


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


# --- phases ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Phase:
    """One forward's input: `batch` sequences of `seq` tokens each."""

    name: str
    batch: int
    seq: int

    @property
    def tokens(self) -> int:
        """Tokens per forward: what the planner plans for and what tokens/s counts."""
        return self.batch * self.seq


def parse_phase(name: str) -> Phase:
    """`decode-bN` (1 token, batch N) or `prefill-N` (N tokens, batch 1)."""
    decode, prefill = re.fullmatch(r"decode-b(\d+)", name), re.fullmatch(r"prefill-(\d+)", name)
    if decode and int(decode.group(1)) > 0:
        return Phase(name, int(decode.group(1)), 1)
    if prefill and int(prefill.group(1)) > 0:
        return Phase(name, 1, int(prefill.group(1)))
    raise ValueError(f"phase {name!r}: write decode-bN (1 token, batch N) or prefill-N (N tokens, batch 1)")


# --- small helpers --------------------------------------------------------------------------------
def first_line(exc: BaseException) -> str:
    """The exception's type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct tensors given (meta tensors count their size)."""
    unique = {id(t): t for t in tensors}
    return sum(t.numel() * t.element_size() for t in unique.values())


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's distinct parameters and buffers."""
    return tensor_bytes([*module.parameters(), *module.buffers()])


def allocated(device: torch.device) -> int | None:
    """Bytes PyTorch has allocated on the GPU (None on CPU)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def release_memory(device: torch.device) -> None:
    """Drop compiled code, garbage and cached GPU blocks between measurements."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def home_device(model: nn.Module) -> torch.device:
    """Where the model's first parameter lives."""
    return next(model.parameters()).device


def check_home(model: nn.Module, home: torch.device) -> None:
    """Raise if a parameter or buffer is not back on `home` after a method was undone."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.device != home:
            raise RuntimeError(f"after undo, {name} is on {t.device}, not {home}: the method did not undo")


def log(msg: str) -> None:
    """A progress line with seconds since import (flushed: a killed run keeps what it printed)."""
    print(f"[{time.monotonic() - _T0:7.1f}s] {msg}", flush=True)


# --- methods --------------------------------------------------------------------------------------
Undo = Callable[[], None]
Prepare = Callable[..., tuple[dict, Undo]]  # (model, budget_bytes | None, phase_tokens, device)


@dataclass(frozen=True)
class Method:
    """An offload method: `prepare(model, budget_bytes, phase_tokens, device) -> (setup_info, undo)`
    changes the model in place so it runs on `device`; `undo()` puts it back where it was.
    setup_info holds at least `link_bytes`, the bytes that cross host->GPU per forward."""

    name: str
    prepare: Prepare
    modes: tuple[str, ...]  # modes it supports
    about: str
    requires: str | None = None  # a module that must import for the method to be registered
    uses_budget: bool = True  # False: measured once per phase, budget_bytes None
    cuda_only: bool = False
    gives_reference: bool = False  # may provide reference outputs (resident, weightstream)


def prepare_resident(model: nn.Module, budget: int | None, tokens: int, device: torch.device):
    """Nothing to do: every weight is on the device already."""
    return {"allocated_bytes": allocated(device), "link_bytes": 0}, lambda: None


def _ws_prepare(strategy: str) -> Prepare:
    def prepare(model: nn.Module, budget: int | None, tokens: int, device: torch.device):
        home, before = home_device(model), allocated(device)
        handle = offload(model, gpu_memory=budget, device=device, strategy=strategy, tokens=tokens)
        stats = handle.stats
        info = {"stats": asdict(stats), "placement": _placement(handle),
                "allocated_before_bytes": before, "allocated_after_bytes": allocated(device),
                "link_bytes": stats.streamed_bytes + stats.uva_bytes}

        def undo() -> None:
            handle.restore(home)

        return info, undo

    prepare.__doc__ = f"weightstream offload(strategy={strategy!r}), planned for the phase's tokens."
    return prepare


def _placement(handle: OffloadHandle) -> str:
    p = handle.placement
    part = f" (each block's {p.part} largest tensors)" if p.part else ""
    return f"{p.kind}: {len(p.streamed)} streamed{part} / {p.n_slots} slots, {len(p.uva)} zero copy"


def prepare_accelerate_cpu_offload(model: nn.Module, budget: int | None, tokens: int, device: torch.device):
    """accelerate.cpu_offload: every weight in (pageable) host memory, copied per module each forward."""
    from accelerate import cpu_offload
    from accelerate.hooks import remove_hook_from_module

    home, before, link = home_device(model), allocated(device), tensor_bytes(model.parameters())
    cpu_offload(model, execution_device=device)
    release_memory(device)
    info = {"allocated_before_bytes": before, "allocated_after_bytes": allocated(device), "link_bytes": link}

    def undo() -> None:
        remove_hook_from_module(model, recurse=True)  # puts each weight back where it was
        model.to(home)

    return info, undo


def _cpu_bytes(model: nn.Module, device_map: dict) -> int:
    """Bytes of the modules an accelerate device map sends to the CPU."""
    mods = [model.get_submodule(name) for name, dev in device_map.items() if dev == "cpu"]
    return tensor_bytes([t for m in mods for t in (*m.parameters(), *m.buffers())])


def prepare_accelerate_device_map(model: nn.Module, budget: int | None, tokens: int, device: torch.device):
    """accelerate infer_auto_device_map(max_memory={gpu: budget, "cpu": ...}) + dispatch_model: what fits
    stays on the GPU, the rest is copied from host memory each forward."""
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.hooks import remove_hook_from_module

    home, total = home_device(model), module_bytes(model)
    model.to("cpu")  # dispatch_model keeps "cpu" weights where they are: they must really be on the host
    release_memory(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    device_map = infer_auto_device_map(model, max_memory={index: budget, "cpu": 2 * total},
                                       no_split_module_classes=no_split)
    if "cpu" not in device_map.values() or set(device_map.values()) == {"cpu"}:
        raise RuntimeError(f"device map {sorted(set(map(str, device_map.values())))}: accelerate offloads "
                           "nothing, or everything to the CPU, at this budget")
    link = _cpu_bytes(model, device_map)
    dispatch_model(model, device_map=device_map, main_device=index)
    info = {"device_map_gpu_modules": sum(d != "cpu" for d in device_map.values()),
            "device_map_cpu_modules": sum(d == "cpu" for d in device_map.values()),
            "allocated_after_bytes": allocated(device), "link_bytes": link}

    def undo() -> None:
        remove_hook_from_module(model, recurse=True)
        model.to(home)

    return info, undo


_DIFFUSERS_HOOKS = ("group_offloading", "layer_execution_tracker", "lazy_prefetch_group_offloading")


def prepare_diffusers_group(model: nn.Module, budget: int | None, tokens: int, device: torch.device):
    """diffusers apply_group_offloading(block_level, 1 block per group, use_stream=True) on the module
    that holds the block list (a causal LM's inner `model`): its weights in pinned host memory, one
    block prefetched ahead on a side stream; the rest (the LM head) stays on the device. Applied to the
    whole LM instead, diffusers 0.42 registers its execution tracker twice when it recurses with a
    stream ("Hook with name layer_execution_tracker already exists")."""
    from diffusers.hooks import HookRegistry, apply_group_offloading

    home, before = home_device(model), allocated(device)
    block_list = find_blocks(model)[0].name.rsplit(".", 1)[0]  # "model.layers.0" -> "model.layers"
    holder_name = block_list.rsplit(".", 1)[0] if "." in block_list else ""
    holder = model.get_submodule(holder_name)
    inside = {id(t) for t in [*holder.parameters(), *holder.buffers()]}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in inside:
            t.data = t.data.to(device)  # outside the offloaded module: on the device, as a user would
    link = module_bytes(holder)
    apply_group_offloading(holder, onload_device=device, offload_type="block_level", num_blocks_per_group=1,
                           use_stream=True)
    release_memory(device)
    info = {"offloaded_module": holder_name or "(the model)", "allocated_before_bytes": before,
            "allocated_after_bytes": allocated(device), "link_bytes": link}

    def undo() -> None:
        registry = HookRegistry.check_if_exists_or_initialize(holder)
        for name in _DIFFUSERS_HOOKS:
            registry.remove_hook(name, recurse=True)
        model.to(home)

    return info, undo


_EAGER_ONLY = "its hooks are torch.compiler.disable'd: fullgraph compile and CUDA graphs fail"
METHODS = (
    Method("resident", prepare_resident, MODES, "every weight on the GPU (the reference)",
           uses_budget=False, gives_reference=True),
    Method("ws-stream", _ws_prepare("stream"), MODES, "weightstream, blocks streamed through staging slots",
           gives_reference=True),
    Method("ws-uva", _ws_prepare("uva"), MODES, "weightstream, blocks read in place from pinned memory",
           gives_reference=True),
    Method("ws-auto", _ws_prepare("auto"), MODES, "weightstream, the planner's choice", gives_reference=True),
    Method("accelerate-cpu_offload", prepare_accelerate_cpu_offload, ("eager",),
           f"accelerate.cpu_offload; {_EAGER_ONLY}", requires="accelerate", uses_budget=False),
    Method("accelerate-device_map", prepare_accelerate_device_map, ("eager",),
           f"accelerate device_map + max_memory; {_EAGER_ONLY}", requires="accelerate", cuda_only=True),
    Method("diffusers-group", prepare_diffusers_group, ("eager",),
           f"diffusers block-level group offloading with a stream; {_EAGER_ONLY}", requires="diffusers",
           uses_budget=False, cuda_only=True),
)


@functools.cache
def _import_error(module: str) -> str | None:
    """None when `import module` works, else why not."""
    try:
        importlib.import_module(module)
        return None
    except Exception as exc:  # a broken install is as unusable as a missing one
        return f"import {module} failed ({first_line(exc)}): pip install {module}"


def registry() -> dict[str, Method]:
    """The methods that can run here, in run order: those whose required module imports."""
    return {m.name: m for m in METHODS if m.requires is None or _import_error(m.requires) is None}


def unavailable() -> dict[str, str]:
    """Known methods that are not registered here, with the reason (a missing import)."""
    return {m.name: _import_error(m.requires) for m in METHODS if m.name not in registry()}


# --- model, inputs, link --------------------------------------------------------------------------
def shape_config(shape: str):
    """The transformers config of a suite shape (built-in planning shapes plus `tiny`)."""
    from transformers import AutoConfig

    if shape not in SUITE_SHAPES:
        raise ValueError(f"shape {shape!r}: choose one of {', '.join(SUITE_SHAPES)}")
    fields_ = dict(SUITE_SHAPES[shape])
    return AutoConfig.for_model(fields_.pop("model_type"), attn_implementation="sdpa", **fields_)


def build_model(shape: str, device: torch.device, seed: int = 0) -> nn.Module:
    """A causal LM of `shape` with random bf16 weights created on `device`, in eval mode, no grads."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(shape_config(shape), dtype=torch.bfloat16)
    model = model.to(device)  # a no-op unless the library built it elsewhere
    return model.eval().requires_grad_(False)


def shape_weight_bytes(shape: str) -> int:
    """Bytes of the shape's bf16 parameters and buffers, from a meta-device build (no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape_config(shape), dtype=torch.bfloat16)
    return module_bytes(model)


def build_device(weight_bytes: int, device: torch.device) -> tuple[torch.device, str]:
    """Where to build the model: `device` when its weights fit there with HEADROOM_BYTES to spare, else
    the CPU; and a sentence saying why."""
    if device.type != "cuda":
        return device, "built on the CPU device"
    free, _ = torch.cuda.mem_get_info(device)
    if weight_bytes + HEADROOM_BYTES <= free:
        return device, f"fits: {format_size(weight_bytes)} of weights, {format_size(free)} free"
    return torch.device("cpu"), (f"does not fit {device}: {format_size(weight_bytes)} of weights + "
                                 f"{format_size(HEADROOM_BYTES)} headroom > {format_size(free)} free")


def make_inputs(vocab: int, phases: list[Phase], device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """Fixed random input ids per phase, shape (batch, seq), on `device`."""
    gen = torch.Generator().manual_seed(seed + 1)
    return {p.name: torch.randint(vocab, (p.batch, p.seq), generator=gen).to(device) for p in phases}


def h2d_bandwidth(device: torch.device, nbytes: int = 2**30) -> float:
    """Host->GPU copy speed from pinned memory in GB/s (1e9 bytes): the probe's median of 10 copies of
    `nbytes` after 3 warm-ups, timed with CUDA events."""
    return 1e-9 / copy_seconds_per_byte(device, nbytes)


def forward(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """One forward without KV cache; the logits (batch, seq, vocab)."""
    return model(ids, use_cache=False).logits


# --- timing ---------------------------------------------------------------------------------------
def measure(fn: Callable[[], torch.Tensor], reps: int, device: torch.device) -> tuple[dict, torch.Tensor]:
    """WARMUP_CALLS untimed calls (the first may compile), then `reps` timed ones (SLOW_REPS at most
    when a warm call takes over SLOW_CALL_S). Returns the timing fields and the last output."""
    walls = []
    for _ in range(WARMUP_CALLS):
        t0 = time.perf_counter()
        fn()
        sync(device)
        walls.append(time.perf_counter() - t0)
    reps = min(reps, SLOW_REPS) if walls[-1] > SLOW_CALL_S else reps
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, out = time_calls(fn, reps, device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    entry = {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "reps": reps,
             "first_call_s": walls[0], "peak_allocated_bytes": peak}
    return entry, out


# --- the run --------------------------------------------------------------------------------------
@dataclass
class Suite:
    """What one run works on. `refs` maps (phase, mode) to (label, logits on the CPU)."""

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
    refs: dict[tuple[str, str], tuple[str, torch.Tensor]] = field(default_factory=dict)
    stop_at: float | None = None  # time.monotonic() after which no method is prepared any more
    method_seconds: float | None = None  # each method's limit per budget and phase


def write_json(doc: dict, path: str) -> None:
    """Overwrite `path` with the document (through a temporary file: a kill never leaves half a file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def mode_skip(suite: Suite, method: Method, mode: str) -> str | None:
    """Why `method` does not run in `mode` here, or None (an unsupported `compiled` is tried anyway)."""
    if mode == "graph" and suite.device.type != "cuda":
        return "CUDA graphs need a CUDA device"
    if mode == "graph" and "graph" not in method.modes:
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
    out = out.detach().cpu()
    row.reference, row.exact = label, torch.equal(out, ref)
    if not row.exact and out.shape == ref.shape:
        row.max_abs_diff = (out.float() - ref.float()).abs().max().item()


def make_call(suite: Suite, mode: str, ids: torch.Tensor, compiled: Callable) -> Callable[[], torch.Tensor]:
    """The zero-argument forward to time in `mode`."""
    if mode == "eager":
        return lambda: forward(suite.model, ids)
    if mode == "compiled":
        return lambda: compiled(ids)
    return capture_graph(compiled, ids)


def run_mode(suite: Suite, method: Method, phase: Phase, row: ResultRow, compiled: Callable) -> None:
    """Time one mode into `row`, check it against the reference, add the link bound."""
    call = make_call(suite, row.mode, suite.inputs[phase.name], compiled)
    entry, out = measure(call, suite.reps, suite.device)
    for key, value in entry.items():
        setattr(row, key, value)
    row.tokens_per_s = phase.tokens / (row.median_ms / 1e3)
    compare(suite, method, row, out)
    if suite.bandwidth and row.link_bytes:
        row.link_bound_ms = row.link_bytes / (suite.bandwidth * 1e9) * 1e3
        row.ratio = row.median_ms / row.link_bound_ms
    if suite.timeline and row.mode == "eager" and method.name.startswith("ws-"):
        record_stored_timeline(suite, row, call)


def record_stored_timeline(suite: Suite, row: ResultRow, call: Callable[[], torch.Tensor]) -> None:
    """Profile one more call and keep its copy/compute timeline in the document (first budget only)."""
    if row.budget_bytes != suite.doc["budgets"][0]:
        return
    try:
        events = record_timeline(suite.model, call)
    except Exception as exc:  # a profiler problem must not cost the measurement
        log(f"timeline of {row.method} {row.phase}: {first_line(exc)}")
        return
    if events:
        suite.doc["timelines"].append({"method": row.method, "phase": row.phase, "mode": row.mode,
                                       "budget_bytes": row.budget_bytes, "events": events})


def add_row(suite: Suite, row: ResultRow) -> None:
    """Append a finished row, print it, and rewrite the JSON."""
    suite.doc["results"].append(asdict(row))
    log(describe(row))
    write_json(suite.doc, suite.out_path)


def describe(row: ResultRow) -> str:
    """One progress line for a row."""
    head = f"{row.method} {row.phase} budget {_budget_text(row.budget_bytes, None)} {row.mode}"
    if row.median_ms is None:
        return f"{head}: {row.error or 'skipped: ' + str(row.skipped)}"
    return (f"{head}: {row.median_ms:.2f} ms [{row.min_ms:.2f}..{row.max_ms:.2f}] x{row.reps}, "
            f"{row.tokens_per_s:.1f} tok/s, ratio {_fmt(row.ratio, 2)}, exact {row.exact} ({row.reference})")


def run_modes(suite: Suite, method: Method, phase: Phase, budget: int | None, setup: dict,
              until: float | None) -> None:
    """Every selected mode of one prepared method and phase; a failure is recorded, not raised. A mode
    not started by `until` (time.monotonic(); None: no limit) is skipped."""
    compiled = torch.compile(lambda ids: forward(suite.model, ids), fullgraph=True, dynamic=False)
    for mode in suite.modes:
        row = ResultRow(method.name, phase.name, budget, mode, tokens=phase.tokens,
                        link_bytes=setup.get("link_bytes"), setup=setup)
        row.skipped = mode_skip(suite, method, mode)
        if row.skipped is None and until is not None and time.monotonic() > until:
            row.skipped = f"not run: {_over_time(suite)}"
        if row.skipped is None:
            try:
                with method_limit(suite, until):
                    run_mode(suite, method, phase, row, compiled)
            except Exception as exc:  # record and go on: the rest of the run still counts
                row = ResultRow(method.name, phase.name, budget, mode, tokens=phase.tokens,
                                error=first_line(exc), link_bytes=row.link_bytes, setup=setup)
        add_row(suite, row)
    del compiled
    release_memory(suite.device)  # drop compiled code and graphs before the weights move back


class TimeLimitExceeded(Exception):
    """A method ran past its --method-seconds."""


@contextlib.contextmanager
def time_limit(until: float, message: str):
    """Raise TimeLimitExceeded(message) in this thread once time.monotonic() passes `until`. A SIGALRM
    timer: it interrupts Python code and sleeps, but a long call inside one C function (a single huge
    copy) is interrupted only when it returns. Main thread of a POSIX process only."""
    remaining = until - time.monotonic()
    if remaining <= 0:
        raise TimeLimitExceeded(message)

    def on_alarm(signum, frame):
        raise TimeLimitExceeded(message)

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, remaining)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _over_time(suite: Suite) -> str:
    return f"did not finish within the method's --method-seconds ({suite.method_seconds:g} s)"


def method_limit(suite: Suite, until: float | None):
    """The running method's time limit (`until` from time.monotonic()), or none when `until` is None."""
    return contextlib.nullcontext() if until is None else time_limit(until, _over_time(suite))


def run_prepared(suite: Suite, method: Method, phase: Phase, budget: int | None) -> bool:
    """Prepare `method` for one budget and phase, run its modes, undo it. False when the model could
    not be put back (the run must stop: every later number would be suspect)."""
    snapshot = {id(m): set(m.__dict__) for m in suite.model.modules()}
    until = None if suite.method_seconds is None else time.monotonic() + suite.method_seconds
    try:
        with method_limit(suite, until):
            setup, undo = method.prepare(suite.model, budget, phase.tokens, suite.device)
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


def header(shape: str, device: torch.device, model: nn.Module, bandwidth: float | None, command: str) -> dict:
    """The result document before any measurement."""
    import torch._inductor.config
    import transformers

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"none (cpu {platform.machine()})"
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "command": command, "date": now.isoformat(timespec="seconds"),
        "gpu": gpu, "torch": torch.__version__, "transformers": transformers.__version__,
        "weightstream": __version__, "python": platform.python_version(),
        "versions": {m.requires: _version(m.requires) for m in METHODS if m.requires},
        "inductor_emulate_precision_casts": bool(torch._inductor.config.emulate_precision_casts),
        "h2d_bandwidth_GBps": bandwidth,
        "shape": {"name": shape, **{k: v for k, v in SUITE_SHAPES[shape].items()}, "dtype": "bfloat16"},
        "weight_bytes": module_bytes(model), "build_device": str(home_device(model)),
        "skipped_methods": {}, "timelines": [], "results": [],
    }


def _version(module: str) -> str | None:
    return None if _import_error(module) else getattr(importlib.import_module(module), "__version__", "?")


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
) -> dict:
    """Run every method x budget x phase x mode on one model of `shape` and write the result document
    to `out_path` after each measurement; return the document.

    budgets: fractions of the weight bytes (0.25) or sizes ("8GiB", bytes). phases: `decode-bN`,
    `prefill-N`. methods: names from METHODS (run in registry order; unknown names raise, known ones
    that cannot run here are listed in `skipped_methods`). modes: eager, compiled, graph. reps: timed
    calls per measurement. device: "cuda" or "cpu". timeline: keep a profiler timeline of each
    weightstream method's eager forward at the first budget (CUDA only). emulate_precision_casts: set
    Inductor's flag of that name for every compile, so compiled code rounds to bf16 where eager does
    (benchmarks/README.md: without it, fusion across block boundaries can differ by one ulp).
    max_seconds: prepare no method after this many seconds from the start; the measurements not made
    are recorded as skipped (a run ends cleanly inside a command's time limit; one method and phase
    already started runs to its end). method_seconds: stop a method that has not finished one budget
    and phase (preparation and every mode) within this many seconds; its unfinished modes are
    recorded as errors or skipped, it is undone, and the run goes on with the next (needs the main
    thread of a POSIX process: a SIGALRM timer).
    """
    import torch._inductor.config

    previous = torch._inductor.config.emulate_precision_casts
    torch._inductor.config.emulate_precision_casts = emulate_precision_casts
    try:
        return _run(shape, budgets, phases, methods, modes, reps, _resolve(device), out_path, seed, timeline,
                    command, max_seconds, method_seconds)
    finally:
        torch._inductor.config.emulate_precision_casts = previous


def _run(shape, budgets, phases, methods, modes, reps, device, out_path, seed, timeline, command,
         max_seconds, method_seconds) -> dict:
    """The body of `run_suite`, with the Inductor flag set."""
    _check_names(methods, [m.name for m in METHODS], "method")
    _check_names(modes, list(MODES), "mode")
    if max_seconds is not None and max_seconds <= 0:
        raise ValueError(f"max_seconds={max_seconds}: give a positive number of seconds, or none")
    if method_seconds is not None:
        if method_seconds <= 0:
            raise ValueError(f"method_seconds={method_seconds}: give a positive number of seconds, or none")
        if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
            raise ValueError("method_seconds needs a SIGALRM timer: the main thread of a POSIX process")
    stop_at = None if max_seconds is None else time.monotonic() + max_seconds
    suite = _start(shape, budgets, [parse_phase(p) for p in phases], modes, reps, device, out_path, seed,
                   timeline, command)
    suite.stop_at, suite.method_seconds = stop_at, method_seconds
    suite.doc["max_seconds"], suite.doc["method_seconds"] = max_seconds, method_seconds
    suite.doc["skipped_methods"] = {k: v for k, v in unavailable().items() if k in methods}
    write_json(suite.doc, out_path)
    for method in METHODS:
        if method.name in methods and method.name in suite.doc["skipped_methods"]:
            log(f"{method.name}: skipped ({suite.doc['skipped_methods'][method.name]})")
        elif method.name in methods and not run_method(suite, method, suite.doc["budgets"]):
            break
    write_json(suite.doc, out_path)
    return suite.doc


def _start(shape, budgets, phases, modes, reps, device, out_path, seed, timeline, command) -> Suite:
    """Measure the link, build the model where it fits, make the inputs and the document header."""
    weights = shape_weight_bytes(shape)
    budget_bytes = [resolve_budget(b, weights) for b in budgets]
    bandwidth = h2d_bandwidth(device) if device.type == "cuda" else None
    log(f"host->GPU pinned bandwidth: {_fmt(bandwidth, 1)} GB/s")
    where, note = build_device(weights, device)
    model = build_model(shape, where, seed)
    log(f"{shape}: {format_size(weights)} of bf16 weights on {where} ({note})")
    doc = header(shape, device, model, bandwidth, command or shlex.join(sys.argv))
    doc.update(budgets=budget_bytes, phases=[p.name for p in phases], build_note=note,
               reference="resident" if where == device else "first weightstream method")
    inputs = make_inputs(model.config.vocab_size, phases, device, seed)
    return Suite(device, model, where, phases, inputs, list(modes), reps, bandwidth, doc, out_path, timeline)


def _resolve(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _check_names(given: list[str], known: list[str], what: str) -> None:
    bad = [x for x in given if x not in known]
    if bad or not given:
        raise ValueError(f"{what}s {bad or given!r}: choose from {', '.join(known)}")


# --- timelines ------------------------------------------------------------------------------------
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


# --- tables and plots -----------------------------------------------------------------------------
def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _budget_text(budget: int | None, weight_bytes: int | None) -> str:
    if budget is None:
        return "-"
    share = f" ({100 * budget / weight_bytes:.0f}%)" if weight_bytes else ""
    return format_size(budget) + share


def _order(doc: dict, row: dict) -> tuple:
    names = [m.name for m in METHODS]
    phases = doc.get("phases") or []
    return (phases.index(row["phase"]) if row["phase"] in phases else len(phases), row["budget_bytes"] or 0,
            names.index(row["method"]) if row["method"] in names else len(names), MODES.index(row["mode"]))


def _table_row(doc: dict, r: dict) -> str:
    cells = [doc["shape"]["name"], r["phase"], _budget_text(r["budget_bytes"], doc["weight_bytes"]),
             r["method"], r["mode"]]
    if r["median_ms"] is None:
        why = f"error: {r['error']}" if r["error"] else f"skipped: {r['skipped']}"
        return "| " + " | ".join(cells + [why.replace("|", "/")[:100], "", "", "", ""]) + " |"
    exact = "ref" if r.get("reference") == "self" else str(r["exact"]) if r["exact"] is not None else "-"
    cells += [f"{r['tokens_per_s']:.1f}", f"{r['median_ms']:.2f}", _fmt(r["link_bound_ms"], 1),
              _fmt(r["ratio"], 2), exact]
    return "| " + " | ".join(cells) + " |"


def markdown_table(docs: list[dict]) -> str:
    """One markdown row per shape/phase/budget/method/mode: tokens/s, median ms, link bound ms, ratio to
    the link bound, exact ("ref" for the reference itself); errors and skips in the tokens/s column."""
    columns = ["shape", "phase", "budget", "method", "mode", "tokens/s", "median ms", "link bound ms",
               "ratio", "exact"]
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for doc in docs:
        lines += [_table_row(doc, r) for r in sorted(doc["results"], key=lambda r: _order(doc, r))]
    return "\n".join(lines)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(docs: list[dict], phase: str) -> dict[tuple[str, str], list[tuple[int | None, float]]]:
    """(method, mode) -> [(budget bytes or None, tokens/s)] of the measured rows of one phase."""
    series: dict[tuple[str, str], list] = {}
    for doc in docs:
        for r in doc["results"]:
            if r["phase"] == phase and r["median_ms"] is not None:
                series.setdefault((r["method"], r["mode"]), []).append((r["budget_bytes"], r["tokens_per_s"]))
    return series


def _size_unit(docs: list[dict]) -> tuple[int, str]:
    """The binary unit that suits the largest budget of the documents: (bytes per unit, its name)."""
    largest = max((b for d in docs for b in d.get("budgets") or [] if b), default=2**30)
    return next((2**e, n) for e, n in ((30, "GiB"), (20, "MiB"), (10, "KiB"), (0, "B")) if largest >= 2**e)


def _plot_phase(ax, docs: list[dict], phase: str) -> None:
    names = [m.name for m in METHODS]
    unit, unit_name = _size_unit(docs)
    styles = {"eager": "-", "compiled": "--", "graph": ":"}
    for (method, mode), points in sorted(_series(docs, phase).items()):
        color = f"C{names.index(method) if method in names else len(names)}"
        label = f"{method} {mode}"
        budgeted = sorted((b / unit, t) for b, t in points if b is not None)
        if budgeted:
            ax.plot(*zip(*budgeted, strict=True), styles[mode], marker="o", color=color, label=label)
        for _, t in [p for p in points if p[0] is None][:1]:
            ax.axhline(t, linestyle=styles[mode], color=color, alpha=0.7, label=label)
    ax.set(title=phase, xlabel=f"GPU budget for weights ({unit_name})", ylabel="tokens/s", yscale="log")
    ax.grid(True, alpha=0.3)


def plot_tokens_per_s(docs: list[dict], png_path: str) -> None:
    """tokens/s of each method and mode against the GPU budget, one panel per phase (log scale).
    Methods without a budget (resident, accelerate cpu_offload, diffusers) are horizontal lines.
    Needs matplotlib (the `bench` extra)."""
    plt = _pyplot()
    phases = list(dict.fromkeys(r["phase"] for d in docs for r in d["results"]))
    fig, axes = plt.subplots(1, max(len(phases), 1), figsize=(5.5 * max(len(phases), 1), 4.5), squeeze=False)
    for ax, phase in zip(axes[0], phases, strict=False):
        _plot_phase(ax, docs, phase)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    shapes = ", ".join(sorted({d["shape"]["name"] for d in docs}))
    fig.suptitle(f"{shapes} on {docs[0]['gpu'] if docs else '?'}")
    fig.tight_layout(rect=(0, 0.05 + 0.03 * (len(labels) // 4), 1, 1))
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def plot_timeline(events: list, png_path: str, title: str = "one forward") -> None:
    """Draw a forward's GPU timeline: a "copy" row (host->GPU copies) above a "compute" row, from
    (stream, label, start_ms, end_ms) tuples. Needs matplotlib (the `bench` extra)."""
    plt = _pyplot()
    rows = {"compute": (0, "C0"), "copy": (1, "C1")}
    fig, ax = plt.subplots(figsize=(12, 2.6))
    for stream, (y, color) in rows.items():
        spans = [(float(s), float(e) - float(s)) for st, _, s, e in events if st == stream]
        ax.broken_barh(spans, (y - 0.35, 0.7), facecolors=color, edgecolors="white", linewidth=0.3)
    ax.set(yticks=[0, 1], yticklabels=list(rows), xlabel="ms from the first GPU activity", title=title)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


# --- report ---------------------------------------------------------------------------------------
REPORT_HEADER = """# Benchmarks

Generated by `weightstream bench --report` from stored result files (listed per run below); do not edit
by hand. Every number is one forward, `model(ids, use_cache=False)`, of a model with random bf16 weights:

- **phase**: `decode-bN` = 1 new token for each of N sequences (no KV cache: the step's weight traffic,
  not attention over a context); `prefill-N` = N tokens of one sequence.
- **mode**: `eager`; `compiled` = `torch.compile(fullgraph=True)`; `graph` = a CUDA graph of the compiled
  call, replayed. A method's failure in a mode is shown as its error.
- **budget**: GPU memory for weights given to the method (resident weights plus staging), and its share
  of all weight bytes; `-` for methods that take no budget.
- **median ms**: median of CUDA-event timings of repeated forwards after two warm-up calls, each from an
  idle GPU; **tokens/s** = tokens per forward / median.
- **link bound ms**: bytes that cross the host->GPU link per forward / the pinned bandwidth measured at
  the start of the run; **ratio** = median / link bound (1.00 = as fast as the link allows). For zero
  copy the bytes are every weight read in place; a mixture-of-experts block reads only the experts its
  tokens are routed to, so there a ratio below 1 means fewer bytes crossed, not a faster link.
- **exact**: `torch.equal` of the logits against the reference of the same phase and mode (the resident
  model run the same way, or, for a model that does not fit the GPU, the first weightstream method);
  `ref` marks the reference itself.
"""


def _run_section(doc: dict, path: str) -> str:
    skipped = "; ".join(f"`{k}`: {v}" for k, v in doc.get("skipped_methods", {}).items()) or "none"
    lines = [f"## {doc['shape']['name']} on {doc['gpu']}", "",
             f"- file `{path}`, {doc['date']}, torch {doc['torch']}, "
             f"weightstream {doc.get('weightstream', '?')}",
             f"- command: `{doc['command']}`",
             f"- weights {format_size(doc['weight_bytes'])} built on {doc.get('build_device', '?')}; "
             f"host->GPU {_fmt(doc['h2d_bandwidth_GBps'], 1)} GB/s; reference: {doc.get('reference', '?')}",
             f"- methods not run: {skipped}"]
    limits = [f"--{k.replace('_', '-')} {doc[k]:g}" for k in ("max_seconds", "method_seconds") if doc.get(k)]
    if limits:
        lines.append(f"- time limits: {', '.join(limits)}")
    if doc.get("aborted"):
        lines.append(f"- **run stopped early**: {doc['aborted']}")
    for key in ("note", "command_note"):
        if doc.get(key):
            lines.append(f"- {key.replace('_', ' ')}: {doc[key]}")
    return "\n".join(lines)


def _best(rows: list[dict], methods: tuple[str, ...], budget: int | None) -> dict | None:
    """The fastest of `rows` (measured rows of one shape and phase, any mode and run) of any of
    `methods` at `budget` or at none (a method that takes no budget, such as accelerate's
    `cpu_offload`, uses less GPU memory than any)."""
    rows = [r for r in rows if r["method"] in methods and r["budget_bytes"] in (budget, None)]
    return min(rows, key=lambda r: r["median_ms"], default=None)


def _label(row: dict | None) -> str:
    return "not measured" if row is None else f"{row['median_ms']:.1f} ms ({row['method']} {row['mode']})"


def bar_lines(docs: list[dict]) -> list[str]:
    """Issue 5's bars, checked on stored results: per shape, phase and weightstream budget, `auto` (its
    fastest mode) against accelerate's fastest method on each decode phase (>= 5x) and against zero copy
    on each prefill (>= 2x), both at the same budget, and its ratio to the link bound on batch-1 decode
    (<= 1.05). One line each."""
    accelerate = tuple(m.name for m in METHODS if m.name.startswith("accelerate-"))
    lines = []
    for shape in dict.fromkeys(d["shape"]["name"] for d in docs):
        weight_bytes = next(d["weight_bytes"] for d in docs if d["shape"]["name"] == shape)
        rows = [r for d in docs if d["shape"]["name"] == shape for r in d["results"]]
        for phase in dict.fromkeys(r["phase"] for r in rows):
            measured = [r for r in rows if r["phase"] == phase and r["median_ms"] is not None]
            budgets = sorted({r["budget_bytes"] for r in measured if r["method"] == "ws-auto"})
            if not budgets:
                lines.append(f"- {shape} {phase}: cannot be checked: ws-auto not measured")
            decode = phase.startswith("decode")
            others, need = (accelerate, 5) if decode else (("ws-uva",), 2)
            for budget in budgets:
                auto = _best(measured, ("ws-auto",), budget)
                other = _best(measured, others, budget)
                if other:
                    speedup = other["median_ms"] / auto["median_ms"]
                    verdict = f"**{speedup:.1f}x** ({'met' if speedup >= need else 'NOT met'}: >= {need}x)"
                else:
                    verdict = f"cannot be checked: {' or '.join(others)} not measured at this budget"
                missing = [m for m in accelerate if decode and not _best(measured, (m,), budget)]
                if other and missing:
                    verdict += f"; not measured here: {', '.join(missing)}"
                where = f"{shape} {phase} at {_budget_text(budget, weight_bytes)}"
                lines.append(f"- {where}: ws-auto {_label(auto)} vs {_label(other)}: {verdict}")
                if phase == "decode-b1" and auto["ratio"] is not None:
                    ok = "met" if auto["ratio"] <= 1.05 else "NOT met"
                    below = ("; below 1: routed experts read in place, fewer bytes than the bound counts"
                             if auto["ratio"] < 0.9 else "")
                    lines.append(f"- {where}: ws-auto at {auto['ratio']:.3f}x the link bound "
                                 f"({auto['link_bound_ms']:.1f} ms) ({ok}: <= 1.05{below})")
    return lines


def load_results(paths: list[str]) -> list[dict]:
    """Read and validate stored result documents."""
    docs = []
    for path in paths:
        with open(path) as f:
            try:
                docs.append(validate(json.load(f)))
            except ValueError as err:
                raise ValueError(f"{path}: {err}") from err
    return docs


def write_benchmarks_md(result_paths: list[str], md_path: str, images: list[str] = ()) -> str:
    """Write a docs/benchmarks.md-style page from stored result files: the header explaining the
    numbers, each run's context, the table, and `images` (PNG paths, linked relative to the page).
    Returns the text."""
    docs = load_results(result_paths)
    here = os.path.dirname(os.path.abspath(md_path))
    parts = [REPORT_HEADER.strip(), "## The bars, checked on these results\n\n" + "\n".join(bar_lines(docs))]
    parts += [_run_section(doc, path) for doc, path in zip(docs, result_paths, strict=True)]
    parts += [f"![{os.path.basename(p)}]({os.path.relpath(os.path.abspath(p), here)})" for p in images]
    parts.append(markdown_table(docs))
    text = "\n\n".join(parts) + "\n"
    os.makedirs(here, exist_ok=True)
    with open(md_path, "w") as f:
        f.write(text)
    return text


def write_plots(docs: list[dict], png_dir: str) -> list[str]:
    """One tokens/s plot per shape and one timeline plot per stored timeline; returns the PNG paths."""
    os.makedirs(png_dir, exist_ok=True)
    paths = []
    for shape in dict.fromkeys(d["shape"]["name"] for d in docs):
        paths.append(os.path.join(png_dir, f"bench_{shape}.png"))
        plot_tokens_per_s([d for d in docs if d["shape"]["name"] == shape], paths[-1])
    for doc in docs:
        for t in doc.get("timelines", []):
            share = f"_{round(100 * t['budget_bytes'] / doc['weight_bytes'])}pct" if t["budget_bytes"] else ""
            name = f"timeline_{doc['shape']['name']}_{t['method']}_{t['phase']}{share}.png"
            paths.append(os.path.join(png_dir, name))
            title = (f"{doc['shape']['name']} {t['method']} {t['phase']} {t['mode']}, "
                     f"budget {format_size(t['budget_bytes'])}")
            plot_timeline(t["events"], paths[-1], title)
    return paths


# --- command line ---------------------------------------------------------------------------------
def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The `weightstream bench` command line; see the module docstring."""
    p = argparse.ArgumentParser(prog="weightstream bench", description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=list(SUITE_SHAPES), default="llama-3-8b")
    p.add_argument("--budgets", type=_csv, default=["0.25", "0.5", "0.75"],
                   help="GPU budgets: fractions of the weight bytes (0.25) or sizes (8GiB), comma separated")
    p.add_argument("--phases", type=_csv, default=list(DEFAULT_PHASES), help="decode-bN, prefill-N")
    p.add_argument("--methods", type=_csv, default=[m.name for m in METHODS], help="default: all")
    p.add_argument("--modes", type=_csv, default=list(MODES), help="eager, compiled, graph")
    p.add_argument("--reps", type=int, default=10, help="timed forwards per measurement")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seconds", type=float, default=None,
                   help="prepare no method after this many seconds; the rest is recorded as skipped")
    p.add_argument("--method-seconds", type=float, default=None,
                   help="stop a method that has not finished a budget and phase within this many seconds "
                        "(recorded as its error) and go on with the next")
    p.add_argument("--no-timeline", action="store_true", help="skip the profiler timelines (CUDA only)")
    p.add_argument("--emulate-precision-casts", action="store_true",
                   help="Inductor rounds to bf16 where eager does (compiled exactness, benchmarks/README.md)")
    p.add_argument("--out", default=None, help="result JSON (default benchmarks/results/suite_<shape>.json)")
    p.add_argument("--report", nargs="+", metavar="RESULTS",
                   help="run nothing: write the table and plots from stored result JSON files")
    p.add_argument("--md", default="docs/benchmarks.md", help="markdown page written by --report")
    p.add_argument("--png-dir", default="docs", help="folder for the plots written by --report")
    return p.parse_args(argv)


def report(paths: list[str], md_path: str, png_dir: str) -> str:
    """Regenerate the page and its plots from stored results (plots need matplotlib)."""
    images = write_plots(load_results(paths), png_dir)
    return write_benchmarks_md(paths, md_path, images)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `weightstream bench`; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        if args.report:
            report(args.report, args.md, args.png_dir)
            print(f"wrote {args.md} and plots in {args.png_dir}")
            return 0
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cpu" and not args.shape.startswith("tiny"):
            raise ValueError("without CUDA, run the harness on --shape tiny or tiny-moe (a correctness smoke "
                             "test)")
        out = args.out or f"benchmarks/results/suite_{args.shape}.json"
        doc = run_suite(args.shape, args.budgets, args.phases, args.methods, args.modes, args.reps, device,
                        out, seed=args.seed, timeline=not args.no_timeline,
                        emulate_precision_casts=args.emulate_precision_casts,
                        command="weightstream bench " + shlex.join(argv), max_seconds=args.max_seconds,
                        method_seconds=args.method_seconds)
    except (ValueError, OSError) as err:
        print(f"weightstream bench: {err}", file=sys.stderr)
        return 1
    print("\n" + markdown_table([doc]), flush=True)
    return 0 if not doc.get("aborted") else 1


if __name__ == "__main__":
    sys.exit(main())
