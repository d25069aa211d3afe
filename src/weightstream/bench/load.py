"""`weightstream bench --kind load`: load a checkpoint straight into its offloaded places, then run from
the host tier and from the disk tier (formerly `benchmarks/bench_load.py`).

Writes a checkpoint of a bench shape with random bf16 weights (`save_pretrained`, 5 GB shards) to
`--checkpoint-dir` (default: a temporary folder, removed afterwards), then for each budget:
1. `ws.from_pretrained(dir, gpu_memory=budget)`: load time and GB/s, peak GPU memory during the load
   (the whole model must never be on the GPU): row `ws-from_pretrained`;
2. its forward of each phase (eager, timed like every bench row) with every streamed group in pinned
   host memory, exact against the model before saving;
3. the same with `cpu_memory` = half the streamed bytes: the rest is read from the safetensors files
   every forward (the disk tier), the page cache dropped before the first forward when allowed (root;
   the first forward's wall time is the row's `first_call_s`), then steady state, with the disk->GPU
   GB/s in the setup: row `ws-from_pretrained-disk`.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..formats.hf import from_pretrained
from ..offload import handle_of
from .causal_lm import CAUSAL_LM, CausalLM
from .measure import compare_outputs, fill_row, h2d_bandwidth, measure
from .memory import release_memory
from .phases import parse_phase
from .progress import log
from .runner import header, resolve_budget
from .schema import ResultRow, write_json
from .shapes import build_model, get_shape, shape_weight_bytes

METHODS = ("ws-from_pretrained", "ws-from_pretrained-disk")


def drop_page_cache(allowed: bool) -> bool:
    """Ask the kernel to drop clean page-cache pages (root only); True when it worked."""
    if not allowed:
        return False
    subprocess.run(["sync"], check=False)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def tier_rows(method: str, model, inputs: dict, references: dict, phases, budget: int, reps: int, device,
              bandwidth, setup: dict) -> list[ResultRow]:
    """Time the loaded model's forward of each phase and compare it with the reference: one row each."""
    rows = []
    for phase in phases:
        stats = handle_of(model).stats
        row = ResultRow(method, phase.name, budget, "eager", tokens=phase.tokens,
                        link_bytes=stats.streamed_bytes, reference="resident eager",
                        setup={**setup, "stats": asdict(stats)})
        x = inputs[phase.name]
        entry, out = measure(lambda x=x: CAUSAL_LM.forward(model, x), reps, device)
        fill_row(row, entry, bandwidth)
        row.exact, row.max_abs_diff = compare_outputs(out, references[phase.name])
        log(f"{method} {phase.name}: {row.median_ms:.1f} ms (link bound {row.link_bound_ms}), exact "
            f"{row.exact}; {stats}")
        rows.append(row)
    return rows


def check_load(shape: str) -> None:
    """Raise ValueError when `--kind load` cannot run `shape` (a plain bf16 causal LM is needed: it is
    saved with save_pretrained and loaded back by from_pretrained)."""
    if type(get_shape(shape).model) is not CausalLM:
        raise ValueError(f"--kind load saves and loads a plain bf16 causal LM; --shape {shape} is not one "
                         "(e.g. --shape llama-3-8b, or tiny on the CPU)")


def run_load(shape: str, budgets: list, phases: list[str], reps: int, device: torch.device, out_path: str,
             *, checkpoint_dir: str | None = None, drop_cache: bool = True, seed: int = 0,
             command: str = "") -> dict:
    """The `--kind load` run (module docstring); writes and returns the result document."""
    check_load(shape)
    cuda = device.type == "cuda"
    bandwidth = h2d_bandwidth(device) if cuda else None
    weights = shape_weight_bytes(shape)
    budget_bytes = [resolve_budget(b, weights) for b in budgets]
    phase_list = [parse_phase(p) for p in phases]
    kind = CAUSAL_LM
    folder = Path(checkpoint_dir or tempfile.mkdtemp(prefix="weightstream-bench-load-"))
    shutil.rmtree(folder, ignore_errors=True)
    model = build_model(shape, device, seed)
    inputs = kind.inputs(model, phase_list, device, seed)
    with torch.no_grad():
        references = {p.name: kind.forward(model, inputs[p.name]).cpu().clone() for p in phase_list}
    doc = header(shape, device, model, bandwidth, command, kind="load")
    doc.update(budgets=budget_bytes, phases=[p.name for p in phase_list],
               reference="resident (before saving)", build_note="saved, then loaded by ws.from_pretrained")
    start = time.perf_counter()
    model.save_pretrained(folder, max_shard_size="5GB")
    common = {"save_s": time.perf_counter() - start,
              "checkpoint_bytes": sum(f.stat().st_size for f in folder.glob("*.safetensors"))}
    del model
    release_memory(device)
    log(f"saved {common['checkpoint_bytes'] / 1e9:.2f} GB in {common['save_s']:.1f} s to {folder}")
    try:
        for budget in budget_bytes:
            for row in load_and_time(folder, budget, common, inputs, references, phase_list, reps, device,
                                     bandwidth, drop_cache):
                doc["results"].append(asdict(row))
                write_json(doc, out_path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    write_json(doc, out_path)
    return doc


def load_and_time(folder: Path, budget: int, common: dict, inputs, references, phases, reps, device,
                  bandwidth, drop_cache: bool) -> list[ResultRow]:
    """The two tiers at one budget: the rows of `ws-from_pretrained` and `ws-from_pretrained-disk`."""
    cuda = device.type == "cuda"
    loaded = {**common, "page_cache_dropped": drop_page_cache(drop_cache)}
    base = torch.cuda.memory_allocated(device) if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    model = from_pretrained(folder, gpu_memory=budget, device=device, progress=False)
    load_s = time.perf_counter() - start
    loaded.update(load_s=load_s, load_GBps=common["checkpoint_bytes"] / load_s / 1e9,
                  peak_gpu_bytes_during_load=torch.cuda.max_memory_allocated(device) - base if cuda else None)
    rows = tier_rows(METHODS[0], model, inputs, references, phases, budget, reps, device, bandwidth, loaded)
    streamed = handle_of(model).stats.streamed_bytes
    handle_of(model).restore("cpu")
    del model
    release_memory(device)

    cpu_memory = streamed // 2
    start = time.perf_counter()
    model = from_pretrained(folder, gpu_memory=budget, cpu_memory=cpu_memory, device=device, progress=False)
    disk = {"cpu_memory": cpu_memory, "load_s": time.perf_counter() - start,
            "page_cache_dropped_before_first_forward": drop_page_cache(drop_cache)}
    disk_rows = tier_rows(METHODS[1], model, inputs, references, phases, budget, reps, device, bandwidth,
                          disk)
    disk_bytes = handle_of(model).stats.disk_bytes
    for row in disk_rows:
        row.setup["disk_to_gpu_GBps_steady"] = disk_bytes / (row.median_ms / 1e3) / 1e9
        row.setup["disk_to_gpu_GBps_first"] = disk_bytes / row.first_call_s / 1e9
    handle_of(model).restore("cpu")
    del model
    release_memory(device)
    return rows + disk_rows
