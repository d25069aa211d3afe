"""Load a checkpoint straight into its offloaded places, then decode from the host tier and the disk tier.

A thin script over the bench package (its model shapes, timing, comparison and result schema). Writes a
checkpoint of a bench shape with random bf16 weights (save_pretrained, 5 GB shards) to --dir, then:
1. `ws.from_pretrained(dir, gpu_memory=...)`: load time and GB/s, peak GPU memory during the load
   (the full model must never be on the GPU): row `ws-from_pretrained`;
2. its one-token forward (eager, timed like every bench row) with every streamed group in pinned
   host memory, exact against the model before saving;
3. the same with `cpu_memory` = half the streamed bytes: the rest is read from the safetensors files
   every forward (the disk tier), first forward after dropping the page cache when allowed (its wall
   time is the row's `first_call_s`), then steady state, with the achieved disk->GPU GB/s: row
   `ws-from_pretrained-disk`.
Run: PYTHONPATH=src python3 benchmarks/bench_load.py --out benchmarks/results/load_llama-3-8b.json
CPU smoke: PYTHONPATH=src python3 benchmarks/bench_load.py --device cpu --shape tiny --no-drop-page-cache \
    --dir /tmp/ws-tiny-ckpt --gpu-memory 200KB --out /tmp/load_tiny.json
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

import weightstream as ws
from weightstream.bench.measure import compare_outputs, fill_row, h2d_bandwidth, measure
from weightstream.bench.progress import log
from weightstream.bench.runner import header
from weightstream.bench.schema import ResultRow, write_json
from weightstream.bench.shapes import SHAPES, build_model
from weightstream.sizes import parse_size


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


def tier_row(method: str, model, ids, reference, budget: int, reps: int, device, bandwidth, setup: dict):
    """Time the loaded model's one-token forward and compare it with the reference: one result row."""
    stats = ws.handle_of(model).stats
    row = ResultRow(method, "decode-b1", budget, "eager", tokens=1, link_bytes=stats.streamed_bytes,
                    reference="resident eager", setup={**setup, "stats": asdict(stats)})
    entry, out = measure(lambda: model(ids, use_cache=False).logits, reps, device)
    fill_row(row, entry, bandwidth)
    row.exact, row.max_abs_diff = compare_outputs(out, reference)
    log(f"{method}: {row.median_ms:.1f} ms (link bound {row.link_bound_ms}), exact {row.exact}; {stats}")
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dir", default="/tmp/weightstream-ckpt")
    p.add_argument("--gpu-memory", default="4GiB")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-drop-page-cache", action="store_true", help="leave the page cache alone")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = torch.device(args.device)
    cuda, drop = device.type == "cuda", not args.no_drop_page_cache
    bandwidth = h2d_bandwidth(device) if cuda else None
    folder = Path(args.dir)
    shutil.rmtree(folder, ignore_errors=True)
    model = build_model(args.shape, device, seed=0)
    ids = torch.randint(0, model.config.vocab_size, (1, 1), device=device)
    with torch.no_grad():
        reference = model(ids, use_cache=False).logits.cpu().clone()
    doc = header(args.shape, device, model, bandwidth, "PYTHONPATH=src python3 " + shlex.join(sys.argv))
    start = time.perf_counter()
    model.save_pretrained(folder, max_shard_size="5GB")
    common = {"save_s": time.perf_counter() - start,
              "checkpoint_bytes": sum(f.stat().st_size for f in folder.glob("*.safetensors"))}
    del model
    if cuda:
        torch.cuda.empty_cache()
    log(f"saved {common['checkpoint_bytes'] / 1e9:.2f} GB in {common['save_s']:.1f} s")
    budget = parse_size(args.gpu_memory)
    doc.update(budgets=[budget], phases=["decode-b1"], reference="resident (before saving)",
               build_note="saved, then loaded by ws.from_pretrained")

    common["page_cache_dropped"] = drop_page_cache(drop)
    base = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model = ws.from_pretrained(folder, gpu_memory=args.gpu_memory, device=device, progress=False)
    load_s = time.perf_counter() - start
    host = {**common, "load_s": load_s, "load_GBps": common["checkpoint_bytes"] / load_s / 1e9,
            "peak_gpu_bytes_during_load": torch.cuda.max_memory_allocated() - base if cuda else None}
    doc["results"].append(asdict(tier_row("ws-from_pretrained", model, ids, reference, budget, args.reps,
                                          device, bandwidth, host)))
    streamed = ws.handle_of(model).stats.streamed_bytes
    ws.handle_of(model).restore("cpu")
    del model
    if cuda:
        torch.cuda.empty_cache()

    cpu_memory = streamed // 2
    start = time.perf_counter()
    model = ws.from_pretrained(folder, gpu_memory=args.gpu_memory, cpu_memory=cpu_memory, device=device,
                               progress=False)
    disk = {"cpu_memory": cpu_memory, "load_s": time.perf_counter() - start,
            "page_cache_dropped_before_first_forward": drop_page_cache(drop)}
    row = tier_row("ws-from_pretrained-disk", model, ids, reference, budget, args.reps, device, bandwidth,
                   disk)
    disk_bytes = ws.handle_of(model).stats.disk_bytes
    row.setup["disk_to_gpu_GBps_steady"] = disk_bytes / (row.median_ms / 1e3) / 1e9
    row.setup["disk_to_gpu_GBps_first"] = disk_bytes / row.first_call_s / 1e9
    doc["results"].append(asdict(row))
    write_json(doc, args.out)
    shutil.rmtree(folder, ignore_errors=True)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
