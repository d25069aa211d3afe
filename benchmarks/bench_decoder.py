"""The GPU decoder alone: decoded GB/s of one group of Hugging Face-initialized weights (bf16 and fp16)
for each number of warps per program, each output checked bit for bit against the pure-torch
reference decoder.

    PYTHONPATH=src python3 benchmarks/bench_decoder.py [--mib 256] [--warps 1,2,4,8]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from weightstream.placement.timing import time_calls
from weightstream.wire import codec
from weightstream.wire import triton_decoder as codec_triton


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="decoded MiB per call")
    parser.add_argument("--warps", default="1,2,4,8", help="warps per program, comma separated")
    parser.add_argument("--dtypes", default="bfloat16,float16")
    args = parser.parse_args()
    device = torch.device("cuda")
    nbytes = args.mib << 20
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; {args.mib} MiB (std 0.02)")
    saved = codec_triton._WARPS
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        weights = (torch.randn(nbytes // 2, device=device) * 0.02).to(dtype)
        enc = codec.encode_group([(weights, 0)], nbytes, device=device)
        blob = enc.blob.to(device)
        want = codec.decode_group(blob, torch.zeros(nbytes, dtype=torch.uint8, device=device))
        print(f"## {dtype}: ratio {enc.wire_bytes / nbytes:.4f}, {enc.chunks} chunks")
        for warps in (int(w) for w in args.warps.split(",")):
            codec_triton._WARPS = warps
            out = torch.zeros(nbytes, dtype=torch.uint8, device=device)
            for _ in range(3):
                codec_triton.decode(blob, out, enc.chunks)
            exact = torch.equal(out, want)
            def call(out=out, blob=blob, enc=enc):
                codec_triton.decode(blob, out, enc.chunks)

            times, _ = time_calls(call, 20, device, back_to_back=False)
            ms = statistics.median(times)
            print(f"warps {warps:2d}: {ms:.3f} ms, {nbytes / ms / 1e6:.0f} GB/s of decoded bytes, "
                  f"exact {exact}")
    codec_triton._WARPS = saved


if __name__ == "__main__":
    main()
