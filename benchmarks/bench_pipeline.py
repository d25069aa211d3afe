"""A whole FLUX.1-dev pipeline (CLIP + T5-XXL text encoders, the 12B transformer, the VAE) offloaded as a
whole under one GPU budget by weightstream, against diffusers' own offloading of the same pipeline: one
28-step 1024x1024 generation timed end to end, checked bit for bit against the resident pipeline.

On one H200 (repository root; diffusers' wheel in .whl/; about 6-7 minutes, inside one 10-minute call):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && export PYTHONPATH=src:/tmp/site PYTHONUNBUFFERED=1
    python3 benchmarks/bench_pipeline.py --out $OUT --max-seconds 420

On a CPU (tiny configs, 2 steps, weightstream only; tests/test_bench_pipeline.py runs this):

    PYTHONPATH=src python3 benchmarks/bench_pipeline.py --tiny --peers none --out /tmp/pipe

The pipeline is `examples/flux_offload.py`'s: FLUX.1-dev's published configs with random bf16 weights
created on the GPU (nothing downloaded; the image is noise). Methods, in run order, each one
generation of `--warmup-steps` untimed (learns the run order, warms the kernels), then the timed one:

| method | what it does to the pipeline |
| --- | --- |
| `resident` | every weight on the GPU: the reference of every output (skipped where it does not fit) |
| `weightstream` | `ws.offload(pipe, gpu_memory=..., compress=...)`: one budget for all four models |
| `weightstream-raw` | the same with `compress=False` (with `--raw-too`) |
| `diffusers-group` | block-level group offloading (1 block a group, `use_stream=True`), see below |
| `diffusers-model_cpu_offload` | `pipe.enable_model_cpu_offload()`: each model moved whole to the GPU |
| `diffusers-sequential_cpu_offload` | `pipe.enable_sequential_cpu_offload()`: leaf by leaf, pageable |

`diffusers-group` applies `apply_group_offloading(offload_type="block_level", num_blocks_per_group=1,
use_stream=True)` to the transformer and both text encoders, each on the module holding its block list
(as `weightstream bench`'s `diffusers-group` does); the VAE stays resident.

Timing: the wall clock of the whole `pipe(...)` call between two device synchronizations (text encoding,
denoising, VAE decode, postprocessing), and each step's ms from CUDA events recorded at each step's
end. Time is capped by `--max-seconds` (from the script's start): a method is not started, or is
interrupted at its next step, when the deadline passes, and is recorded as skipped with the reason. A
method whose full timed generation would not fit is timed on a `--warmup-steps` generation and its
28-step time EXTRAPOLATED (that generation's total + the missing steps x its median step), marked
`"timing": "extrapolated"` in the JSON and "(extrapolated)" in the table; its exactness is then
checked on that many steps. Also recorded per method: the peak GPU memory of the timed generation
(`torch.cuda.max_memory_allocated`), the GPU memory held after setup, the setup seconds, and whether
the final latents and the image are `torch.equal` to the resident pipeline's (same seed). The host->GPU
link rate is measured once (`weightstream.bench.measure.h2d_bandwidth`, 1 GiB pinned copies).
Writes pipeline_<name>.json, .log and .md to `--out`.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

import weightstream as ws
from weightstream.bench.measure import h2d_bandwidth
from weightstream.bench.memory import allocated, module_bytes
from weightstream.bench.methods import version_of
from weightstream.placement.timing import sync

ROOT = Path(__file__).resolve().parent.parent
PEERS = ("diffusers-group", "diffusers-model_cpu_offload", "diffusers-sequential_cpu_offload")
PROMPT = "a photo of an astronaut riding a horse on the moon"


def example():
    """examples/flux_offload.py as a module: its configs, tokenizers and `build_pipeline`."""
    spec = importlib.util.spec_from_file_location("flux_offload", ROOT / "examples" / "flux_offload.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Log:
    """Print a line and append it to the run's log file."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "w")  # noqa: SIM115 (open for the whole run)

    def __call__(self, line: str) -> None:
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()


def generate(pipe, args, steps: int, device: torch.device, deadline: float) -> dict:
    """One generation of `steps` steps: image and final latents (on the CPU), total wall ms, each step's
    ms after the first (CUDA events; the host clock on a CPU) and the steps run (fewer when the
    deadline, seconds on perf_counter, passed and the pipeline was interrupted)."""
    cuda = device.type == "cuda"
    marks: list = []
    final: dict = {}

    def on_step_end(pipe, i, t, kwargs):
        if cuda:
            marks.append(torch.cuda.Event(enable_timing=True))
            marks[-1].record()
        else:
            marks.append(time.perf_counter())
        if i == steps - 1:
            final["latents"] = kwargs["latents"].clone()
        if time.perf_counter() > deadline:
            pipe._interrupt = True  # FluxPipeline skips the remaining steps
        return kwargs

    sync(device)
    t0 = time.perf_counter()
    out = pipe(PROMPT, height=args.size, width=args.size, num_inference_steps=steps, guidance_scale=3.5,
               max_sequence_length=args.t5_tokens, output_type="pt",
               generator=torch.Generator().manual_seed(args.seed), callback_on_step_end=on_step_end)
    sync(device)
    total = (time.perf_counter() - t0) * 1e3
    step_ms = ([a.elapsed_time(b) for a, b in zip(marks, marks[1:], strict=False)] if cuda
               else [(b - a) * 1e3 for a, b in zip(marks, marks[1:], strict=False)])
    latents = final.get("latents")
    return {"image": out.images.detach().cpu(), "latents": None if latents is None else latents.cpu(),
            "total_ms": total, "step_ms": step_ms, "steps_run": len(marks)}


# -- methods: setup(pipe, args, device) -> (info, undo) ------------------------------------------------

def setup_resident(pipe, args, device):
    pipe.to(device)
    return {}, lambda: None


def setup_weightstream(pipe, args, device, compress=None):
    compress = args.compress if compress is None else compress
    handle = ws.offload(pipe, gpu_memory=args.gpu_memory, device=device, strategy=args.strategy,
                        compress=compress)
    stats = handle.stats.components
    info = {"stats": str(handle.stats), "compress": compress,
            "components": {n: {"gpu_bytes": p.gpu_bytes, "resident_bytes": p.resident_bytes,
                               "offloaded_bytes": p.offloaded_bytes, "streamed_blocks": len(p.streamed),
                               "slots": p.n_slots, "kind": p.kind, "compressed": p.compressed,
                               "landing_bytes": p.landing_bytes, "landing_buffers": p.n_landing,
                               "wire_bytes": stats[n].wire_bytes, "wire_raw_bytes": stats[n].wire_raw_bytes}
                           for n, p in handle.placements.items()},
            "predicted_ms": handle.stats.predicted_ms}
    return info, lambda: handle.restore(device)


def setup_weightstream_raw(pipe, args, device):
    return setup_weightstream(pipe, args, device, compress=False)


def setup_group(pipe, args, device):
    from weightstream.bench.methods.diffusers import group_prepare

    prepare = group_prepare("block_level")
    undos, infos = [], {}
    for name in ("text_encoder", "text_encoder_2", "transformer"):
        info, undo = prepare(getattr(pipe, name), None, 0, device)
        infos[name] = info.get("offloaded_module")
        undos.append(undo)
    pipe.vae.to(device)
    return {"offloaded_modules": infos}, lambda: [u() for u in undos]


def setup_model_cpu_offload(pipe, args, device):
    pipe.enable_model_cpu_offload(device=device)
    return {}, pipe.remove_all_hooks


def setup_sequential(pipe, args, device):
    pipe.enable_sequential_cpu_offload(device=device)
    return {}, pipe.remove_all_hooks


SETUPS = {"resident": setup_resident, "weightstream": setup_weightstream,
          "weightstream-raw": setup_weightstream_raw, "diffusers-group": setup_group,
          "diffusers-model_cpu_offload": setup_model_cpu_offload,
          "diffusers-sequential_cpu_offload": setup_sequential}


def release(device: torch.device) -> None:
    """Free garbage, cached GPU blocks and cached pinned host blocks between methods."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        if hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()


def same(a, b) -> bool | None:
    return None if a is None or b is None else bool(torch.equal(a, b))


def run_method(name: str, pipe, args, device, deadline: float, refs: dict, log: Log) -> dict:
    """Set the method up, warm up, time one generation (or extrapolate), check it, undo it."""
    row: dict = {"method": name, "status": "ok"}
    left = deadline - time.perf_counter()
    if left < args.min_start_seconds:
        return {**row, "status": "skipped", "reason": f"not started: {left:.0f} s left of --max-seconds "
                f"{args.max_seconds:.0f} (a start needs {args.min_start_seconds:.0f} s)"}
    t0 = time.perf_counter()
    info, undo = SETUPS[name](pipe, args, device)
    release(device)
    row.update(setup_s=time.perf_counter() - t0, allocated_after_setup_bytes=allocated(device), setup=info)
    log(f"[{name}] setup {row['setup_s']:.1f} s; GPU allocated {fmt_gib(row['allocated_after_setup_bytes'])}")
    try:
        warm = generate(pipe, args, args.warmup_steps, device, deadline)
        row["warmup_ms"] = warm["total_ms"]
        log(f"[{name}] warm-up ({args.warmup_steps} steps): {warm['total_ms']:.0f} ms")
        if warm["steps_run"] < args.warmup_steps:
            return {**row, "status": "skipped", "reason": f"interrupted at the --max-seconds deadline "
                    f"after {warm['steps_run']} of {args.warmup_steps} warm-up steps "
                    f"({warm['total_ms'] / 1e3:.0f} s)"}
        per_step = (statistics.median(warm["step_ms"]) if warm["step_ms"]
                    else warm["total_ms"] / args.warmup_steps)
        estimate = (warm["total_ms"] + (args.steps - args.warmup_steps) * per_step) / 1e3
        left = deadline - time.perf_counter()
        steps = args.steps if estimate <= left else args.warmup_steps
        if steps != args.steps and warm["total_ms"] / 1e3 > left:
            return {**row, "status": "skipped", "reason": f"a {args.steps}-step generation needs "
                    f"~{estimate:.0f} s and even a {steps}-step one ~{warm['total_ms'] / 1e3:.0f} s; "
                    f"{left:.0f} s were left"}
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        got = generate(pipe, args, steps, device, deadline)
        row["peak_allocated_bytes"] = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
                                       else None)
        if got["steps_run"] < steps:
            return {**row, "status": "skipped", "reason": f"interrupted at the --max-seconds deadline after "
                    f"{got['steps_run']} of {steps} timed steps"}
        median = statistics.median(got["step_ms"]) if got["step_ms"] else None
        row.update(steps_timed=steps, measured_ms=got["total_ms"], median_step_ms=median,
                   step_ms=got["step_ms"])
        if steps == args.steps:
            row.update(timing="measured", total_ms=got["total_ms"])
        else:
            missing = (args.steps - steps) * (median or got["total_ms"] / steps)
            row.update(timing="extrapolated", total_ms=got["total_ms"] + missing,
                       extrapolation=f"a measured {steps}-step generation ({got['total_ms']:.0f} ms) + "
                       f"{args.steps - steps} x its median step; a full one was estimated at "
                       f"{estimate:.0f} s with {left:.0f} s left")
        ref = refs.get(steps)
        if name == "resident":
            refs[steps] = got
            refs[args.warmup_steps] = refs.get(args.warmup_steps, warm)
        elif ref is not None:
            row.update(exact_steps=steps, exact_latents=same(got["latents"], ref["latents"]),
                       exact_image=same(got["image"], ref["image"]))
            row["exact"] = bool(row["exact_latents"] and row["exact_image"])
            row["exact_warmup"] = same(warm["image"], refs[args.warmup_steps]["image"])
        log(f"[{name}] {row['timing']} {row['total_ms'] / 1e3:.2f} s for {args.steps} steps; median step "
            f"{fmt(median, 1)} ms; peak GPU {fmt_gib(row['peak_allocated_bytes'])}; exact "
            f"{row.get('exact', 'ref')}")
        return row
    finally:
        undo()
        release(device)


def fmt(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def fmt_gib(n) -> str:
    return "-" if n is None else ws.format_size(n)


def table(doc: dict) -> str:
    """The markdown table of a run's rows."""
    steps = doc["config"]["steps"]
    lines = [f"FLUX.1-dev pipeline ({doc['config']['name']}), {steps} steps at {doc['config']['size']}x"
             f"{doc['config']['size']}, budget {fmt_gib(doc['config']['budget_bytes'])} for weightstream; "
             f"{doc['gpu']}, host->GPU {fmt(doc['h2d_bandwidth_GBps'], 1)} GB/s; torch {doc['torch']}, "
             f"diffusers {doc['diffusers']}", "",
             f"| method | generation s ({steps} steps) | median step ms | peak GPU | GPU after setup | "
             "setup s | exact vs resident | note |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in doc["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['method']} | {r['status']} | - | - | - | - | - | {r.get('reason', '')} |")
            continue
        total = fmt(r["total_ms"] / 1e3) + (" (extrapolated)" if r["timing"] == "extrapolated" else "")
        exact = "ref" if r["method"] == "resident" else str(r.get("exact", "-"))
        if r.get("exact_steps") not in (None, steps):
            exact += f" (on {r['exact_steps']} steps)"
        lines.append(f"| {r['method']} | {total} | {fmt(r['median_step_ms'], 1)} | "
                     f"{fmt_gib(r['peak_allocated_bytes'])} | {fmt_gib(r['allocated_after_setup_bytes'])} | "
                     f"{r['setup_s']:.1f} | {exact} | {r.get('extrapolation', '')} |")
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny configs, 2 steps at 16x16 (a CPU run)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--gpu-memory", default=None,
                   help='weightstream budget (default "16GiB"; --tiny: half the pipeline\'s bytes)')
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 28; --tiny: 2)")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="steps of the warm-up generation (default 3; --tiny: 1); also the steps an "
                   "extrapolated method is timed on")
    p.add_argument("--size", type=int, default=None, help="image side (default 1024; --tiny: 16)")
    p.add_argument("--strategy", default="auto", help="weightstream's strategy: auto, stream or uva")
    p.add_argument("--compress", default="auto", choices=["auto", "true", "false"],
                   help="weightstream's compress= (default auto: compressed where predicted faster)")
    p.add_argument("--raw-too", action="store_true",
                   help="also run weightstream with compress=False (method weightstream-raw)")
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma list of {', '.join(PEERS)}, or none")
    p.add_argument("--max-seconds", type=float, default=420.0, help="wall budget of the whole run (s)")
    p.add_argument("--min-start-seconds", type=float, default=20.0,
                   help="no method starts with less left (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="folder for pipeline_<name>.json, .log and .md")
    args = p.parse_args(argv)
    args.steps = args.steps or (2 if args.tiny else 28)
    args.warmup_steps = min(args.warmup_steps or (1 if args.tiny else 3), args.steps)
    args.size = args.size or (16 if args.tiny else 1024)
    args.compress = {"auto": "auto", "true": True, "false": False}[args.compress]
    peers = [] if args.peers in ("", "none") else args.peers.split(",")
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        p.error(f"unknown peers {unknown}: choose from {', '.join(PEERS)}")
    args.peer_list = [m for m in PEERS if m in peers]
    return args


def main(argv: list[str] | None = None) -> int:
    start = time.perf_counter()
    args = parse(argv)
    deadline = start + args.max_seconds
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    name = "tiny" if args.tiny else "flux-dev"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / f"pipeline_{name}.log")
    command = shlex.join([sys.executable, *sys.argv] if argv is None else ["bench_pipeline.py", *argv])
    log(f"command: {command}")
    flux = example()
    args.t5_tokens = flux.configs(args.tiny)["t5_tokens"]
    bandwidth = h2d_bandwidth(device) if device.type == "cuda" else None
    log(f"host->GPU (pinned, 1 GiB copies): {fmt(bandwidth, 1)} GB/s")
    t0 = time.perf_counter()
    pipe = flux.build_pipeline(args.tiny, args.seed, device)
    pipe.set_progress_bar_config(disable=True)
    modules = {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    weights = {n: module_bytes(m) for n, m in modules.items()}
    total = sum(weights.values())
    args.gpu_memory = ws.parse_size(args.gpu_memory or (total // 2 if args.tiny else "16GiB"))
    log(f"built on {device} in {time.perf_counter() - t0:.1f} s: {fmt_gib(total)} of weights "
        f"({', '.join(f'{n} {fmt_gib(b)}' for n, b in weights.items())}); budget {fmt_gib(args.gpu_memory)}")
    methods = ["resident", "weightstream", *(["weightstream-raw"] if args.raw_too else []), *args.peer_list]
    rows, refs = [], {}
    for method in methods:
        gpu_total = torch.cuda.mem_get_info(device)[1] if device.type == "cuda" else None
        if method == "resident" and gpu_total is not None and total > 0.8 * gpu_total:
            rows.append({"method": method, "status": "skipped",
                         "reason": "the pipeline does not fit on the GPU"})
            continue
        if method.startswith("diffusers-") and device.type != "cuda":
            rows.append({"method": method, "status": "skipped", "reason": "needs CUDA"})
            continue
        try:
            rows.append(run_method(method, pipe, args, device, deadline, refs, log))
        except Exception as exc:  # a peer that breaks is recorded, the run goes on
            rows.append({"method": method, "status": "error", "reason": f"{type(exc).__name__}: {exc}"[:300]})
        if rows[-1]["status"] != "ok":
            log(f"[{method}] {rows[-1]['status']}: {rows[-1]['reason']}")
    doc = {"command": command, "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "diffusers": version_of("diffusers"),
           "transformers": version_of("transformers"), "accelerate": version_of("accelerate"),
           "h2d_bandwidth_GBps": bandwidth,
           "config": {"name": name, "steps": args.steps, "warmup_steps": args.warmup_steps, "size": args.size,
                      "budget_bytes": args.gpu_memory, "strategy": args.strategy,
                      "compress": args.compress, "seed": args.seed,
                      "max_seconds": args.max_seconds,
                      "prompt": PROMPT, "t5_tokens": args.t5_tokens},
           "weight_bytes": weights, "wall_s": time.perf_counter() - start, "rows": rows}
    (out / f"pipeline_{name}.json").write_text(json.dumps(doc, indent=1))
    md = table(doc)
    (out / f"pipeline_{name}.md").write_text(md)
    log(md)
    log.file.close()
    wrong = [r["method"] for r in rows if r["method"].startswith("weightstream") and r.get("exact") is False]
    return 1 if wrong else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
