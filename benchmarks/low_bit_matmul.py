"""The self-draft's low-bit linear layers on a GPU: the matmul that reads the packed integers itself
(`speculative/matmul_kernel.py`) against dequantizing into a weight that cuBLAS then reads (the path it
replaces) and against the resident bfloat16 layer, for the linear layers of the Llama-3-8B and
Qwen2.5-32B shapes at 1, 4, 8 and 16 rows (a draft step's tokens); then a sweep of the kernel's
tiling (`UNROLL`, `PROGRAMS`, `WARPS`, `ACCUMULATOR`; none changes a bit of the result, which each
configuration checks) on two layers.

    python3 benchmarks/low_bit_matmul.py --out results.json

Each path is timed replayed from a CUDA graph of 10 calls (CUDA events, the median of `--reps` replays
after warm-up, divided by 10), as a draft step replays them; random weights quantized symmetric in
groups of 128 (as `SelfDraft` does by default). GB/s: the bytes the path must read (integers and scales, or
the bfloat16 weight) over its time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from weightstream.speculative import dequant_kernel, matmul_kernel  # noqa: E402
from weightstream.speculative.quantize import quantize  # noqa: E402

LAYERS = {  # (outputs, columns) of each linear layer of a block
    "llama-3-8b": {"q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (14336, 4096),
                   "down": (4096, 14336)},
    "qwen2.5-32b": {"q/o": (5120, 5120), "k/v": (1024, 5120), "gate/up": (27648, 5120),
                    "down": (5120, 27648)},
}
GROUP = 128


def timed(reps: int, call, *args, calls: int = 10) -> float:
    """Median ms of one `call(*args)` replayed from a CUDA graph of `calls` calls (as a draft step runs:
    no launch costs, which eager back-to-back calls of a layer this fast mostly measure), over `reps`
    replays after warm-up."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiled, loaded and warm before capture
        for _ in range(3):
            call(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call(*args)
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times)


def dequantized_linear(x, values, scales, bits, columns):
    """The path the low-bit matmul replaces: dequantize into a bfloat16 weight, then cuBLAS."""
    return torch.nn.functional.linear(x, dequant_kernel.dequantize(values, scales, bits, columns, x.dtype))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    doc = {"command": "python3 benchmarks/low_bit_matmul.py " + " ".join(sys.argv[1:]),
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "group": GROUP,
           "timing": "CUDA graph of 10 calls, per call", "rows": []}
    for (shape, layers), bits, rows in itertools.product(LAYERS.items(), (4, 8), (1, 4, 8, 16)):
        for name, (outputs, columns) in layers.items():
            weight = torch.randn(outputs, columns, device="cuda", generator=gen).to(torch.bfloat16) * 0.02
            values, scales = quantize(weight, bits, GROUP)
            x = torch.randn(rows, columns, device="cuda", generator=gen).to(torch.bfloat16)
            low = values.numel() * values.element_size() + scales.numel() * 4
            stored = (x, values, scales, bits, columns)
            ms = {"resident": timed(args.reps, torch.nn.functional.linear, x, weight),
                  "dequantize+matmul": timed(args.reps, dequantized_linear, *stored),
                  "low-bit matmul": timed(args.reps, matmul_kernel.low_bit_linear, *stored, None)}
            row = {"shape": shape, "layer": name, "outputs": outputs, "columns": columns, "bits": bits,
                   "rows": rows, "ms": ms, "low_bit_bytes": low, "bf16_bytes": weight.numel() * 2,
                   "low_bit_matmul_GBps": low / ms["low-bit matmul"] / 1e6,
                   "resident_GBps": weight.numel() * 2 / ms["resident"] / 1e6}
            doc["rows"].append(row)
            print(f"{shape} {name:7} int{bits} rows {rows:2}: resident {ms['resident']:.4f} ms, "
                  f"dequantize+matmul {ms['dequantize+matmul']:.4f} ms, "
                  f"low-bit matmul {ms['low-bit matmul']:.4f} ms "
                  f"({row['low_bit_matmul_GBps']:.0f} GB/s)", flush=True)
            Path(args.out).write_text(json.dumps(doc, indent=1))
    knobs = ("UNROLL", "PROGRAMS", "WARPS", "ACCUMULATOR")
    sweep, default = [], [getattr(matmul_kernel, k) for k in knobs]
    configs = [(u, p, w, 4096) for w in (2, 4) for u in (1, 2, 4) for p in (512, 2048)] + [(2, 1024, 2, 2048)]
    for (outputs, columns), rows in itertools.product([(14336, 4096), (4096, 14336)], (1, 4)):
        weight = torch.randn(outputs, columns, device="cuda", generator=gen) * 0.02
        values, scales = quantize(weight, 4, GROUP)
        x = torch.randn(rows, columns, device="cuda", generator=gen).to(torch.bfloat16)
        want = matmul_kernel.low_bit_linear(x, values, scales, 4, columns, None)
        for config in configs:
            for knob, value in zip(knobs, config, strict=True):
                setattr(matmul_kernel, knob, value)
            ms = timed(args.reps, matmul_kernel.low_bit_linear, x, values, scales, 4, columns, None)
            got = matmul_kernel.low_bit_linear(x, values, scales, 4, columns, None)
            same = torch.equal(got.view(torch.int16), want.view(torch.int16))  # the tiling changes no bit
            sweep.append({"outputs": outputs, "columns": columns, "rows": rows, "ms": ms, "same_bits": same,
                          **dict(zip((k.lower() for k in knobs), config, strict=True))})
            print(f"sweep {outputs}x{columns} rows {rows} {config}: {ms:.4f} ms, same bits {same}")
        doc["sweep"] = sweep
        Path(args.out).write_text(json.dumps(doc, indent=1))
    for knob, value in zip(knobs, default, strict=True):
        setattr(matmul_kernel, knob, value)


if __name__ == "__main__":
    main()
