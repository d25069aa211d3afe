"""Does a torch.profiler session slow every later eager forward of the process down?

Session 34's lead on the H100's slow eager decode at 97% (session 31: 51-60 ms offloaded against
23.0 ms resident; `docs/planner.md`): `diag_eager_host.py` profiles the resident forward before it
times the offloaded one, and every op of the offloaded forward then took 15-25% more host time, while
`diag_host_sync.py` (no profiler) timed the same offloaded forward at about the resident's host time.
The lead: kineto leaves CUPTI attached after a profiler session unless the environment variable
TEARDOWN_CUPTI is "1" (pytorch/pytorch#144455), and CUPTI's callbacks may then cost every later CUDA
runtime call host time; the suite's bench also profiles a timeline of the resident forward right after
timing it, before the methods after it. Session 34's H100 answer (`benchmarks/results/h100_session34/`,
docs/planner.md): before any profiler the offloaded forward ran within 5% of the resident one, after
it 6-8 ms slower, with or without TEARDOWN_CUPTI=1.

This times the resident and the offloaded eager forward (host ms to enqueue from an idle GPU, ms per
forward back to back; `diag_eager_host.timed`), runs one profiler session (CPU and CUDA activities),
and times both again in the same order. Run it with and without TEARDOWN_CUPTI=1 in the environment.

    PYTHONPATH=src python3 benchmarks/diag_profiler_residue.py --out $OUT
    TEARDOWN_CUPTI=1 PYTHONPATH=src python3 benchmarks/diag_profiler_residue.py --out $OUT/teardown
    (--device cpu: a smoke test of this script)
"""

from __future__ import annotations

import os

import torch
from diag_eager_host import arguments, build, emit, header, offload, timed  # its folder is on sys.path
from torch.profiler import ProfilerActivity, profile


def main() -> int:
    args = arguments(__doc__, "diag_profiler_residue.log").parse_args()
    device = torch.device(args.device)
    phase, model, forward = build(args.shape, args.phase, device, args.cache)
    teardown = os.environ.get("TEARDOWN_CUPTI", "(unset)")
    lines = [f"{header(__file__, args, device)}, TEARDOWN_CUPTI={teardown}"]

    def both(when: str) -> None:
        host, loop = timed(forward, device, args.reps)
        lines.append(f"{when}, resident: host {host:.2f} ms to enqueue, {loop:.2f} ms back to back")
        handle = offload(model, phase, args, device)
        host, loop = timed(forward, device, args.reps)
        stats = handle.stats
        lines.append(f"{when}, offloaded ({stats.placement_kind}, {stats.groups} groups): host {host:.2f} "
                     f"ms to enqueue, {loop:.2f} ms back to back")
        handle.restore()

    both("before any profiler")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities):
        forward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    both("after one profiler session")
    lines.append(f"(medians of {args.reps}; each measurement after two warm-up forwards)")
    emit(lines, args.out, "diag_profiler_residue.log")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
