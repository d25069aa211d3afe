"""Where the host's time goes in an offloaded eager forward: each engine call timed on the host, the
arena's pinning as torch sees it, and torch's sync debug mode over one forward.

Session 33's question (`docs/planner.md`): on the H100 an eager Llama-3-8B decode offloaded at 97%
(6 groups through one slot) took 42.6 ms of host time to enqueue against 23.4 ms resident, with no
blocking runtime call in the profile. If an engine call blocked the host until the GPU caught up (a
copy from memory torch thinks pageable is synchronous), its host time here would be about the GPU's
copy and compute time before it, not tens of microseconds.

    PYTHONPATH=src python3 benchmarks/diag_host_sync.py --out $OUT
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections import defaultdict

import torch
from diag_eager_host import arguments, build, emit, header, offload  # the script's folder is on sys.path


def main() -> int:
    args = arguments(__doc__, "diag_host_sync.log").parse_args()
    device = torch.device(args.device)
    phase, model, forward = build(args.shape, args.phase, device, args.cache)
    handle = offload(model, phase, args, device)
    stats = handle.stats
    lines = [f"{header(__file__, args, device)}: {stats.placement_kind}, {stats.groups} groups, "
             f"{stats.slots} slots"]
    arena = handle._transfer.arena
    if stats.groups:
        lines.append(f"arena: {arena.nbytes / 2**20:.0f} MiB, pinned_bytes {arena.pinned_bytes}, "
                     f"region(0).is_pinned() {arena.region(0).is_pinned()}")

    spent: dict[str, list[float]] = defaultdict(list)
    for method in ("wait", "release"):
        inner = getattr(handle, method)

        def timed(group, _inner=inner, _name=method):
            t0 = time.perf_counter()
            _inner(group)
            spent[_name].append((time.perf_counter() - t0) * 1e3)
        setattr(handle, method, timed)  # ops find the engine by id and call its attributes

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(2):
        forward()
    host = []
    per_call = defaultdict(list)
    for _ in range(args.reps):
        sync()
        spent.clear()
        t0 = time.perf_counter()
        forward()
        host.append((time.perf_counter() - t0) * 1e3)
        for k, v in spent.items():
            per_call[k].append((sum(v), len(v), max(v)))
    lines.append(f"host ms to enqueue one forward from an idle GPU: median {statistics.median(host):.2f} "
                 f"(min {min(host):.2f}, max {max(host):.2f})")
    for k, runs in per_call.items():
        total = statistics.median(r[0] for r in runs)
        lines.append(f"  engine.{k}: {runs[0][1]} calls, median total {total:.3f} ms per forward, "
                     f"largest single call {max(r[2] for r in runs):.3f} ms")
    if device.type == "cuda":
        sync()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                forward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncing = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
        lines.append(f"sync debug mode over one forward: {len(syncing)} synchronizing calls"
                     + "".join(f"\n  {m}" for m in sorted(set(syncing))[:10]))
    handle.restore()
    emit(lines, args.out, "diag_host_sync.log")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
