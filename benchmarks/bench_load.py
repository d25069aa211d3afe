"""Load a checkpoint straight into its offloaded places, then decode from the host tier and the disk tier.

Writes a Llama checkpoint with random bf16 weights (save_pretrained, 5 GB shards) to --dir, then:
1. `ws.from_pretrained(dir, gpu_memory=...)`: load time and GB/s, peak GPU memory during the load
   (the full model must never be on the GPU);
2. one-token forward (eager, CUDA events, median) with every streamed group in pinned host memory;
3. the same with `cpu_memory` = half the streamed bytes: the rest is read from the safetensors files
   every forward (the disk tier), first forward after dropping the page cache when allowed, then steady
   state (files in the page cache), with the achieved disk->GPU bytes/s.
Run: PYTHONPATH=src python3 benchmarks/bench_load.py --out benchmarks/results/load_llama-3-8b.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from bench_core import SHAPES, build_model, h2d_bandwidth

import weightstream as ws


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def drop_page_cache() -> bool:
    """Ask the kernel to drop clean page-cache pages (root only); True when it worked."""
    subprocess.run(["sync"], check=False)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def forward_ms(model, ids: torch.Tensor, reps: int) -> tuple[list[float], float]:
    """CUDA-event times in ms of `reps` one-token forwards, after one warm-up; and the first call's ms."""
    times = []
    with torch.no_grad():
        for _ in range(reps + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model(ids, use_cache=False)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    return times[1:], times[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3-8b")
    p.add_argument("--dir", default="/tmp/weightstream-ckpt")
    p.add_argument("--gpu-memory", default="4GiB")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = torch.device("cuda")
    doc: dict = {"command": "PYTHONPATH=src python3 " + " ".join(sys.argv),
                 "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "h2d_bandwidth_GBps": h2d_bandwidth(device)}
    folder = Path(args.dir)
    shutil.rmtree(folder, ignore_errors=True)
    model = build_model(args.shape, device, seed=0)
    ids = torch.randint(0, model.config.vocab_size, (1, 1), device=device)
    with torch.no_grad():
        reference = model(ids, use_cache=False).logits.clone()
    start = time.perf_counter()
    model.save_pretrained(folder, max_shard_size="5GB")
    doc["save_s"] = time.perf_counter() - start
    doc["checkpoint_bytes"] = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    del model
    torch.cuda.empty_cache()
    log(f"saved {doc['checkpoint_bytes'] / 1e9:.2f} GB in {doc['save_s']:.1f} s")

    doc["page_cache_dropped"] = drop_page_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model = ws.from_pretrained(folder, gpu_memory=args.gpu_memory, progress=False)
    load_s = time.perf_counter() - start
    stats = ws.handle_of(model).stats
    doc["host_tier"] = {"load_s": load_s, "load_GBps": doc["checkpoint_bytes"] / load_s / 1e9,
                        "peak_gpu_bytes_during_load": torch.cuda.max_memory_allocated() - base,
                        "stats": stats.__dict__}
    log(f"loaded in {load_s:.1f} s ({doc['host_tier']['load_GBps']:.2f} GB/s), peak GPU "
        f"{doc['host_tier']['peak_gpu_bytes_during_load'] / 1e9:.2f} GB; {stats}")
    with torch.no_grad():
        doc["host_tier"]["exact"] = torch.equal(model(ids, use_cache=False).logits, reference)
    times, first = forward_ms(model, ids, args.reps)
    doc["host_tier"]["decode_ms_median"] = statistics.median(times)
    doc["host_tier"]["link_bound_ms"] = stats.streamed_bytes / doc["h2d_bandwidth_GBps"] / 1e6
    log(f"host tier decode {statistics.median(times):.1f} ms "
        f"(link bound {doc['host_tier']['link_bound_ms']:.1f})")
    ws.handle_of(model).restore("cpu")
    del model
    torch.cuda.empty_cache()

    cpu_memory = stats.streamed_bytes // 2
    start = time.perf_counter()
    model = ws.from_pretrained(folder, gpu_memory=args.gpu_memory, cpu_memory=cpu_memory, progress=False)
    stats = ws.handle_of(model).stats
    disk = {"cpu_memory": cpu_memory, "load_s": time.perf_counter() - start, "stats": stats.__dict__}
    disk["page_cache_dropped_before_first_forward"] = drop_page_cache()
    times, first = forward_ms(model, ids, args.reps)
    disk["first_forward_ms"] = first
    disk["decode_ms_median"] = statistics.median(times)
    disk["disk_to_gpu_GBps_steady"] = stats.disk_bytes / (statistics.median(times) / 1e3) / 1e9
    disk["disk_to_gpu_GBps_first"] = stats.disk_bytes / (first / 1e3) / 1e9
    with torch.no_grad():
        disk["exact"] = torch.equal(model(ids, use_cache=False).logits, reference)
    doc["disk_tier"] = disk
    log(f"disk tier: {stats}; first forward {first:.0f} ms, steady {disk['decode_ms_median']:.0f} ms, "
        f"disk->GPU {disk['disk_to_gpu_GBps_steady']:.2f} GB/s steady, exact {disk['exact']}")
    Path(args.out).write_text(json.dumps(doc, indent=1, default=str))
    shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps({k: v for k, v in doc.items() if k != "command"}, indent=1, default=str))


if __name__ == "__main__":
    main()
