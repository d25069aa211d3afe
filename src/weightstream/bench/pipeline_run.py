"""`weightstream bench --kind pipeline`: a whole diffusers pipeline offloaded as a whole under one GPU
budget, against diffusers' own offloading of the same pipeline: one image generated end to end
(`--phases generate-N`: N denoising steps), timed and checked bit for bit against the resident pipeline
(formerly `benchmarks/bench_pipeline.py`).

Shapes (`flux_pipeline.py`): `flux-dev-pipeline` (FLUX.1-dev's published configs, random bf16 weights,
1024x1024, default `generate-28`) and `tiny-flux-pipeline` (16x16, default `generate-2`: a CPU run).
Methods (`--methods`, run in this order whatever the order given):

- `resident`: every weight on the GPU, the reference of every output (skipped where it does not fit);
- `ws-<strategy>[-raw or -compress]` (e.g. `ws-auto`, `ws-auto-raw`, `ws-stream-compress`):
  `ws.offload(pipe, gpu_memory=budget, strategy=..., compress=...)`, one budget for every model of the
  pipeline; `-raw` is compress=False, `-compress` True, neither "auto";
- `diffusers-group`: block-level group offloading (1 block a group, `use_stream=True`) of the
  transformer and both text encoders, each on the module holding its block list (as the suite's
  `diffusers-group`); the VAE resident;
- `diffusers-model_cpu_offload`: `pipe.enable_model_cpu_offload()`, each model moved whole to the GPU;
- `diffusers-sequential_cpu_offload`: `pipe.enable_sequential_cpu_offload()`, leaf by leaf, pageable;
- `ws-load[-cpu<size>]` (e.g. `ws-load-cpu16GiB`), run last: the pipeline saved once to a temp folder
  (`save_pretrained`), the built one then dropped, and `ws.from_pretrained(folder, gpu_memory=budget,
  cpu_memory=size)` loading it straight into place (no size: no cpu_memory limit); its setup records
  the load's seconds and the host memory it held at its peak (`host_peak_growth_bytes`: the highest
  resident set during the load above the one before it, sampled every 10 ms and read from Linux's
  VmHWM, reset before the load), each component's bytes on disk, and the generation is checked
  against the resident pipeline's like every method's.

Each method: a warm-up generation of a few steps (3; tiny: 1; learns the run order, warms the kernels),
then `--reps` timed generations (default 1), the wall clock of the whole `pipe(...)` call between two
device synchronizations (text encoding, denoising, VAE decode, postprocessing) and each step's ms from
CUDA events at each step's end (the host clock on a CPU). `--max-seconds` caps the run: a method is
not started with less than MIN_START_S left, a generation is interrupted at the deadline (the row is
then skipped, with the reason), and a method whose full generation would not fit is timed on a
warm-up-length generation and its time EXTRAPOLATED (that generation + the missing steps x its median
step; `setup.timing` = "extrapolated", exactness checked on those steps).

A row of the one schema per method and budget: median_ms = the generation's ms, tokens = steps x the
transformer's tokens per step (so tokens/s compares with a `denoise-b1` row's), exact = the final
latents and the image `torch.equal` to the resident pipeline's (same seed); setup: each step's ms, the
median step, warm-up ms, setup seconds, GPU memory held after setup, the weightstream placement of each
component and its predicted ms. `--predict` runs nothing: it prints the planner's predicted split of
the pipeline at each budget, raw / compressed / auto, with the H200 reference profile (formerly
`benchmarks/plan_flux_pipeline.py`; `--decode-gbps` replaces the profile's decode rate).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import re
import statistics
import time
from dataclasses import asdict

import torch

from ..sizes import format_size
from .flux_pipeline import PIPELINE_SHAPES, PROMPT, build_pipeline, configs, step_tokens
from .measure import h2d_bandwidth
from .memory import allocated, module_bytes
from .phases import parse_phase
from .progress import first_line, log
from .runner import base_header, resolve_budget
from .schema import ResultRow, write_json

MIN_START_S = 20.0  # no method starts with less time left of --max-seconds
PEERS = ("diffusers-group", "diffusers-model_cpu_offload", "diffusers-sequential_cpu_offload")
WS_RE = re.compile(r"ws-(auto|stream|uva)(-raw|-compress)?")
LOAD_RE = re.compile(r"ws-load(?:-cpu(\w+))?")  # ws-load-cpu16GiB: cpu_memory="16GiB"
METHODS = ("resident", *(f"ws-{s}{c}" for s in ("auto", "stream", "uva") for c in ("", "-raw", "-compress")),
           *PEERS, "ws-load", "ws-load-cpu<size>")
DEFAULT_METHODS = ("resident", "ws-auto", *PEERS)


def check_pipeline(shape: str, phases: list[str], methods: list[str]) -> None:
    """Raise ValueError naming what to change when `--kind pipeline` cannot run these."""
    if shape not in PIPELINE_SHAPES:
        raise ValueError(f"--kind pipeline runs a pipeline shape: --shape {' or '.join(PIPELINE_SHAPES)}")
    for name in phases:
        if parse_phase(name).kind != "generate":
            raise ValueError(f"--phases {name}: --kind pipeline times whole generations, generate-N (N "
                             "denoising steps)")
    bad = [m for m in methods if m not in METHODS[:-1] and not _load_method(m)]
    if bad or not methods:
        raise ValueError(f"--methods {','.join(bad or methods)}: --kind pipeline runs {', '.join(METHODS)}")


# -- methods: setup(pipe, budget, device) -> (info, undo) ------------------------------------------------

def setup_weightstream(pipe, budget: int, device: torch.device, strategy: str,
                       compress) -> tuple[dict, object]:
    from ..offload import offload

    handle = offload(pipe, gpu_memory=budget, device=device, strategy=strategy, compress=compress)
    stats = handle.stats.components
    info = {"stats": str(handle.stats), "strategy": strategy, "compress": compress,
            "components": {n: {"gpu_bytes": p.gpu_bytes, "resident_bytes": p.resident_bytes,
                               "offloaded_bytes": p.offloaded_bytes, "streamed_blocks": len(p.streamed),
                               "slots": p.n_slots, "kind": p.kind, "compressed": p.compressed,
                               "landing_bytes": p.landing_bytes, "landing_buffers": p.n_landing,
                               "wire_bytes": stats[n].wire_bytes, "wire_raw_bytes": stats[n].wire_raw_bytes}
                           for n, p in handle.placements.items()},
            "predicted_ms": handle.stats.predicted_ms}
    return info, lambda: handle.restore(device)


def setup_group(pipe, device: torch.device) -> tuple[dict, object]:
    from .methods.diffusers import group_prepare

    prepare = group_prepare("block_level")
    undos, infos = [], {}
    for name in ("text_encoder", "text_encoder_2", "transformer"):
        info, undo = prepare(getattr(pipe, name), None, 0, device)
        infos[name] = info.get("offloaded_module")
        undos.append(undo)
    pipe.vae.to(device)
    return {"offloaded_modules": infos}, lambda: [u() for u in undos]


def setup(name: str, pipe, budget: int | None, device: torch.device) -> tuple[dict, object]:
    """Apply method `name` to the pipeline; (what it reports, how to undo it)."""
    ws = WS_RE.fullmatch(name)
    if ws:
        compress = {None: "auto", "-raw": False, "-compress": True}[ws.group(2)]
        return setup_weightstream(pipe, budget, device, ws.group(1), compress)
    if name == "resident":
        pipe.to(device)
        return {}, lambda: None
    if name == "diffusers-group":
        return setup_group(pipe, device)
    if name == "diffusers-model_cpu_offload":
        pipe.enable_model_cpu_offload(device=device)
    else:
        pipe.enable_sequential_cpu_offload(device=device)
    return {}, pipe.remove_all_hooks


def _load_method(name: str) -> bool:
    """True for `ws-load` and `ws-load-cpu<size>` with a size `parse_size` reads."""
    from ..sizes import parse_size

    m = LOAD_RE.fullmatch(name)
    if m is None:
        return False
    try:
        return m.group(1) is None or parse_size(m.group(1)) > 0
    except ValueError:
        return False


class HostPeak:
    """The highest resident set size of this process (bytes) while inside, above the one on entering:
    VmRSS sampled every `every_s` seconds by a thread, and Linux's VmHWM (the kernel's own peak, reset on
    entering through /proc/self/clear_refs where that is allowed). `before`, `peak`, `growth` in bytes;
    `exact` tells whether VmHWM could be reset (else the peak is the sampled one)."""

    def __init__(self, every_s: float = 0.01) -> None:
        self.every_s = every_s
        self.before = self.peak = self.growth = 0
        self.exact = False

    @staticmethod
    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    def __enter__(self) -> HostPeak:
        import threading

        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM starts again from the current resident set
            self.exact = True
        except OSError:
            self.exact = False
        self.before = self.peak = self.status("VmRSS:")
        self._stop = threading.Event()

        def sample():
            while not self._stop.wait(self.every_s):
                self.peak = max(self.peak, self.status("VmRSS:"))

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.status("VmRSS:"))
        if self.exact:
            self.peak = max(self.peak, self.status("VmHWM:"))
        self.growth = self.peak - self.before


def _trim_heap() -> None:
    """Give freed heap memory back to the system (glibc's malloc_trim; nothing elsewhere)."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def setup_load(run: Run, name: str, budget: int) -> tuple[dict, object]:
    """`ws-load[-cpu<size>]`: the pipeline saved (once per run) and dropped, then loaded into place by
    `from_pretrained` with the host memory sampled; `run.pipe` becomes the loaded pipeline."""
    import shutil
    import tempfile

    from ..formats.hf import from_pretrained
    from ..sizes import parse_size

    cpu = LOAD_RE.fullmatch(name).group(1)
    cpu_memory = None if cpu is None else parse_size(cpu)
    info: dict = {"cpu_memory_bytes": cpu_memory}
    if run.folder is None:
        t0 = time.perf_counter()
        run.folder = tempfile.mkdtemp(prefix="weightstream-bench-pipeline-")
        run.pipe.save_pretrained(run.folder)
        info["save_s"] = time.perf_counter() - t0
        log(f"[{name}] saved the pipeline to {run.folder} in {info['save_s']:.1f} s")
        run.cleanup.append(lambda: shutil.rmtree(run.folder, ignore_errors=True))
    if not run.loaded:
        run.pipe.to("meta")  # the built pipeline's weights dropped: only the loaded one holds any
    run.pipe = None  # a pipeline an earlier load gave is dropped whole (its engines with it)
    release(run.device)
    _trim_heap()  # what the save and the dropped pipeline freed goes back to the system: the peak
    # below then counts the load's own memory, not memory it reused from them
    t0 = time.perf_counter()
    with HostPeak() as host:
        handle = from_pretrained(run.folder, gpu_memory=budget, cpu_memory=cpu_memory, device=run.device,
                                 progress=False)
    info.update(load_s=time.perf_counter() - t0, host_before_bytes=host.before, host_peak_bytes=host.peak,
                host_peak_growth_bytes=host.growth, host_peak_from="VmHWM" if host.exact else "sampled",
                stats=str(handle.stats),
                components={n: {"gpu_bytes": p.gpu_bytes, "streamed_blocks": len(p.streamed),
                                "compressed": p.compressed, "disk_bytes": s.disk_bytes,
                                "disk_wire_bytes": s.disk_wire_bytes, "pinned_bytes": s.pinned_bytes}
                            for (n, p), s in zip(handle.placements.items(), handle.stats.components.values(),
                                                 strict=True)},
                predicted_ms=handle.stats.predicted_ms)
    log(f"[{name}] loaded in {info['load_s']:.1f} s; host memory peak {fmt_size(host.peak)}, "
        f"{fmt_size(host.growth)} above the {fmt_size(host.before)} before the load"
        f"{'' if cpu_memory is None else f' (cpu_memory {fmt_size(cpu_memory)})'}")
    handle.pipe.set_progress_bar_config(disable=True)
    run.pipe, run.loaded = handle.pipe, True
    return info, lambda: None  # the loaded pipeline is dropped with the next load or the run's end


# -- one generation ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class Run:
    """What one run of the pipeline kind works with."""

    pipe: object
    device: torch.device
    tiny: bool
    size: int
    t5_tokens: int
    seed: int
    deadline: float  # perf_counter seconds
    warmup_steps: int
    reps: int
    folder: str | None = None  # where ws-load saved the pipeline
    loaded: bool = False  # run.pipe is one a ws-load loaded (the built one is gone)
    cleanup: list = dataclasses.field(default_factory=list)


def generate(run: Run, steps: int) -> dict:
    """One generation of `steps` steps: image and final latents (on the CPU), total wall ms, each step's
    ms after the first (CUDA events; the host clock on a CPU) and the steps run (fewer when the
    deadline passed and the pipeline was interrupted)."""
    cuda = run.device.type == "cuda"
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
        if time.perf_counter() > run.deadline:
            pipe._interrupt = True  # FluxPipeline skips the remaining steps
        return kwargs

    sync(run.device)
    t0 = time.perf_counter()
    out = run.pipe(PROMPT, height=run.size, width=run.size, num_inference_steps=steps, guidance_scale=3.5,
                   max_sequence_length=run.t5_tokens, output_type="pt",
                   generator=torch.Generator().manual_seed(run.seed), callback_on_step_end=on_step_end)
    sync(run.device)
    total = (time.perf_counter() - t0) * 1e3
    pairs = list(zip(marks, marks[1:], strict=False))
    step_ms = [a.elapsed_time(b) for a, b in pairs] if cuda else [(b - a) * 1e3 for a, b in pairs]
    latents = final.get("latents")
    return {"image": out.images.detach().cpu(), "latents": None if latents is None else latents.cpu(),
            "total_ms": total, "step_ms": step_ms, "steps_run": len(marks)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def timed(run: Run, row: ResultRow, steps: int, refs: dict) -> None:
    """Warm up, time `run.reps` generations of `steps` steps (or extrapolate one), fill `row`."""
    s = row.setup
    warm = generate(run, run.warmup_steps)
    s["warmup_ms"] = warm["total_ms"]
    log(f"[{row.method}] warm-up ({run.warmup_steps} steps): {warm['total_ms']:.0f} ms")
    if warm["steps_run"] < run.warmup_steps:
        row.skipped = (f"interrupted at the --max-seconds deadline after {warm['steps_run']} of "
                       f"{run.warmup_steps} warm-up steps ({warm['total_ms'] / 1e3:.0f} s)")
        return
    per_step = statistics.median(warm["step_ms"]) if warm["step_ms"] else warm["total_ms"] / run.warmup_steps
    estimate = (warm["total_ms"] + (steps - run.warmup_steps) * per_step) / 1e3
    left = run.deadline - time.perf_counter()
    timed_steps = steps if estimate <= left else run.warmup_steps
    if timed_steps != steps and warm["total_ms"] / 1e3 > left:
        row.skipped = (f"a {steps}-step generation needs ~{estimate:.0f} s and even a {timed_steps}-step one "
                       f"~{warm['total_ms'] / 1e3:.0f} s; {left:.0f} s were left")
        return
    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(run.device)
    gens = []
    while len(gens) < (run.reps if timed_steps == steps else 1):
        if gens and time.perf_counter() + gens[-1]["total_ms"] / 1e3 > run.deadline:
            break  # the next one would not finish: keep what was timed
        gens.append(generate(run, timed_steps))
        if gens[-1]["steps_run"] < timed_steps:
            row.skipped = (f"interrupted at the --max-seconds deadline after {gens[-1]['steps_run']} of "
                           f"{timed_steps} timed steps")
            return
    got = gens[-1]
    totals = [g["total_ms"] for g in gens]
    median_step = statistics.median(got["step_ms"]) if got["step_ms"] else None
    s.update(steps=steps, steps_timed=timed_steps, step_ms=got["step_ms"], median_step_ms=median_step,
             timing="measured" if timed_steps == steps else "extrapolated")
    if timed_steps != steps:
        missing = (steps - timed_steps) * (median_step or got["total_ms"] / timed_steps)
        totals = [got["total_ms"] + missing]
        s["extrapolation"] = (f"a measured {timed_steps}-step generation ({got['total_ms']:.0f} ms) + "
                              f"{steps - timed_steps} x its median step; a full one was estimated at "
                              f"{estimate:.0f} s with {left:.0f} s left")
    row.median_ms, row.min_ms, row.max_ms = statistics.median(totals), min(totals), max(totals)
    row.reps, row.first_call_s = len(gens), warm["total_ms"] / 1e3
    row.tokens_per_s = row.tokens / (row.median_ms / 1e3)
    cuda = run.device.type == "cuda"
    row.peak_allocated_bytes = torch.cuda.max_memory_allocated(run.device) if cuda else None
    if row.method == "resident":
        refs[timed_steps] = got
        refs.setdefault(run.warmup_steps, warm)
        row.reference = "self"
    elif timed_steps in refs:
        ref = refs[timed_steps]
        s.update(exact_steps=timed_steps, exact_latents=same(got["latents"], ref["latents"]),
                 exact_image=same(got["image"], ref["image"]),
                 exact_warmup=same(warm["image"], refs[run.warmup_steps]["image"]))
        row.exact = bool(s["exact_latents"] and s["exact_image"])
        row.reference = "resident eager"
    else:
        row.reference = "none (no resident generation of these steps)"


def run_method(run: Run, name: str, budget: int | None, phase, refs: dict) -> ResultRow:
    """Set the method up, warm up, time (or extrapolate), check, undo: one row."""
    steps = phase.seq
    tokens = steps * step_tokens(run.pipe, run.size, run.tiny)
    row = ResultRow(name, phase.name, budget, "eager", tokens=tokens)
    left = run.deadline - time.perf_counter()
    if left < MIN_START_S:
        row.skipped = f"not started: {left:.0f} s left of --max-seconds (a start needs {MIN_START_S:.0f} s)"
        return row
    t0 = time.perf_counter()
    try:
        info, undo = (setup_load(run, name, budget) if _load_method(name)
                      else setup(name, run.pipe, budget, run.device))
    except Exception as exc:
        row.error = f"setup: {first_line(exc)}"
        if run.pipe is not None:
            run.pipe.to(run.device)  # best effort: where the next method expects the pipeline
        release(run.device)
        return row
    release(run.device)
    row.setup = {**info, "setup_s": time.perf_counter() - t0,
                 "allocated_after_setup_bytes": allocated(run.device)}
    log(f"[{name}] setup {row.setup['setup_s']:.1f} s; GPU allocated "
        f"{fmt_size(row.setup['allocated_after_setup_bytes'])}")
    try:
        timed(run, row, steps, refs)
    except Exception as exc:  # a peer that breaks is recorded, the run goes on
        row = ResultRow(name, phase.name, budget, "eager", tokens=tokens, error=first_line(exc),
                        setup=row.setup)
    finally:
        undo()  # every method's undo leaves the pipeline on the device, where it was built
        release(run.device)
    return row


def fmt_size(n) -> str:
    return "-" if n is None else format_size(n)


def describe(row: ResultRow) -> str:
    """One progress line for a pipeline row."""
    if row.median_ms is None:
        return f"[{row.method}] {row.error or 'skipped: ' + str(row.skipped)}"
    s = row.setup
    extra = " (extrapolated)" if s.get("timing") == "extrapolated" else ""
    exact = "ref" if row.reference == "self" else row.exact
    return (f"[{row.method}] {row.median_ms / 1e3:.2f} s{extra} for {s['steps']} steps; median step "
            f"{s['median_step_ms'] or 0:.1f} ms; peak GPU {fmt_size(row.peak_allocated_bytes)}; "
            f"exact {exact}")


def run_pipeline(shape: str, budgets: list, phases: list[str], methods: list[str], reps: int,
                 device: torch.device, out_path: str, *, max_seconds: float | None = None, seed: int = 0,
                 command: str = "") -> dict:
    """The `--kind pipeline` run (module docstring); writes the document after every row, returns it."""
    start = time.perf_counter()
    check_pipeline(shape, phases, methods)
    tiny, size, _ = PIPELINE_SHAPES[shape]
    bandwidth = h2d_bandwidth(device) if device.type == "cuda" else None
    log(f"host->GPU pinned bandwidth: {'-' if bandwidth is None else f'{bandwidth:.1f}'} GB/s")
    pipe = build_pipeline(tiny, seed, device)
    pipe.set_progress_bar_config(disable=True)
    modules = {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    weights = {n: module_bytes(m) for n, m in modules.items()}
    total = sum(weights.values())
    budget_bytes = [resolve_budget(b, total) for b in budgets]
    log(f"{shape} built on {device} in {time.perf_counter() - start:.1f} s: {fmt_size(total)} of weights "
        f"({', '.join(f'{n} {fmt_size(b)}' for n, b in weights.items())})")
    record = {"name": shape, "image_size": size, "t5_tokens": configs(tiny)["t5_tokens"], "prompt": PROMPT,
              "component_bytes": weights, "dtype": "bfloat16"}
    doc = base_header(device, bandwidth, command, "pipeline", record, total, str(device))
    doc.update(budgets=budget_bytes, phases=list(phases), reference="resident", build_note="",
               max_seconds=max_seconds, method_seconds=None)
    run = Run(pipe, device, tiny, size, configs(tiny)["t5_tokens"], seed,
              start + (max_seconds if max_seconds is not None else math.inf), 1 if tiny else 3, reps)
    gpu_total = torch.cuda.mem_get_info(device)[1] if device.type == "cuda" else None
    write_json(doc, out_path)
    for phase in (parse_phase(p) for p in phases):
        refs: dict = {}
        run.warmup_steps = min(run.warmup_steps, phase.seq)
        ordered = [m for m in METHODS if m in methods and not _load_method(m)] + [
            m for m in methods if _load_method(m)]
        for name in ordered:  # the loads last: the first drops the built pipeline
            for budget in budget_bytes if name.startswith("ws-") else [None]:
                if name == "resident" and gpu_total is not None and total > 0.8 * gpu_total:
                    row = ResultRow(name, phase.name, None, "eager",
                                    skipped="the pipeline does not fit the GPU")
                elif name.startswith("diffusers-") and device.type != "cuda":
                    row = ResultRow(name, phase.name, None, "eager", skipped=f"{name} needs a CUDA device")
                elif run.pipe is None:
                    row = ResultRow(name, phase.name, budget, "eager",
                                    skipped="the pipeline was dropped by a load before it: run it alone")
                else:
                    row = run_method(run, name, budget, phase, refs)
                log(describe(row))
                doc["results"].append(asdict(row))
                write_json(doc, out_path)
    for clean in run.cleanup:
        clean()
    doc["wall_s"] = time.perf_counter() - start
    write_json(doc, out_path)
    return doc


# -- --predict: the planner's split, no weights --------------------------------------------------------------

def describe_placement(p) -> str:
    where = (f"{len(p.streamed)} streamed, {p.n_slots} slot(s)" if p.streamed else
             f"{len(p.uva)} zero copy" if p.uva else "resident")
    if p.streamed and p.uva:
        where += f", {len(p.uva)} zero copy"
    coded = (f", compressed ({p.n_landing} x {format_size(p.landing_bytes)} landing)" if p.compressed
             else "")
    return (f"{format_size(p.gpu_bytes)} ({where}{coded}); {p.prediction.again_ms:.1f} ms/call "
            f"({p.prediction.ms:.1f} the first)")


def predict(shape: str, budgets: list[str], steps: int, decode_gbps: float | None = None,
            command: str = "") -> str:
    """Markdown: the planner's predicted split of the pipeline (built on the meta device: no weights)
    at each budget, raw / compressed / "auto", with the H200 reference profile (`decode_gbps`: its decode
    rate replaced), then the transformer alone at one step's tokens per budget. Predicted, not measured."""
    from ..errors import BudgetError
    from ..pipeline import _resolve_calls, component_costs, modules_of, split_budget
    from ..placement.plan import plan
    from ..placement.probe import H200 as profile

    tiny, size, _ = PIPELINE_SHAPES[shape]
    if decode_gbps:
        profile = dataclasses.replace(profile, decode_s_per_byte=1 / (decode_gbps * 1e9))
    pipe = build_pipeline(tiny, device="meta")
    modules = modules_of(pipe)
    total = sum(module_bytes(m) for m in modules.values())
    calls, tokens = _resolve_calls(modules, steps, None, None)
    costs = {c: component_costs(modules, "cpu", allow_meta=True, compress=c) for c in (False, True)}
    names = list(modules)
    lines = [f"command: {command}",
             f"profile: {profile.gpu}, {profile.h2d_GBps:.1f} GB/s host->GPU, decode "
             f"{1e-9 / profile.decode_s_per_byte:.0f} GB/s; {steps} steps; predicted, not measured", "",
             "| budget | compress | predicted ms / generation | " + " | ".join(names) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in names) + " |"]
    for budget in budgets:
        for compress in (False, True, "auto"):
            try:
                plans = split_budget(costs[compress is not False], resolve_budget(budget, total), calls,
                                     tokens, profile, "auto", compress)
            except BudgetError as exc:
                lines.append(f"| {budget} | {compress} | does not fit: {exc} |" + " |" * len(names))
                continue
            total = sum(p.generation_ms for p in plans.values())
            lines.append(f"| {budget} | {compress} | {total:.0f} | "
                         + " | ".join(describe_placement(plans[n].placement) for n in names) + " |")
    per_step = step_tokens(pipe, size, tiny)
    lines += ["", f"The transformer alone, one denoising step of {per_step} tokens (the bench's "
              "`denoise-b1`):", "",
              "| budget | placement; predicted ms per step in a loop (the first) | resident compute |",
              "| --- | --- | --- |"]
    for budget in budgets:
        try:
            p = plan(costs[True]["transformer"], resolve_budget(budget, total), per_step, profile, "auto",
                     compress="auto")
        except BudgetError as exc:
            lines.append(f"| {budget} | does not fit: {exc} | |")
            continue
        lines.append(f"| {budget} | {describe_placement(p)} | {p.prediction.compute_ms:.1f} ms (model) |")
    return "\n".join(lines) + "\n"
