"""Benchmark of weightstream's core streaming engine on a Llama shape with random bf16 weights.

One forward at decode size (1 token, batch 1) and at prefill size (2048 tokens, batch 1), for:
  resident    every weight on the GPU: the reference outputs and the compute floor
  stream      weightstream.offload with a budget that streams every decoder layer
  uva         decoder weights read in place from pinned host memory (vLLM-style zero copy)
  accelerate  accelerate.cpu_offload (eager only: its hooks are compiler-disabled)
each in eager, torch.compile(fullgraph=True) and (decode) CUDA-graph mode, checked bit-exact
(torch.equal) against the resident model run the same way. See benchmarks/README.md.

    PYTHONPATH=src python3 benchmarks/bench_core.py --methods resident,stream
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import importlib.util
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch._inductor.config
import transformers
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import weightstream as ws
from weightstream.layout import align_up
from weightstream.suite import allocated
from weightstream.suite import release_memory as free_memory
from weightstream.timing import capture_graph, sync, time_calls

# Methods run in this order whatever --methods says: accelerate leaves the model offloaded, so it is last.
METHODS = ("resident", "stream", "uva", "accelerate")
PHASES = ("decode", "prefill")
MODES = ("eager", "compiled", "graph")
SHAPES = {
    "llama-3-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
    ),
    "tiny": dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, rope_theta=500000.0, max_position_embeddings=8192,
    ),
}
SLOW_CALL_S = 1.0  # a warm call slower than this (seconds) is timed with --slow-reps
STREAM_MARGIN = 64 * 2**20  # bytes of slack in the stream budget, capped below one layer
_T0 = time.monotonic()


@dataclass
class Bench:
    """Everything one invocation works on. `bandwidth` is host->GPU pinned copy speed in GB/s."""

    args: argparse.Namespace
    device: torch.device
    model: nn.Module
    inputs: dict[str, torch.Tensor]  # phase -> input ids
    doc: dict
    bandwidth: float | None
    refs: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)  # (phase, mode) -> logits


# --- small helpers ----------------------------------------------------------------------------------
def log(msg: str) -> None:
    """Print a progress line with seconds since start (flushed: a timeout keeps what was printed)."""
    print(f"[{time.monotonic() - _T0:7.1f}s] {msg}", flush=True)


def first_line(exc: BaseException) -> str:
    """The exception's type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def nbytes(t: torch.Tensor) -> int:
    """Size of a tensor's elements in bytes."""
    return t.numel() * t.element_size()


def configure_compile(emulate_precision_casts: bool) -> None:
    """Room for one static compile per shape and method (no dynamic shapes); optionally make Inductor
    round to bf16 wherever eager would, even inside fused kernels."""
    torch._inductor.config.emulate_precision_casts = emulate_precision_casts
    cfg = torch._dynamo.config
    limit = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    total = "accumulated_recompile_limit" if hasattr(cfg, "accumulated_recompile_limit") else None
    setattr(cfg, limit, 64)
    if total:
        setattr(cfg, total, 512)


def git_commit() -> str | None:
    """HEAD commit of the repository, with '+dirty' when the tree has changes; None without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


# --- model, inputs, link ----------------------------------------------------------------------------
def build_model(shape: str, device: torch.device, seed: int) -> nn.Module:
    """A LlamaForCausalLM with random bf16 weights, created directly on `device`, in eval mode."""
    cfg = LlamaConfig(**SHAPES[shape], attn_implementation="sdpa")
    torch.manual_seed(seed)
    random.seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # params born bf16; rotary inv_freq stays fp32 as in HF
    try:
        with device:
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def make_inputs(vocab: int, prefill_tokens: int, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """Fixed random input ids per phase, shape (1, tokens)."""
    gen = torch.Generator().manual_seed(seed + 1)
    sizes = {"decode": 1, "prefill": prefill_tokens}
    return {p: torch.randint(vocab, (1, n), generator=gen).to(device) for p, n in sizes.items()}


def forward(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """One forward without KV cache; returns logits (1, tokens, vocab)."""
    return model(ids, use_cache=False).logits


def make_forward(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """`forward` bound to `model`, as a plain function for torch.compile."""

    def fwd(ids: torch.Tensor) -> torch.Tensor:
        return forward(model, ids)

    return fwd


def compile_forward(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """torch.compile(fullgraph=True, dynamic=False) of the model's forward (compiles lazily per shape)."""
    return torch.compile(make_forward(model), fullgraph=True, dynamic=False)


def h2d_bandwidth(device: torch.device) -> float:
    """Host->GPU copy speed from pinned memory in GB/s (1e9 bytes): median of 10 copies of 1 GiB."""
    src = torch.empty(2**30, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(2**30, dtype=torch.uint8, device=device)
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del src, dst
    return 2**30 / 1e9 / (statistics.median(times) / 1e3)


def shape_record(model: nn.Module, name: str) -> dict:
    """The config fields that define the shape, as recorded in the JSON."""
    cfg = model.config
    fields = {k: getattr(cfg, k, None) for k in SHAPES[name] if k != "rope_theta"}
    rope = getattr(cfg, "rope_parameters", None) or {}
    fields["rope_theta"] = rope.get("rope_theta", getattr(cfg, "rope_theta", None))
    return {"name": name, **fields, "attn_implementation": cfg._attn_implementation, "dtype": "bfloat16"}


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every distinct parameter and buffer."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(nbytes(t) for t in tensors.values())


# --- timing -----------------------------------------------------------------------------------------
def warm_up(fn: Callable[[], torch.Tensor], device: torch.device) -> tuple[float, float, torch.Tensor]:
    """Two untimed calls (the first may compile); return their wall times in s and a copy of the output."""
    walls = []
    for _ in range(2):
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        walls.append(time.perf_counter() - t0)
    return walls[0], walls[1], out.clone()


def measure(b: Bench, fn: Callable[[], torch.Tensor], slow: bool) -> tuple[dict, torch.Tensor]:
    """Warm up, then time fn(); slow calls (or `slow`) get --slow-reps. Returns the entry and last output."""
    first_s, warm_s, warm_out = warm_up(fn, b.device)
    reps = b.args.slow_reps if slow or warm_s > SLOW_CALL_S else b.args.reps
    cuda = b.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(b.device)
    times, out = time_calls(fn, reps, b.device)
    entry = {
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "max_ms": max(times),
        "reps": reps,
        "first_call_s": first_s,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(b.device) if cuda else None,
        "repeatable": torch.equal(out, warm_out),
    }
    return entry, out


# --- exactness and bounds ---------------------------------------------------------------------------
def compare(b: Bench, phase: str, mode: str, out: torch.Tensor) -> dict:
    """Bit-exactness of `out` against the resident reference of the same phase and mode."""
    ref = b.refs.get((phase, mode))
    if ref is None:
        return {"exact": None, "reference": "none (run --methods resident in the same invocation)"}
    exact = torch.equal(out, ref)
    result = {"exact": exact, "reference": f"resident {mode}"}
    if not exact:
        result["max_abs_diff"] = (out.float() - ref.float()).abs().max().item()
    return result


def resident_ms(b: Bench, phase: str, mode: str) -> float | None:
    """Median ms of the resident model for this phase and mode (compiled when that mode is missing)."""
    entries = b.doc["results"].get("resident", {}).get(phase, {})
    for m in (mode, "compiled"):
        if "median_ms" in entries.get(m, {}):
            return entries[m]["median_ms"]
    return None


def add_bounds(b: Bench, phase: str, mode: str, entry: dict, link_bytes: int) -> None:
    """Link bound (ms to move `link_bytes` at the measured bandwidth) and ratio = median / bound; for
    prefill the bound is max(resident time of the same mode, link bound)."""
    link_ms = link_bytes / (b.bandwidth * 1e9) * 1e3 if b.bandwidth and link_bytes else None
    entry["link_bound_ms"] = link_ms
    floor = link_ms
    if phase == "prefill":
        floor = max([x for x in (resident_ms(b, phase, mode), link_ms) if x is not None], default=None)
    entry["ratio"] = entry["median_ms"] / floor if floor else None


# --- one mode, one phase, one method ----------------------------------------------------------------
def mode_skip(b: Bench, method: str, phase: str, mode: str) -> str | None:
    """Why this mode does not run here, or None."""
    if method == "accelerate" and mode != "eager":
        return "accelerate cpu_offload hooks are compiler-disabled: see setup.compile_error"
    if mode == "graph" and b.device.type != "cuda":
        return "CUDA graphs need a CUDA device"
    if mode == "graph" and phase == "prefill" and not b.args.prefill_graph:
        return "prefill CUDA graph off (pass --prefill-graph)"
    return None


def run_mode(b: Bench, method: str, phase: str, mode: str, compiled: Callable, link_bytes: int) -> dict:
    """Time one method/phase/mode; record exactness against the resident reference of that mode."""
    ids = b.inputs[phase]
    if mode == "eager":
        fn = make_forward(b.model)
        call = lambda: fn(ids)  # noqa: E731
    elif mode == "compiled":
        call = lambda: compiled(ids)  # noqa: E731
    else:
        call = capture_graph(compiled, ids)
    entry, out = measure(b, call, slow=method == "accelerate")
    if method == "resident":
        b.refs[(phase, mode)] = out.clone()
    else:
        ref_mode = "eager" if method == "accelerate" else mode
        entry.update(compare(b, phase, ref_mode, out))
        add_bounds(b, phase, mode, entry, link_bytes)
    return entry


def describe(method: str, phase: str, mode: str, entry: dict) -> str:
    """One progress line for a finished entry."""
    if "median_ms" not in entry:
        return f"{method} {phase} {mode}: {entry}"
    return (
        f"{method} {phase} {mode}: median {entry['median_ms']:.2f} ms "
        f"[{entry['min_ms']:.2f}..{entry['max_ms']:.2f}] x{entry['reps']}, "
        f"first call {entry['first_call_s']:.1f} s, "
        f"exact {entry.get('exact', 'ref')}, ratio {fmt(entry.get('ratio'), 2)}"
    )


def run_phase(b: Bench, method: str, phase: str, compiled: Callable, link_bytes: int, result: dict) -> None:
    """Every selected mode of one phase into `result`, written out after each mode; a mode's failure is
    recorded, not raised."""
    result["tokens"] = b.inputs[phase].shape[1]
    if method == "resident":
        b.refs[(phase, "eager")] = forward(b.model, b.inputs[phase])  # eager reference before compiling
    for mode in b.args.modes:
        reason = mode_skip(b, method, phase, mode)
        if reason:
            result[mode] = {"skipped": reason}
            continue
        try:
            result[mode] = run_mode(b, method, phase, mode, compiled, link_bytes)
        except Exception as exc:  # record and go on: a timeout-bounded run keeps the rest
            result[mode] = {"error": first_line(exc)}
        log(describe(method, phase, mode, result[mode]))
        write_json(b)


# --- methods: each returns (setup record, undo function) --------------------------------------------
def prepare_resident(b: Bench) -> tuple[dict, Callable[[], dict]]:
    """Nothing to change: the model is fully on the device."""
    return {"allocated_bytes": allocated(b.device), "link_bytes": 0}, dict


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder layers (model.model.layers for Llama)."""
    return model.model.layers


def layer_stream_bytes(layer: nn.Module) -> int:
    """A layer's staging footprint in bytes: parameters and persistent buffers, each rounded up to
    weightstream's alignment (256 bytes)."""
    total = sum(align_up(nbytes(p)) for p in layer.parameters())
    for module in layer.modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                total += align_up(nbytes(buf))
    return total


def fixed_bytes(model: nn.Module) -> int:
    """Bytes that stay on the device whatever the budget: tensors outside the decoder layers plus
    non-persistent buffers inside them."""
    inside = {id(t) for t in [*decoder_layers(model).parameters(), *decoder_layers(model).buffers()]}
    outside = {id(t): t for t in [*model.parameters(), *model.buffers()] if id(t) not in inside}
    total = sum(nbytes(t) for t in outside.values())
    for module in decoder_layers(model).modules():
        bufs = [module._buffers.get(n) for n in module._non_persistent_buffers_set]
        total += sum(nbytes(t) for t in bufs if t is not None)
    return total


def stream_budget(model: nn.Module) -> dict:
    """A gpu_memory budget (bytes) that makes weightstream stream every decoder layer through 2 slots:
    fixed bytes + 2 layer footprints + a margin smaller than one layer."""
    layer = max(layer_stream_bytes(m) for m in decoder_layers(model))
    fixed = fixed_bytes(model)
    margin = min(STREAM_MARGIN, layer // 4)
    return {"budget_bytes": fixed + 2 * layer + margin, "fixed_bytes": fixed, "layer_bytes": layer}


def prepare_stream(b: Bench) -> tuple[dict, Callable[[], dict]]:
    """weightstream.offload with a budget of the fixed part plus two layer slots. Planned for a
    2048-token forward, the 8B shape streams every layer through two slots; a small shape may keep one
    layer and use one slot. Records which (`all_layers_streamed`)."""
    budget = stream_budget(b.model)
    before = allocated(b.device)
    t0 = time.perf_counter()
    handle = ws.offload(b.model, gpu_memory=budget["budget_bytes"], device=b.device, strategy="stream",
                        tokens=2048)
    offload_s = time.perf_counter() - t0
    stats = handle.stats
    n_layers = len(decoder_layers(b.model))
    if stats.groups != n_layers:
        log(f"note: the planner streams {stats.groups} of {n_layers} layers through {stats.slots} slot(s)")
    after = allocated(b.device)
    setup = {
        **budget,
        "all_layers_streamed": stats.groups == n_layers,
        "offload_s": offload_s,
        "stats": asdict(stats),
        "allocated_before_bytes": before,
        "allocated_after_bytes": after,
        "freed_bytes": None if before is None else before - after,
        "expected_freed_bytes": stats.streamed_bytes - stats.staging_bytes,
        "link_bytes": stats.streamed_bytes,
    }

    def undo() -> dict:
        end_stats = asdict(handle.stats)
        handle.restore()
        return {"stats_end": end_stats, "allocated_after_restore_bytes": allocated(b.device)}

    return setup, undo


class HostAlias:
    """Pinned host memory presented as a CUDA byte array (`__cuda_array_interface__`). Under UVA a
    pinned allocation is addressable from the GPU, so torch.as_tensor(..., device=cuda) wraps it in a
    CUDA tensor without copying. Holds the host tensor: the view keeps the memory alive."""

    def __init__(self, host: torch.Tensor, device_ptr: int) -> None:
        self.host = host
        self.__cuda_array_interface__ = {
            "shape": (nbytes(host),),
            "typestr": "|u1",
            "data": (device_ptr, False),
            "strides": None,
            "version": 3,
        }


def host_device_pointer(ptr: int) -> int | None:
    """cudaHostGetDevicePointer(ptr) through torch's cudart bindings or libcudart via ctypes; None when
    neither is reachable."""
    cudart = torch.cuda.cudart()
    if hasattr(cudart, "cudaHostGetDevicePointer"):
        return int(cudart.cudaHostGetDevicePointer(ptr, 0))
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        dev = ctypes.c_void_p()
        if lib.cudaHostGetDevicePointer(ctypes.byref(dev), ctypes.c_void_p(ptr), 0) == 0:
            return dev.value
    return None


def pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in pinned (page-locked) host memory, from PyTorch's caching host allocator."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t)
    return host


def uva_view(host: torch.Tensor, device: torch.device, use_device_pointer: bool) -> torch.Tensor:
    """A CUDA tensor aliasing the pinned `host` tensor (same dtype and shape); raises if torch copied."""
    ptr = host.data_ptr()
    if use_device_pointer:
        ptr = host_device_pointer(ptr)
        if ptr is None:
            raise RuntimeError("cudaHostGetDevicePointer is not reachable (no cudart binding, no libcudart)")
    raw = torch.as_tensor(HostAlias(host, ptr), device=device)
    if raw.data_ptr() != ptr:
        raise RuntimeError("torch.as_tensor copied the pinned memory instead of aliasing it")
    return raw.view(host.dtype).view(host.shape)


def pick_pointer(sample: torch.Tensor, device: torch.device) -> bool:
    """Find how to alias pinned memory on this machine: False = data_ptr() works as a device pointer,
    True = go through cudaHostGetDevicePointer. Checked with a GPU kernel reading the alias."""
    host = pinned_copy(sample)
    errors = []
    for use_device_pointer in (False, True):
        try:
            if torch.equal(uva_view(host, device, use_device_pointer), sample):
                return use_device_pointer
            errors.append("alias read wrong values")
        except Exception as exc:
            errors.append(first_line(exc))
    raise RuntimeError(f"cannot alias pinned host memory on the GPU: {errors}")


def prepare_uva(b: Bench) -> tuple[dict, Callable[[], dict]]:
    """Move every decoder-layer parameter into pinned host memory and point it at a CUDA alias of that
    memory: kernels read the weights over the link in place (no staging, no copies)."""
    params = list({id(p): p for p in decoder_layers(b.model).parameters()}.values())
    before = allocated(b.device)
    t0 = time.perf_counter()
    hosts: list[torch.Tensor] = []

    def restore() -> dict:
        sync(b.device)  # kernels may still read the pinned memory
        for p, host in zip(params, hosts, strict=False):
            p.data = host.to(b.device)
        sync(b.device)
        hosts.clear()
        return {"allocated_after_restore_bytes": allocated(b.device)}

    try:
        use_device_pointer = pick_pointer(params[0].data, b.device)
        for p in params:
            host = pinned_copy(p.data)
            view = uva_view(host, b.device, use_device_pointer)
            if not torch.equal(view, p.data):
                raise RuntimeError("a UVA view reads different values than the GPU weight it replaces")
            p.data = view
            hosts.append(host)
    except Exception:
        restore()  # put back the parameters swapped so far
        raise
    sync(b.device)
    gc.collect()
    after = allocated(b.device)
    link_bytes = sum(nbytes(h) for h in hosts)
    setup = {
        "pointer": "cudaHostGetDevicePointer" if use_device_pointer else "data_ptr",
        "setup_s": time.perf_counter() - t0,
        "pinned_bytes": link_bytes,
        "allocated_before_bytes": before,
        "allocated_after_bytes": after,
        "freed_bytes": before - after,
        "link_bytes": link_bytes,
    }
    return setup, restore


def try_compile(b: Bench) -> str | None:
    """Compile (fullgraph) and call the current model once; return the error's first line, or None."""
    fn = compile_forward(b.model)
    try:
        fn(b.inputs["decode"])
        return None
    except Exception as exc:
        return first_line(exc)
    finally:
        del fn
        torch._dynamo.reset()


def prepare_accelerate(b: Bench) -> tuple[dict, Callable[[], dict]]:
    """accelerate.cpu_offload: every weight to CPU, moved to the device per module on each forward.
    Not undone: the model stays offloaded, which is why accelerate runs last."""
    from accelerate import cpu_offload

    before = allocated(b.device)
    t0 = time.perf_counter()
    cpu_offload(b.model, execution_device=b.device)
    offload_s = time.perf_counter() - t0
    gc.collect()
    if b.device.type == "cuda":
        torch.cuda.empty_cache()
    after = allocated(b.device)
    setup = {
        "offload_s": offload_s,
        "allocated_before_bytes": before,
        "allocated_after_bytes": after,
        "freed_bytes": None if before is None else before - after,
        "link_bytes": b.doc["weight_bytes"],
        "compile_error": try_compile(b),
    }
    return setup, lambda: {"note": "left offloaded by accelerate (not restorable in place)"}


PREPARE = {
    "resident": prepare_resident,
    "stream": prepare_stream,
    "uva": prepare_uva,
    "accelerate": prepare_accelerate,
}


def method_skip(b: Bench, method: str) -> str | None:
    """Why a method cannot run here, or None."""
    if method == "uva" and b.device.type != "cuda":
        return "uva needs a CUDA device (kernels read pinned host memory in place)"
    if method == "accelerate" and importlib.util.find_spec("accelerate") is None:
        return "accelerate is not installed"
    return None


def run_method(b: Bench, method: str) -> None:
    """Prepare, run every phase, undo; results go into b.doc (written after each phase)."""
    log(f"== {method}")
    result = b.doc["results"][method] = {}
    reason = method_skip(b, method)
    if reason:
        result["skipped"] = reason
        log(f"{method}: skipped ({reason})")
        return
    free_memory(b.device)
    try:
        setup, undo = PREPARE[method](b)
    except Exception as exc:
        result["error"] = first_line(exc)
        log(f"{method}: setup failed: {result['error']}")
        return
    result["setup"] = setup
    log(f"{method} setup: {json.dumps(setup, default=str)}")
    write_json(b)
    compiled = compile_forward(b.model)
    for phase in b.args.phases:
        result[phase] = {}
        try:
            run_phase(b, method, phase, compiled, setup["link_bytes"], result[phase])
        except Exception as exc:
            result[phase]["error"] = first_line(exc)
            log(f"{method} {phase}: failed: {result[phase]['error']}")
        write_json(b)
    del compiled
    free_memory(b.device)  # drop graphs and compiled code before the weights move back
    try:
        result["teardown"] = undo()
    except Exception as exc:
        result["teardown"] = {"error": first_line(exc)}
    free_memory(b.device)
    write_json(b)


# --- output -----------------------------------------------------------------------------------------
def write_json(b: Bench) -> None:
    """Overwrite the output file with everything measured so far."""
    tmp = b.args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(b.doc, f, indent=2, default=str)
    os.replace(tmp, b.args.out)


def fmt(value: float | None, digits: int) -> str:
    """A number for the table, '-' for None."""
    return "-" if value is None else f"{value:.{digits}f}"


def table(doc: dict) -> str:
    """The results as a compact markdown table."""
    lines = [
        "| method | phase | mode | median ms | link bound ms | ratio | exact |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for method, result in doc["results"].items():
        if "skipped" in result or "error" in result:
            lines.append(f"| {method} | - | - | {result.get('skipped') or result.get('error')} | | | |")
            continue
        for phase in PHASES:
            for mode, e in result.get(phase, {}).items():
                if mode == "error":
                    lines.append(f"| {method} | {phase} | - | error: {e[:80]} | | | |")
                if not isinstance(e, dict) or "skipped" in e:
                    continue
                if "error" in e:
                    lines.append(f"| {method} | {phase} | {mode} | error: {e['error'][:80]} | | | |")
                    continue
                exact = "ref" if method == "resident" else e.get("exact")
                lines.append(
                    f"| {method} | {phase} | {mode} | {e['median_ms']:.2f} "
                    f"| {fmt(e.get('link_bound_ms'), 1)} | {fmt(e.get('ratio'), 2)} | {exact} |"
                )
    return "\n".join(lines)


# --- main -------------------------------------------------------------------------------------------
def parse_list(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    """Split a comma list and check every item is allowed; keeps the canonical order of `allowed`."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"{what}: {bad or text!r} not in {','.join(allowed)}")
    return [x for x in allowed if x in items]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; see the module docstring and benchmarks/README.md."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3-8b")
    p.add_argument("--methods", default=",".join(METHODS), type=lambda s: parse_list(s, METHODS, "--methods"))
    p.add_argument("--phases", default=",".join(PHASES), type=lambda s: parse_list(s, PHASES, "--phases"))
    p.add_argument("--modes", default=",".join(MODES), type=lambda s: parse_list(s, MODES, "--modes"))
    p.add_argument("--prefill-tokens", type=int, default=2048, help="tokens of the prefill forward")
    p.add_argument("--prefill-graph", action="store_true", help="also time a CUDA graph of the prefill")
    p.add_argument("--reps", type=int, default=20, help="timed repetitions per measurement")
    p.add_argument(
        "--slow-reps", type=int, default=3, help=f"repetitions for accelerate and for calls > {SLOW_CALL_S} s"
    )
    p.add_argument(
        "--emulate-precision-casts",
        action="store_true",
        help="set torch._inductor.config.emulate_precision_casts for every compile (see README)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/core_<shape>.json)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("CUDA is not available: use --device cpu --shape tiny for a smoke test")
    if args.device == "cpu" and args.shape != "tiny":
        p.error("--device cpu is a correctness smoke test: use --shape tiny")
    args.out = args.out or f"benchmarks/results/core_{args.shape}.json"
    return args


def header(args: argparse.Namespace, model: nn.Module, bandwidth: float | None) -> dict:
    """The JSON document before any result."""
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    if importlib.util.find_spec("accelerate") is not None:
        import accelerate

        versions["accelerate"] = accelerate.__version__
    cpu = platform.processor() or platform.machine()
    return {
        "command": "PYTHONPATH=src python3 " + shlex.join(sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else f"none (cpu {cpu})",
        **versions,
        "weightstream": ws.__version__,
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "h2d_bandwidth_GBps": bandwidth,
        "inductor_emulate_precision_casts": args.emulate_precision_casts,
        "shape": shape_record(model, args.shape),
        "weight_bytes": weight_bytes(model),
        "results": {},
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if os.path.exists(args.out):
        log(f"note: overwriting {args.out}")
    configure_compile(args.emulate_precision_casts)
    bandwidth = h2d_bandwidth(device) if device.type == "cuda" else None
    log(f"host->GPU pinned bandwidth: {fmt(bandwidth, 1)} GB/s")
    model = build_model(args.shape, device, args.seed)
    inputs = make_inputs(model.config.vocab_size, args.prefill_tokens, device, args.seed)
    b = Bench(args, device, model, inputs, header(args, model, bandwidth), bandwidth)
    log(f"model {args.shape}: {b.doc['weight_bytes'] / 1e9:.2f} GB of weights on {device}")
    write_json(b)
    for method in args.methods:
        run_method(b, method)
    print("\n" + table(b.doc), flush=True)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
