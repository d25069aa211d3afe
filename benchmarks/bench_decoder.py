"""The GPU decoder alone: decoded GB/s of one group of Hugging Face-initialized bf16 weights for each
number of warps per program, each output checked bit for bit against the pure-torch reference decoder.

    PYTHONPATH=src python3 benchmarks/bench_decoder.py [--mib 256] [--warps 2,4,8,16]   # a CUDA GPU
"""

from __future__ import annotations

import argparse
import statistics

import torch

from weightstream import codec, codec_triton
from weightstream.timing import time_calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="decoded MiB per call")
    parser.add_argument("--warps", default="2,4,8,16", help="warps per program, comma separated")
    args = parser.parse_args()
    device = torch.device("cuda")
    nbytes = args.mib << 20
    weights = (torch.randn(nbytes // 2, device=device) * 0.02).bfloat16()
    enc = codec.encode_group([(weights, 0)], nbytes, device=device)
    blob = enc.blob.to(device)
    want = codec.decode_group(blob, torch.zeros(nbytes, dtype=torch.uint8, device=device))
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; {args.mib} MiB of bf16 (std 0.02), "
          f"ratio {enc.wire_bytes / nbytes:.4f}, {enc.chunks} chunks")
    for warps in (int(w) for w in args.warps.split(",")):
        codec_triton._WARPS = warps
        out = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        for _ in range(3):
            codec_triton.decode(blob, out, enc.chunks)
        exact = torch.equal(out, want)
        times, _ = time_calls(lambda out=out: codec_triton.decode(blob, out, enc.chunks), 20, device)
        ms = statistics.median(times)
        print(f"warps {warps:2d}: {ms:.3f} ms, {nbytes / ms / 1e6:.0f} GB/s of decoded bytes, exact {exact}")
    codec_triton._WARPS = 4


if __name__ == "__main__":
    main()
