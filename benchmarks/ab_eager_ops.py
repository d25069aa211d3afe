"""A/B of session 32's eager schedule calls: one offloaded model, eager, timed with the schedule called
straight (`ops.eager`, no copies) and through the custom ops with their copies of every tensor a block
takes and returns (`streamed.EAGER_DIRECT = False`, as before session 32), alternating A and B rounds
in one process so that both see the same placement, machine and clocks; each output checked with
`torch.equal` against the resident model's.

    PYTHONPATH=src:/tmp/site python3 benchmarks/ab_eager_ops.py --shape flux-dev-transformer \\
        --phase denoise-b1 --budget 12GiB [--rounds 3 --reps 5] [--out DIR]   (about 1 minute)
    (--device cpu: a smoke test of this script on the CPU backend; the shape tiny-flux fits there)
"""

from __future__ import annotations

import argparse
import statistics

import torch
from diag_eager_host import build, emit  # the script's folder is on sys.path

import weightstream as ws
from weightstream.bench.runner import resolve_budget
from weightstream.bench.shapes import shape_weight_bytes
from weightstream.engine import streamed
from weightstream.placement.timing import time_calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="flux-dev-transformer")
    parser.add_argument("--phase", default="denoise-b1")
    parser.add_argument("--budget", default="12GiB",
                        help="GPU budget: a size such as 12GiB, or a fraction of the weights such as 0.25")
    parser.add_argument("--strategy", default="auto", help="auto, stream or uva (as for offload)")
    parser.add_argument("--rounds", type=int, default=3, help="A then B rounds")
    parser.add_argument("--reps", type=int, default=5, help="calls timed back to back per round")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None, help="folder for ab_eager_ops.log")
    args = parser.parse_args()

    device = torch.device(args.device)
    phase, model, forward = build(args.shape, args.phase, device)
    want = forward().clone()
    resident = statistics.median(time_calls(forward, args.reps, device)[0])
    budget = resolve_budget(args.budget, shape_weight_bytes(args.shape))
    handle = ws.offload(model, gpu_memory=budget, device=device, tokens=phase.batch * phase.seq,
                        strategy=args.strategy)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    st = handle.stats
    lines = [f"# ab_eager_ops.py --shape {args.shape} --phase {args.phase} --budget {args.budget} on {name}, "
             f"torch {torch.__version__}; {st.placement_kind}, {st.groups} groups, {st.slots} slots, "
             f"wire ratio {st.wire_bytes / max(1, st.wire_raw_bytes):.3f}",
             f"resident eager: {resident:.2f} ms (median of {args.reps})"]
    ms: dict[bool, list[float]] = {True: [], False: []}
    try:
        for r in range(args.rounds):
            for direct in (True, False):
                streamed.EAGER_DIRECT = direct
                times, out = time_calls(forward, args.reps, device)
                exact = torch.equal(out, want)
                ms[direct].append(statistics.median(times))
                lines.append(f"round {r + 1} {'direct' if direct else 'ops   '}: {ms[direct][-1]:8.2f} ms, "
                             f"exact {exact}")
    finally:
        streamed.EAGER_DIRECT = True
    a, b = statistics.median(ms[True]), statistics.median(ms[False])
    lines.append(f"median of rounds: direct {a:.2f} ms, through the ops {b:.2f} ms ({b - a:+.2f} ms for the "
                 f"ops); resident {resident:.2f} ms")
    handle.restore()
    emit(lines, args.out, "ab_eager_ops.log")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
