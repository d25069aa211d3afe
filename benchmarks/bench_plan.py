"""The planner against measurement: budgets x phases x strategies, predicted and measured side by side.

For a Llama model with random bf16 weights on the GPU, at GPU budgets of 25/50/75/100% of the weight
bytes, for batch-1 decode (1 token) and a 2048-token prefill, offload with strategy stream, uva and
auto (each planned for that phase's tokens), check the logits against the resident model (exact), and
time one forward: decode replayed from a CUDA graph captured from the eager forward, prefill eager;
CUDA events, median after warm-up. Records the planner's prediction next to each measurement.
Run: PYTHONPATH=src python3 benchmarks/bench_plan.py --out benchmarks/results/plan_llama-3-8b.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_core import SHAPES, build_model

import weightstream as ws
from weightstream.probe import load_profile
from weightstream.timing import capture_graph, time_calls

PHASES = {"decode": 1, "prefill": 2048}
STRATEGIES = ("stream", "uva", "auto")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def timed(fn, reps: int, device: torch.device) -> list[float]:
    """Milliseconds of `reps` calls of fn after one warm-up (CUDA events on a GPU, a host clock else)."""
    fn()
    return time_calls(fn, reps, device)[0]


def runner(model, ids: torch.Tensor, phase: str, device: torch.device):
    """A zero-argument forward for `phase` that returns the logits: decode replays a CUDA graph."""
    def forward(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(ids, use_cache=False).logits

    if phase != "decode" or device.type != "cuda":
        return lambda: forward(ids)
    return capture_graph(forward, ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--budgets", default="1.0,0.25,0.5,0.75",
                   help="fractions of the weight bytes, in run order (all-resident first: it checks compute)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = torch.device(args.device)
    PHASES["prefill"] = args.prefill_tokens
    profile = load_profile(device, refresh=device.type == "cuda")
    doc = {"command": "PYTHONPATH=src python3 " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
           "gpu": profile.gpu, "torch": torch.__version__, "h2d_bandwidth_GBps": profile.h2d_GBps,
           "profile": json.loads(profile.to_json()), "points": []}
    model = build_model(args.shape, device, seed=0)
    weight_bytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in
                       list(model.parameters()) + list(model.buffers())}.values())
    doc["weight_bytes"] = weight_bytes
    inputs = {ph: torch.randint(0, model.config.vocab_size, (1, n), device=device,
                                generator=torch.Generator(device).manual_seed(1)) for ph, n in PHASES.items()}
    with torch.no_grad():
        reference = {ph: model(ids, use_cache=False).logits.clone() for ph, ids in inputs.items()}
    for fraction in map(float, args.budgets.split(",")):
        budget = int(weight_bytes * fraction)
        for phase, tokens in PHASES.items():
            measured_for: dict[tuple, dict] = {}
            for strategy in STRATEGIES:
                point = {"fraction": fraction, "budget_bytes": budget, "phase": phase, "tokens": tokens,
                         "strategy": strategy}
                try:
                    handle = ws.offload(model, gpu_memory=budget, strategy=strategy, tokens=tokens,
                                        device=device, profile=profile)
                except ws.BudgetError as err:
                    point["error"] = str(err)
                    doc["points"].append(point)
                    log(f"{fraction:.0%} {phase} {strategy}: {err}")
                    continue
                pl = handle.placement
                key = (pl.streamed, pl.n_slots, pl.uva, pl.part)
                point.update(placement=pl.kind, streamed=len(pl.streamed), slots=pl.n_slots,
                             part=pl.part, uva=len(pl.uva), predicted_ms=pl.prediction.ms,
                             bound=pl.prediction.bound)
                if key in measured_for:  # the same placement as a strategy measured just before
                    point.update({k: measured_for[key][k] for k in ("median_ms", "times_ms", "exact")},
                                 same_placement_as=measured_for[key]["strategy"])
                else:
                    fn = runner(model, inputs[phase], phase, device)
                    out = fn()
                    point["exact"] = bool(torch.equal(out, reference[phase]))
                    point["times_ms"] = timed(fn, args.reps, device)
                    point["median_ms"] = statistics.median(point["times_ms"])
                    del fn, out
                    measured_for[key] = point
                point["prediction_error"] = point["predicted_ms"] / point["median_ms"] - 1
                handle.restore()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                doc["points"].append(point)
                log(f"{fraction:.0%} {phase:7s} {strategy:6s} -> {pl.kind:8s} "
                    f"{len(pl.streamed):2d} streamed/{pl.n_slots} slots (part {pl.part}), "
                    f"{len(pl.uva):2d} uva: "
                    f"{point['median_ms']:8.2f} ms, predicted "
                    f"{pl.prediction.ms:8.2f} ({point['prediction_error']:+.0%}), exact {point['exact']}")
                Path(args.out).write_text(json.dumps(doc, indent=1))
    Path(args.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
