"""How fast routed experts cross the link by each way there is to move them, per expert shape.

For each shape's fused expert tensors (random bytes in pinned host memory, a few experts routed):
- `copy engine`: one cudaMemcpyAsync per routed expert row (what the link gives a copy);
- `gather`: the expert cache's gather kernel (engine/expert_gather.py) reading the routed rows in place
  into a device work buffer, as shipped and at other block sizes and warp counts;
- `in place [out, in]` and `in place [in, out]`: a one-token matmul reading each routed expert's weight
  in place from pinned host memory, laid out as DeepSeek and Qwen3 store experts (x @ W.T, W [out, in])
  and as GPT-OSS does (x @ W, W [in, out]).
Each timed with CUDA events after warm-up, median of the reps; GB/s counts the routed bytes once.

Usage (repository root, CUDA): PYTHONPATH=src python3 benchmarks/probe_expert_gather.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl

from weightstream.engine import expert_gather
from weightstream.engine.uva import uva_view

# name: (experts, routed per token, each fused tensor's [rows, cols] per expert in bf16)
SHAPES = {
    "gpt-oss-20b": (32, 4, [(2880, 5760), (2880, 2880)]),
    "deepseek-v2-lite": (64, 6, [(2816, 2048), (2048, 1408)]),
    "qwen3-30b-a3b": (128, 8, [(1536, 2048), (2048, 768)]),
}


@triton.jit
def _gather_routed(dst, src, routed, row_words, chunks, BLOCK: tl.constexpr):
    """A program per (routed expert, chunk): no programs for experts not routed."""
    p = tl.program_id(0)
    e = tl.load(routed + p // chunks).to(tl.int64)
    offs = (p % chunks) * BLOCK + tl.arange(0, BLOCK)
    m = offs < row_words
    tl.store(dst + e * row_words + offs, tl.load(src + e * row_words + offs, mask=m), mask=m)


def timed(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def probe(name: str, reps: int) -> list[dict]:
    experts, k, tensors = SHAPES[name]
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    routed = torch.randperm(experts, generator=gen)[:k].sort().values
    dst_row = torch.full((experts,), -1, dtype=torch.int64)
    dst_row[routed] = routed
    rows = []
    for shape in tensors:
        record = probe_tensor(name, experts, routed, dst_row.to(dev), shape, reps)
        rows.append(record)
        print(json.dumps(record), flush=True)
    return rows


def probe_tensor(name: str, experts: int, routed: torch.Tensor, dst_row: torch.Tensor,
                 shape: tuple[int, int], reps: int) -> dict:
    dev = dst_row.device
    k, (rows_, cols) = routed.numel(), shape
    routed_dev, ids = routed.to(dev), routed.tolist()
    src_row = torch.arange(experts, device=dev)
    which = torch.ones(experts, dtype=torch.int8, device=dev)
    row_bytes = rows_ * cols * 2
    host = torch.empty(experts, row_bytes, dtype=torch.uint8, pin_memory=True)
    host.view(-1).copy_(torch.randint(0, 256, (experts * row_bytes,), dtype=torch.uint8, device=dev))
    view = uva_view(host.view(-1), dev).view(experts, row_bytes)
    work = torch.empty(experts, row_bytes, dtype=torch.uint8, device=dev)
    nbytes = k * row_bytes
    record = dict(shape=name, tensor=f"[{experts}, {rows_}, {cols}] bf16", routed=k, routed_bytes=nbytes)

    def rate(fn) -> dict:
        seconds = timed(fn, reps)
        return dict(ms=round(seconds * 1e3, 4), GBps=round(nbytes / seconds / 1e9, 2))

    def engine():
        for e in ids:
            work[e].copy_(host[e], non_blocking=True)

    record["copy engine"] = rate(engine)
    record["gather (shipped)"] = rate(
        lambda: expert_gather.copy_rows(work, work, view, dst_row, src_row, which))
    words, work64 = view.view(torch.int64), work.view(torch.int64)
    row_words = words.shape[1]
    for block in (1024, 2048, 4096, 8192):
        for warps in (4, 8, 16):
            grid = (experts, triton.cdiv(row_words, block))
            record[f"gather block {block} warps {warps}"] = rate(
                lambda g=grid, b=block, w=warps: expert_gather._copy_rows[g](
                    work64, words, words, dst_row, src_row, which, row_words, BLOCK=b, num_warps=w))
    for block in (2048, 8192):
        chunks = triton.cdiv(row_words, block)
        record[f"gather routed-only block {block} warps 8"] = rate(
            lambda c=chunks, b=block: _gather_routed[(k * c,)](work64, words, routed_dev, row_words, c,
                                                                BLOCK=b, num_warps=8))
    x_out = torch.randn(1, cols, dtype=torch.bfloat16, device=dev)  # x @ W.T, W [out=rows, in=cols]
    x_in = torch.randn(1, rows_, dtype=torch.bfloat16, device=dev)  # x @ W, W [in=rows, out=cols]
    weights = view.view(torch.bfloat16).view(experts, rows_, cols)
    resident = work.view(torch.bfloat16).view(experts, rows_, cols)
    record["in place [out, in]"] = rate(lambda: [x_out @ weights[e].t() for e in ids])
    record["in place [in, out]"] = rate(lambda: [x_in @ weights[e] for e in ids])
    record["resident [in, out]"] = rate(lambda: [x_in @ resident[e] for e in ids])
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    result = dict(gpu=props.name, torch=torch.__version__, triton=triton.__version__, reps=args.reps, rows=[])
    for name in args.shapes.split(","):
        result["rows"].extend(probe(name, args.reps))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "probe_expert_gather.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
