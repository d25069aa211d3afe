"""What widens the gaps between kernels in an offloaded step (session 32's open question).

In the eager Flux.1-dev step at 12 GiB on the H200 (`benchmarks/results/h200_session32/`), the median
gap between consecutive compute kernels is 1.6 us in the resident step, 2.7 us in the offloaded step
while the link idles and 5.1 us while a copy is in flight: about 12 ms of a 197 ms step. The host is
ahead of the GPU there (it enqueues a step in 131 ms of the 196), so the GPU runs the kernels from a
full queue. The launch probe of `diag_eager_host.py` found one large pinned copy beside a chain of
tiny queued kernels costs them only 0.35-0.64 us each. What else the offloaded step has on its other
streams: many copies (8 per group), each after a wait on an event of the compute stream, and decode
kernels that wait the same way. This script times a chain of Flux-sized compute kernels (a 4608-token
GEMM and three elementwise kernels, repeated), queued behind a sleep kernel so that the GPU runs them
back to back, with each kind of side-stream activity in turn:

- alone;
- beside one 4 GiB pinned host->GPU copy;
- beside the same bytes as 512 copies of 8 MiB (many commands);
- beside a side stream blocked on an event the compute stream records after the chain (a pending
  wait and nothing else);
- beside the offloaded step's pattern: every `--every` kernels the compute stream records an event,
  and the side stream waits for it and then copies `--copy-mib` (64 MiB, about 1.2 ms of link time
  against about 1.7 ms of chain: copies interleaved with waits, the link busy most of the time);
- the same pattern with a tiny kernel instead of each copy (waits without link traffic).

Each line gives the chain's GPU ms (median of `--reps`) and the extra us per kernel over `alone`.

    PYTHONPATH=src python3 benchmarks/diag_launch_gaps.py [--out DIR]     (CUDA only, about 30 s)
"""

from __future__ import annotations

import argparse
import statistics

import torch
from diag_eager_host import emit  # the script's folder is on sys.path

MiB = 1 << 20


def profiled(run_once, kinds) -> list[str]:
    """One run of each of `kinds` under torch.profiler: where the chain's extra time goes, the kernels
    themselves (GEMMs and the rest) or the gaps between them."""
    import statistics as st

    from torch.profiler import ProfilerActivity, profile

    from weightstream.bench.timeline import timeline_events

    lines = []
    for kind in kinds:
        # CPU activities too: some builds report GPU activities only alongside them
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run_once(kind)
        compute = sorted((s, e, name) for row, name, s, e in timeline_events(prof.events())
                         if row == "compute" and not any(w in name.lower() for w in ("sleep", "spin")))
        gemm = sum(e - s for s, e, name in compute if "elementwise" not in name)  # the rest: mul, add, silu
        other = sum(e - s for s, e, _ in compute) - gemm
        gaps = [(b[0] - a[1]) * 1e3 for a, b in zip(compute, compute[1:], strict=False) if b[0] >= a[1]]
        small = [g for g in gaps if g <= 50]
        median = st.median(small) if small else 0.0
        lines.append(f"profiled, {kind}: {len(compute)} kernels, GEMMs {gemm:.3f} ms, "
                     f"the rest {other:.3f} ms, gaps under 50 us: {len(small)}, median {median:.2f} us, "
                     f"sum {sum(small) / 1e3:.3f} ms")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=150, help="GEMM + 3 elementwise kernels each")
    parser.add_argument("--tokens", type=int, default=4608)
    parser.add_argument("--width", type=int, default=3072)
    parser.add_argument("--every", type=int, default=40, help="kernels between the side stream's waits")
    parser.add_argument("--copy-mib", type=int, default=64, help="the copy after each wait (MiB)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--profile", action="store_true",
                        help="also profile the chain alone and beside one 4 GiB copy: kernel time (GEMMs, "
                             "the rest) against the gaps between kernels")
    parser.add_argument("--out", default=None, help="folder for diag_launch_gaps.log")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("diag_launch_gaps.py needs a CUDA device")
    device = torch.device("cuda")
    side = torch.cuda.Stream(device)

    total = 4 << 30
    host = torch.empty(total, dtype=torch.uint8).pin_memory()
    dst = torch.empty(total, dtype=torch.uint8, device=device)
    chunk = 8 * MiB
    x = torch.randn(args.tokens, args.width, device=device, dtype=torch.bfloat16)
    w = torch.randn(args.width, args.width, device=device, dtype=torch.bfloat16) * 0.02
    tiny = torch.zeros(16, device=device)
    kernels = 4 * args.blocks
    rate_khz = getattr(torch.cuda.get_device_properties(device), "clock_rate", 0) or 1_500_000

    def chain(events: list[torch.cuda.Event] | None) -> torch.Tensor:
        """The compute chain on the current stream; records events[i] after every `every` kernels."""
        y, n = x, 0
        for _ in range(args.blocks):
            for op in ("mm", "mul", "add", "silu"):
                if op == "mm":
                    y = y @ w
                elif op == "mul":
                    y = y * 0.5
                elif op == "add":
                    y = y + x
                else:
                    y = torch.nn.functional.silu(y)
                n += 1
                if events is not None and n % args.every == 0 and n // args.every <= len(events):
                    events[n // args.every - 1].record()
        return y

    def side_work(kind: str, events: list[torch.cuda.Event], after: torch.cuda.Event,
                  go: torch.cuda.Event) -> None:
        """Enqueue `kind` on the side stream, starting when the chain does (`go`)."""
        if kind == "alone":
            return
        with torch.cuda.stream(side):
            side.wait_event(go)
            if kind == "one 4 GiB pinned copy":
                dst.copy_(host, non_blocking=True)
            elif kind == "512 pinned copies of 8 MiB":
                for i in range(total // chunk):
                    dst[i * chunk:(i + 1) * chunk].copy_(host[i * chunk:(i + 1) * chunk], non_blocking=True)
            elif kind == "a pending wait (nothing else)":
                side.wait_event(after)
            elif kind.startswith("wait, then copy"):
                step = args.copy_mib * MiB
                for i, ev in enumerate(events):
                    side.wait_event(ev)
                    dst[i * step:(i + 1) * step].copy_(host[i * step:(i + 1) * step], non_blocking=True)
            elif kind.startswith("wait, then a tiny kernel"):
                for ev in events:
                    side.wait_event(ev)
                    tiny.add_(1)

    def run(kind: str, reps: int | None = None) -> float:
        times = []
        for _ in range(reps or args.reps):
            torch.cuda.synchronize(device)
            events = [torch.cuda.Event() for _ in range(kernels // args.every)]
            after = torch.cuda.Event()
            torch.cuda._sleep(int(rate_khz * 60))  # ~60 ms: the host enqueues everything meanwhile
            go = torch.cuda.Event()
            go.record()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            side_work(kind, events, after, go)  # starts with the chain, at `go`
            start.record()
            chain(events if kind.startswith("wait") else None)
            end.record()
            after.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    kinds = ["alone", "one 4 GiB pinned copy", "512 pinned copies of 8 MiB", "a pending wait (nothing else)",
             f"wait, then copy {args.copy_mib} MiB, every {args.every} kernels",
             f"wait, then a tiny kernel, every {args.every} kernels"]
    run("alone")  # warm-up (cuBLAS handles, kernel loads)
    lines = [f"# diag_launch_gaps.py on {torch.cuda.get_device_name(device)}, torch {torch.__version__}: "
             f"{args.blocks} x (GEMM {args.tokens}x{args.width}x{args.width} + mul + add + silu) = {kernels} "
             f"kernels queued behind a sleep, medians of {args.reps}"]
    base = None
    for kind in kinds:
        ms = run(kind)
        base = ms if base is None else base
        extra = (ms - base) * 1e3 / kernels
        lines.append(f"{kind:45s}: {ms:8.3f} ms, {extra:+6.2f} us per kernel over alone")
    if args.profile:
        lines += profiled(run_once=lambda kind: run(kind, reps=1),
                          kinds=("alone", "one 4 GiB pinned copy"))
    emit(lines, args.out, "diag_launch_gaps.log")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
