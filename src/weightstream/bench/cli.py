"""`weightstream bench`: every offload method on the same random bf16 weights, in one process.

    weightstream bench --shape llama-3-8b --budgets 0.25,0.5,0.75 --out /tmp/out/suite_llama-3-8b.json
    weightstream bench --kind pipeline --shape flux-dev-pipeline --budgets 16GiB --out /tmp/out/pipe.json
    weightstream bench --report benchmarks/results --index benchmarks/results/INDEX.md

`--kind` picks what one run measures (`kinds.py`): `suite` (the default, below), `pipeline` (whole
diffusers pipeline generations), `load` (a checkpoint loaded into place, host and disk tiers), `codec`
(the wire codec alone); `--bound`, `--waits` and `--predict` read stored results or plan, running
nothing; `--profile DIR` adds a profile of each measured call.

Phases: one forward on fixed random inputs (`phases.py`). Modes: `eager`; `compiled` =
`torch.compile(fullgraph=True, dynamic=False)`; `graph` = a CUDA graph captured from the compiled call,
replayed; `graph-eager` = a CUDA graph captured from the eager forward (no compile; not in the
default). A method that does not support `compiled` is still tried there (the failure under fullgraph
is the finding, recorded as `error`); an unsupported graph mode is skipped. `--report` turns stored
JSON (files, or folders searched for result documents) into the docs/benchmarks.md page and its plots
without running anything, and with `--index` writes the results folder's INDEX.md (`index.py`);
`--validate` checks stored JSON against the schema (`schema.py`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import torch

from ..errors import ArgumentError, WeightstreamError
from ..usage import USAGE_ERROR, OneLineParser
from . import kinds
from .index import folder_errors, page_links, page_plots, result_files, write_index
from .limits import check_limits
from .phases import DEFAULT_PHASES, parse_phase
from .report import markdown_table, write_benchmarks_md
from .runner import resolve_budget, run_suite
from .schema import DEFAULT_MODES, load_results, validate_files
from .shapes import check_routing_skew, routing_skew, shape_weight_bytes


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The `weightstream bench` command line; see the module docstring."""
    p = OneLineParser(prog="weightstream bench", description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=kinds.ALL_SHAPES, default=None,
                   help="default llama-3-8b (--kind pipeline: flux-dev-pipeline)")
    p.add_argument("--budgets", type=_csv, default=None,
                   help="GPU budgets: fractions of the weight bytes (0.25) or sizes (8GiB), comma separated "
                        "(default 0.25,0.5,0.75; --kind pipeline 16GiB, load 0.25)")
    p.add_argument("--phases", type=_csv, default=None,
                   help=f"decode-bN, prefill-N, denoise-bN, generate-N (default {','.join(DEFAULT_PHASES)}; "
                        "--kind pipeline generate-<its steps>, load decode-b1)")
    p.add_argument("--methods", type=_csv, default=None,
                   help="default: every method but the variants for one question (ws-stream-raw, "
                        "ws-stream-compress, ws-uva-whole-blocks, ws-auto-skew); --kind pipeline: its own "
                        "(bench/pipeline_run.py)")
    p.add_argument("--modes", type=_csv, default=None,
                   help=f"eager, compiled, graph, graph-eager (default {','.join(DEFAULT_MODES)})")
    p.add_argument("--reps", type=int, default=None,
                   help="timed calls per measurement (default 10; --kind pipeline 1, load 5, codec 20)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seconds", type=float, default=None,
                   help="prepare no method after this many seconds; the rest is recorded as skipped")
    p.add_argument("--method-seconds", type=float, default=None,
                   help="stop a method that has not finished a budget and phase within this many seconds "
                        "(recorded as its error) and go on with the next")
    p.add_argument("--no-timeline", action="store_true", help="skip the profiler timelines (CUDA only)")
    p.add_argument("--lora", type=int, default=None, metavar="RANK",
                   help="add an unfused LoRA adapter of this rank (random weights) to the attention "
                        "projections before any method runs, to measure what it costs")
    p.add_argument("--routing-skew", type=float, default=None, metavar="S",
                   help="mixtures of experts: set each router so expert popularity follows a Zipf(S) law "
                        "(S >= 0, 0: uniform; a random permutation per layer, seeded by --seed), recorded as "
                        "synthetic routing skew; without it routing is what the random weights give (deeper "
                        "layers reach fewer experts at prefill)")
    p.add_argument("--emulate-precision-casts", action="store_true",
                   help="Inductor rounds to bf16 where eager does (compiled exactness, benchmarks/README.md)")
    p.add_argument("--out", default=None,
                   help="result JSON (default <kind>_<shape>.json in the current folder)")
    p.add_argument("--report", nargs="+", metavar="RESULTS",
                   help="run nothing: write the page and plots from stored result JSON files, or from every "
                        "result document under a folder")
    p.add_argument("--index", default=None, metavar="INDEX_MD",
                   help="with --report FOLDER: also write the folder's index, one line per result row "
                        "(benchmarks/results/INDEX.md; its links are relative to the folder)")
    p.add_argument("--validate", nargs="+", metavar="RESULTS",
                   help="run nothing: check result JSON files against the schema (exit 1 if one is invalid)")
    p.add_argument("--md", default="docs/benchmarks.md", help="markdown page written by --report")
    p.add_argument("--png-dir", default="docs/figures", help="folder for the plots written by --report")
    kinds.add_options(p)
    return p.parse_args(argv)


def report(paths: list[str], md_path: str, png_dir: str, index_path: str | None = None) -> str:
    """Regenerate the page and its plots from stored results (files, or folders searched for result
    documents; plots need matplotlib) and, with `index_path`, the index of the one folder given.
    Raises ArgumentError for an index without exactly one folder, ValueError for an invalid file."""
    folders = [p for p in paths if os.path.isdir(p)]
    if index_path and (len(paths) != 1 or not folders):
        raise ArgumentError("--index indexes one results folder: give --report that folder alone "
                            "(e.g. --report benchmarks/results --index benchmarks/results/INDEX.md)")
    files = result_files(paths)
    if not files:
        raise ArgumentError(f"--report {' '.join(paths)}: no result documents there")
    images = page_plots(load_results(files), files, png_dir)
    if not index_path:
        return write_benchmarks_md(files, md_path, images)
    bad = folder_errors(folders[0])
    if bad:
        raise ArgumentError(f"{folders[0]}: {bad[0]} (folders are <date>_<gpu>_<topic>, see index.py)")
    write_index(folders[0], index_path)
    index_link, rows_links = page_links(files, md_path, index_path)
    return write_benchmarks_md(files, md_path, images, index_link, rows_links)


def check_run(args: argparse.Namespace) -> torch.device:
    """Refuse a run that cannot work before anything is built or timed; return the device. Raises
    ArgumentError (or ValueError from the runner's own checks) naming the option to change."""
    device = kinds.bench_device(args.device, "--shape tiny or tiny-moe")
    if device.type == "cpu" and not args.shape.startswith("tiny"):
        raise ArgumentError("without CUDA, run the harness on --shape tiny or tiny-moe (a correctness smoke "
                            "test)")
    if args.reps < 1:
        raise ArgumentError(f"--reps {args.reps}: time at least 1 forward per measurement")
    if args.lora is not None and args.lora < 1:
        raise ArgumentError(f"--lora {args.lora}: give the adapter's rank, at least 1 (e.g. --lora 16)")
    try:
        check_routing_skew(args.shape, args.routing_skew)
    except ValueError as err:
        raise ArgumentError(str(err)) from None
    for option, seconds in (("--max-seconds", args.max_seconds), ("--method-seconds", args.method_seconds)):
        if seconds is not None and not seconds > 0:  # `not >` also refuses nan
            raise ArgumentError(f"{option} {seconds:g}: give a positive number of seconds, or leave it out")
    check_limits(args.max_seconds, args.method_seconds)  # a SIGALRM timer for --method-seconds
    for option, values in (("--budgets", args.budgets), ("--phases", args.phases)):
        if not values:
            raise ArgumentError(f"{option} is empty: give at least one, comma separated")
    weights = shape_weight_bytes(args.shape)
    for budget in args.budgets:
        resolve_budget(budget, weights)
    for phase in args.phases:
        parse_phase(phase)
    return device


def main(argv: list[str] | None = None) -> int:
    """Entry point of `weightstream bench`; returns the exit status: 2 (one line on stderr) for a
    mistake in what was asked, 1 for an invalid file under --validate or a run that was aborted."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        if args.validate:
            return validate_files(args.validate)
        if args.report:
            report(args.report, args.md, args.png_dir, args.index)
            print(f"wrote {args.md}{' and ' + args.index if args.index else ''} and plots in {args.png_dir}")
            return 0
        kinds.fill_defaults(args)
        if kinds.runs_nothing(args) or args.kind != "suite":
            return kinds.main(args, argv)
        device = check_run(args)
        kinds.check_suite(args)
        out = args.out or kinds.out_path(args)
        with routing_skew(args.shape, args.routing_skew, args.seed):
            doc = run_suite(args.shape, args.budgets, args.phases, args.methods, args.modes, args.reps,
                            device, out, seed=args.seed, timeline=not args.no_timeline,
                            emulate_precision_casts=args.emulate_precision_casts,
                            command="weightstream bench " + shlex.join(argv), max_seconds=args.max_seconds,
                            method_seconds=args.method_seconds, profile_dir=args.profile, lora=args.lora)
    except (WeightstreamError, ValueError, OSError) as err:
        message = " ".join(str(err).split())  # one line, whatever the message held
        print(f"weightstream bench: {message}", file=sys.stderr)
        return USAGE_ERROR
    print("\n" + markdown_table([doc]), flush=True)
    if doc["shape"].get("routing"):  # a mixture of experts: every row above was routed this way
        print(f"\n{doc['shape']['name']}: {doc['shape']['routing']}", flush=True)
    return 0 if not doc.get("aborted") else 1


if __name__ == "__main__":
    sys.exit(main())
