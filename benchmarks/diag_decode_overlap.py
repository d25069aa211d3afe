"""Why a compressed group's decode waits for compute to go idle (Flux at 12 GiB, session 26): two probes.

A: can the decode kernel run beside GEMMs at all? A chain of bf16 GEMMs on the compute stream, one
   decode of 256 MiB on a side stream (normal and high priority) enqueued after the first GEMM:
   when does the decode end, relative to the chain's start and end, and how much longer is the chain?
B: is the host behind the GPU? Flux.1-dev blocks at full width (4096 + 512 tokens), every block
   streamed compressed through two slots; each wait and release of the engine records its host time
   and a CUDA event on the compute stream: host time minus GPU time per op (positive: the host issues
   the op after the GPU got there, so whatever it enqueues starts late).

    PYTHONPATH=src:tests python3 benchmarks/diag_decode_overlap.py --out DIR     # a CUDA GPU
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from weightstream.wire import codec
from weightstream.wire import triton_decoder as codec_triton


def probe_a(lines: list[str]) -> None:
    device = torch.device("cuda")
    a = torch.randn(4608, 3072, device=device, dtype=torch.bfloat16)
    w = torch.randn(3072, 12288, device=device, dtype=torch.bfloat16)
    nbytes = 256 << 20
    weights = (torch.randn(nbytes // 2, device=device) * 0.02).bfloat16()
    enc = codec.encode_group([(weights, 0)], nbytes, device)
    blob, out = enc.blob.to(device), torch.empty(nbytes, dtype=torch.uint8, device=device)
    for _ in range(3):
        a @ w
        codec_triton.decode(blob, out, enc.chunks)
    torch.cuda.synchronize()

    def chain(side: torch.cuda.Stream | None) -> tuple[float, float | None]:
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        ev[0].record()
        for i in range(40):
            a @ w
            if i == 0 and side is not None:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    codec_triton.decode(blob, out, enc.chunks)
                ev[2].record(side)
        ev[1].record()
        torch.cuda.synchronize()
        return ev[0].elapsed_time(ev[1]), ev[0].elapsed_time(ev[2]) if side is not None else None

    alone, _ = chain(None)
    lines.append(f"A: 40 GEMMs 4608x3072x12288 alone: {alone:.2f} ms; decode of 256 MiB alone "
                 f"{codec_triton.decode_seconds_per_byte(device) * nbytes * 1e3:.3f} ms")
    for priority in (0, -1):
        runs = [chain(torch.cuda.Stream(device, priority=priority)) for _ in range(5)]
        total, end = sorted(runs)[2]
        lines.append(f"A: priority {priority}: chain {total:.2f} ms (+{total - alone:.2f}), decode ended at "
                     f"{end:.2f} ms after the chain's start")


def probe_b(lines: list[str], singles: int) -> None:
    sys.path.insert(0, "benchmarks")
    from diag_flux_compile import offloaded

    from weightstream.bench.diffusion import FLUX_DEV, Diffusion
    from weightstream.bench.phases import Phase

    device = torch.device("cuda")
    fields = dict(FLUX_DEV, num_layers=2, num_single_layers=singles)
    kind = Diffusion(fields)
    model = kind.build(fields, device, seed=0)
    x = kind.inputs(model, [Phase("denoise-b1", 1, 4608)], device, seed=0)["denoise-b1"]
    handle = offloaded(model, device, compress=True)
    marks: list[tuple[str, float, torch.cuda.Event]] = []

    def timed(name, method):
        def call(group):
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            marks.append((f"{name} {group}", time.perf_counter(), ev))
            return method(group)
        return call

    handle.wait, handle.release = timed("wait", handle.wait), timed("release", handle.release)
    with torch.no_grad():
        for _ in range(3):
            kind.forward(model, x)
        torch.cuda.synchronize()
        marks.clear()
        start = torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        kind.forward(model, x)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        t_end = time.perf_counter()
        torch.cuda.synchronize()
    lines.append(f"B: {2 + singles} blocks streamed compressed through 2 slots; forward "
                 f"{start.elapsed_time(end):.2f} ms on the GPU, {1e3 * (t_end - t0):.2f} ms to enqueue "
                 "on the host")
    for name, host, ev in marks:
        gpu = start.elapsed_time(ev)
        lines.append(f"B: {name:12s} host {1e3 * (host - t0):8.2f} ms  gpu {gpu:8.2f} ms  host-gpu "
                     f"{1e3 * (host - t0) - gpu:+8.2f} ms")
    handle.restore()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--singles", type=int, default=8)
    args = parser.parse_args()
    lines = [f"# {' '.join(sys.argv)}", f"# {torch.cuda.get_device_name()}, torch {torch.__version__}"]
    probe_a(lines)
    probe_b(lines, args.singles)
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "diag_decode_overlap.log").write_text(text + "\n")


if __name__ == "__main__":
    main()
