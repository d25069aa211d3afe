"""Predicted split of the FLUX.1-dev pipeline (examples/flux_offload.py's configs, built on the meta
device: no weights) under one GPU budget, raw against compressed, with the H200 reference profile. No GPU
needed: this is the planner's prediction (`pipeline.split_budget`), not a measurement.

    python benchmarks/plan_flux_pipeline.py [--budgets 12GiB,16GiB] [--decode-gbps 990] [--out FILE.md]
    python benchmarks/plan_flux_pipeline.py --tiny --budgets 100KiB     # the example's tiny configs

`--decode-gbps` replaces the reference profile's decode rate (300 GB/s, a stand-in where none was
measured) with another, e.g. what `benchmarks/bench_decoder.py` measured on the H200. Compressed sizes
are predicted for Hugging Face-initialized weights (`codec.choose` on meta tensors).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from pathlib import Path

import weightstream as ws
from weightstream.pipeline import _resolve_calls, component_costs, modules_of, split_budget
from weightstream.placement.plan import plan

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import example  # noqa: E402  (examples/flux_offload.py as a module)

STEP_TOKENS = 4096 + 512


def describe(component) -> str:
    return describe_placement(component.placement)


def describe_placement(p) -> str:
    where = (f"{len(p.streamed)} streamed, {p.n_slots} slot(s)" if p.streamed else
             f"{len(p.uva)} zero copy" if p.uva else "resident")
    if p.streamed and p.uva:
        where += f", {len(p.uva)} zero copy"
    coded = (f", compressed ({p.n_landing} x {ws.format_size(p.landing_bytes)} landing)" if p.compressed
             else "")
    return (f"{ws.format_size(p.gpu_bytes)} ({where}{coded}); {p.prediction.again_ms:.1f} ms/call "
            f"({p.prediction.ms:.1f} the first)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budgets", default="12GiB,16GiB")
    ap.add_argument("--tiny", action="store_true", help="the example's tiny configs (a smoke run)")
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--decode-gbps", type=float, default=None,
                    help="decode rate to plan with (default: the reference profile's)")
    ap.add_argument("--out", default=None, help="also write the table here (markdown)")
    args = ap.parse_args(argv)
    profile = ws.REFERENCE_PROFILE
    if args.decode_gbps:
        profile = dataclasses.replace(profile, decode_s_per_byte=1 / (args.decode_gbps * 1e9))
    start = time.perf_counter()
    modules = modules_of(example().build_pipeline(args.tiny, device="meta"))
    calls, tokens = _resolve_calls(modules, args.steps, None, None)
    costs = {c: component_costs(modules, "cpu", allow_meta=True, compress=c) for c in (False, True)}
    names = list(modules)
    command = shlex.join(["python", "benchmarks/plan_flux_pipeline.py", *(argv or sys.argv[1:])])
    lines = [f"command: {command}",
             f"profile: {profile.gpu}, {profile.h2d_GBps:.1f} GB/s host->GPU, decode "
             f"{1e-9 / profile.decode_s_per_byte:.0f} GB/s; {args.steps} steps; predicted, not measured", "",
             "| budget | compress | predicted ms / generation | " + " | ".join(names) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in names) + " |"]
    for budget in args.budgets.split(","):
        for compress in (False, True, "auto"):
            try:
                plans = split_budget(costs[compress is not False], ws.parse_size(budget), calls, tokens,
                                     profile, "auto", compress)
            except ws.BudgetError as exc:
                lines.append(f"| {budget} | {compress} | does not fit: {exc} |" + " |" * len(names))
                continue
            total = sum(p.generation_ms for p in plans.values())
            lines.append(f"| {budget} | {compress} | {total:.0f} | "
                         + " | ".join(describe(plans[n]) for n in names) + " |")
    # the transformer alone at each budget, at the bench's denoise-b1 phase (4096 image + 512 text
    # tokens), what `bash benchmarks/diffusion_h200.sh flux` measures
    lines += ["", "The transformer alone, one denoising step of 4608 tokens (the bench's `denoise-b1`):", "",
              "| budget | placement; predicted ms per step in a loop (the first) | resident compute |",
              "| --- | --- | --- |"]
    for budget in args.budgets.split(","):
        try:
            p = plan(costs[True]["transformer"], ws.parse_size(budget), STEP_TOKENS, profile, "auto",
                     compress="auto")
        except ws.BudgetError as exc:
            lines.append(f"| {budget} | does not fit: {exc} | |")
            continue
        lines.append(f"| {budget} | {describe_placement(p)} | {p.prediction.compute_ms:.1f} ms (model) |")
    lines.append(f"\n({time.perf_counter() - start:.0f} s)")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
