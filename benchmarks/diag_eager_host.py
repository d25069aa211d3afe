"""Why an eager offloaded forward that no link bounds runs slower than the resident one (session 31, H100:
Llama-3-8B decode at 97% of its weights, eager 51-60 ms for every weightstream placement against 23.0 ms
resident eager and 13.5 ms for the same placement replayed from a CUDA graph;
benchmarks/results/h100_session31/suite_llama-3-8b_loop.json).

For the resident model and then the same model offloaded (`--strategy`, `--budget`), eager, back to back:
- host ms to enqueue one forward (perf_counter around the Python call, started on an idle device) and
  ms per forward back to back (CUDA events, as the bench times): where the host's enqueue time is
  well below the back-to-back time, the host is not what holds the forward up;
- under torch.profiler (CPU and CUDA activities) one forward's CUDA runtime calls that block the host
  (synchronizes, blocking copies), with counts and host ms, and the top CPU ops by self time: what the
  offloaded forward adds to the resident one;
- then (CUDA only, `launch_probe`) whether a host->GPU copy or zero-copy read in flight slows a chain of
  eagerly launched tiny kernels down.

    PYTHONPATH=src python3 benchmarks/diag_eager_host.py --shape llama-3-8b --budget 0.97 --out DIR
    (--device cpu runs the same on the CPU backend: a smoke test of this script, no CUDA figures)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from pathlib import Path

import torch

import weightstream as ws
from weightstream.bench.causal_lm import CAUSAL_LM
from weightstream.bench.phases import parse_phase
from weightstream.bench.shapes import build_model, get_shape, resolve_phase, shape_weight_bytes
from weightstream.placement.timing import time_calls

BLOCKING = ("Synchronize", "cudaMemcpy", "cuMemcpy", "cudaFree", "cudaMalloc", "cudaHostAlloc",
            "cudaHostRegister", "cudaHostUnregister")  # runtime calls that may block the host


def timed(forward, device: torch.device, reps: int) -> tuple[float, float]:
    """Median host ms to enqueue one forward (each call started on an idle device, so the host never
    waits for a full launch queue) and median ms per forward of `reps` called back to back
    (`weightstream.placement.timing.time_calls`, as the bench timed the 51-60 ms), after two warm-ups."""
    for _ in range(2):
        forward()
    host = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        forward()
        host.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(host), statistics.median(time_calls(forward, reps, device)[0])


def profiled(forward, device: torch.device, top: int) -> list[str]:
    """One forward under torch.profiler: blocking runtime calls and the top CPU ops by self time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        forward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = prof.events()
    blocking: Counter = Counter()
    blocking_ms: Counter = Counter()
    for e in events:
        if any(b in e.name for b in BLOCKING) and "Async" not in e.name:
            blocking[e.name] += 1
            blocking_ms[e.name] += (e.time_range.end - e.time_range.start) / 1e3
    lines = ["  blocking runtime calls: " + (", ".join(
        f"{name} x{n} ({blocking_ms[name]:.2f} ms)" for name, n in blocking.most_common()) or "none")]
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    lines += ["  " + line for line in table.splitlines()]
    return lines


def launch_probe(device: torch.device, kernels: int = 2000) -> list[str]:
    """Does a host->GPU copy in flight slow eager kernel launches down? `kernels` tiny dependent kernels
    enqueued one by one from Python (host-bound, as an eager decode is), timed on the GPU: alone, beside
    a large pinned host->GPU copy on a side stream, and beside a kernel reading pinned host memory in
    place (zero copy). Kernel launches are fetched by the GPU over the same link (one hypothesis for
    the eager slowdown: the fetches queue behind the copy's traffic)."""
    from weightstream.engine.uva import uva_view

    nbytes = 4 << 30
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    zero_copy = uva_view(host, device)
    x = torch.zeros(16, device=device)
    side = torch.cuda.Stream(device)

    def chain(queued: bool) -> tuple[float, float]:
        """Enqueue the kernels; queued: behind a ~40 ms sleep kernel, so the GPU runs them back to back
        from a full queue (the host ahead, as in a Flux step) instead of as the host launches them."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if queued:
            torch.cuda._sleep(cycles)
        start.record()
        t0 = time.perf_counter()
        y = x
        for _ in range(kernels):
            y = y + 1
        host_ms = (time.perf_counter() - t0) * 1e3
        end.record()
        end.synchronize()
        return host_ms, start.elapsed_time(end)

    # sleep cycles for about 40 ms (longer than the host takes to enqueue the chain); clock in kHz
    rate_khz = getattr(torch.cuda.get_device_properties(device), "clock_rate", 0) or 1_500_000
    cycles = int(rate_khz * 40)
    lines = []
    for queued in (False, True):
        how = "queued behind a sleep (GPU runs them back to back)" if queued else "launched live"
        for name in ("alone", "beside a 4 GiB pinned copy", "beside a 4 GiB zero-copy read"):
            runs = []
            for _ in range(3):
                torch.cuda.synchronize(device)
                if name != "alone":
                    with torch.cuda.stream(side):
                        if "copy" in name:
                            dst.copy_(host, non_blocking=True)
                        else:
                            dst.copy_(zero_copy)  # a device kernel reading host memory in place
                runs.append(chain(queued))
                torch.cuda.synchronize(device)
            host_ms, gpu_ms = sorted(runs, key=lambda r: r[1])[1]
            lines.append(f"C: {kernels} tiny kernels {how}, {name}: host {host_ms:.2f} ms to enqueue, "
                         f"GPU {gpu_ms:.2f} ms ({gpu_ms * 1e3 / kernels:.2f} us per kernel)")
    return lines


def build(shape_name: str, phase_name: str, device: torch.device, cache: bool = False):
    """(phase, model, forward): the bench shape's model with random weights on `device` and a
    zero-argument forward of it on the phase's input, under no_grad (also for ab_eager_ops.py).

    cache: a causal LM's forward gets a fresh, empty KV cache each call instead of the bench's
    `use_cache=False`. transformers then skips the packed-sequence check that a cache-less forward
    without an attention mask runs (`masking_utils.find_packed_sequence_indices`: a `.all()` that
    synchronizes the host with the GPU once per forward), as a generation's forwards do."""
    shape = get_shape(shape_name)
    phase = resolve_phase(shape, parse_phase(phase_name))
    model = build_model(shape_name, device)
    x = shape.model.inputs(model, [phase], device, seed=0)[phase.name]
    if cache and shape.model is not CAUSAL_LM:
        raise SystemExit(f"--cache is for a causal LM shape; {shape_name} is not one")

    def forward():
        with torch.no_grad():
            if cache:
                from transformers import DynamicCache

                return model(x, use_cache=True, past_key_values=DynamicCache()).logits
            return shape.model.forward(model, x)

    return phase, model, forward


def emit(lines: list[str], out: str | None, name: str) -> None:
    """Print the report and, with `out`, write it to out/name (also for ab_eager_ops.py and
    diag_launch_gaps.py)."""
    text = "\n".join(lines)
    print(text)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / name).write_text(text + "\n")


def arguments(doc: str, log: str) -> argparse.ArgumentParser:
    """The options this diagnosis shares with diag_host_sync.py: an offloaded bench shape's eager
    forward (shape, phase, budget as a fraction of its weight bytes, strategy), reps, device, and the
    folder for the report `log`."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--shape", default="llama-3-8b")
    parser.add_argument("--phase", default="decode-b1")
    parser.add_argument("--budget", type=float, default=0.97, help="fraction of the weight bytes")
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None, help=f"folder for {log} (else stdout only)")
    parser.add_argument("--cache", action="store_true",
                        help="a causal LM's forward with a fresh KV cache (no host synchronization in "
                             "transformers' mask code) instead of the bench's use_cache=False")
    return parser


def offload(model, phase, args: argparse.Namespace, device: torch.device):
    """`model` offloaded as `arguments`' options say (budget as a fraction of the shape's weight bytes,
    strategy), planned for the phase's tokens; returns the handle."""
    return ws.offload(model, gpu_memory=int(args.budget * shape_weight_bytes(args.shape)), device=device,
                      strategy=args.strategy, tokens=phase.batch * phase.seq)


def header(script: str, args: argparse.Namespace, device: torch.device) -> str:
    """A report's first line: the script, the options `arguments` gave it, the device and torch."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return (f"# {Path(script).name} --shape {args.shape} --phase {args.phase} --budget {args.budget} "
            f"--strategy {args.strategy}{' --cache' if args.cache else ''} on {name}, "
            f"torch {torch.__version__}")


def main() -> int:
    parser = arguments(__doc__, "diag_eager_host.log")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()

    device = torch.device(args.device)
    phase, model, forward = build(args.shape, args.phase, device, args.cache)
    lines = [header(__file__, args, device)]

    def measure(label: str) -> None:
        host, loop = timed(forward, device, args.reps)
        lines.append(f"{label}: host {host:.2f} ms to enqueue, {loop:.2f} ms back to back "
                     f"(medians of {args.reps})")
        lines.extend(profiled(forward, device, args.top))

    measure("resident")
    handle = offload(model, phase, args, device)
    stats = handle.stats
    predicted = "-" if stats.predicted_ms is None else f"{stats.predicted_ms:.2f}"
    lines.append(f"offloaded: {stats.placement_kind}, {stats.groups} groups, {stats.slots} slots, "
                 f"{stats.uva_bytes / 2**20:.0f} MiB zero copy, predicted {predicted} ms in a loop")
    measure("offloaded")
    if device.type == "cuda":
        handle.restore()
        del model, handle
        torch.cuda.empty_cache()
        lines += launch_probe(device)
    emit(lines, args.out, "diag_eager_host.log")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
