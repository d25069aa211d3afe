"""The `weightstream` command line. A mistake in what was asked ends in one line on stderr and exit
status 2; a demo whose tokens differ from the resident run's exits 1."""

from __future__ import annotations

import argparse
import sys

from .usage import USAGE_ERROR, OneLineParser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `weightstream` and `python -m weightstream`; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the suite has its own options: hand them over whole
        from .bench import main as bench

        return bench(argv[1:])
    parser = OneLineParser(prog="weightstream", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("bench", help="every offload method side by side (see: weightstream bench --help)")
    demo = sub.add_parser("demo", help="offload a built-in model, generate, compare with the resident run")
    demo.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    demo.add_argument("--fraction", type=float, default=0.4,
                      help="GPU budget as a fraction of the weight bytes (default 0.4)")
    demo.add_argument("--new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    gen = sub.add_parser("generate", help="load a local checkpoint offloaded and generate text, or an image "
                                          "from a diffusers pipeline folder")
    gen.add_argument("path", help="a local Hugging Face checkpoint folder of a causal LM (config, "
                                  "safetensors, tokenizer), or a diffusers pipeline folder "
                                  "(model_index.json), loaded straight into place")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--gpu-memory", default="auto",
                     help='GPU budget for the weights, e.g. "20GiB" (default auto: the free GPU memory minus '
                          'max(2 GiB, 10%%))')
    gen.add_argument("--cpu-memory", default=None,
                     help='host memory for offloaded weights, e.g. "16GiB"; streamed groups beyond it are '
                          "read from the checkpoint files every call (default: no limit)")
    gen.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    gen.add_argument("--dtype", default=None,
                     help="e.g. bfloat16 (default: the checkpoint's; for a pipeline each component's)")
    gen.add_argument("--compress", default="auto", choices=["auto", "true", "false"],
                     help="stream groups losslessly compressed, as from_pretrained(compress=...): auto (the "
                          "default: where predicted faster; raw without a GPU), true or false; with "
                          "--expert-copies, true also holds the copied experts compressed")
    text = gen.add_argument_group("text (a causal LM checkpoint)")
    text.add_argument("--max-new-tokens", type=int, default=None, help="tokens to generate (default 64)")
    text.add_argument("--compile", nargs="?", const="fullgraph", default=None,
                      choices=("fullgraph", "graphs"),
                      help="static KV cache and torch.compile(fullgraph=True); --compile graphs: also "
                           'mode="reduce-overhead", each step replayed from a CUDA graph (what a GPU '
                           "expert cache needs to pay)")
    text.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    text.add_argument("--speculate", default=None, metavar="{prompt-lookup,self,DRAFT_FOLDER}",
                      help="speculative decoding: drafts from n-grams of the context (prompt-lookup), from "
                           "the model itself with int4 copies of its offloaded blocks (self) or from a small "
                           "checkpoint with the same tokenizer (its folder, loaded resident); the draft's "
                           "weights count in --gpu-memory; the model verifies a tree of drafted tokens per "
                           "forward")
    text.add_argument("--tree", default=None, metavar="WIDTHxDEPTH",
                      help="the drafted tree of each verify forward with --speculate (default 4x6: "
                           "1 + 4*6 tokens; 1xN is a chain; auto: the shape the cost model predicts "
                           "fastest, chosen again from the acceptance measured)")
    text.add_argument("--routing-skew", type=float, default=None, metavar="S",
                      help="a mixture of experts: plan its GPU expert cache for Zipf(S) expert popularity, "
                           "as offload(routing_skew=S) (default: uniform routing); the cache pays from "
                           "CUDA graphs (--compile graphs); eagerly it is slower (it warns)")
    text.add_argument("--expert-copies", action="store_true",
                      help="a mixture of experts: copy each step's routed experts to the GPU by the copy "
                           "engine once the host has read the routing, instead of reading them in place "
                           "(as offload(expert_copies=True); faster for experts stored [experts, in, out], "
                           "GPT-OSS); not with --compile graphs, nor with a --speculate draft that takes GPU "
                           "memory (self, a folder: the budget split plans no copies)")
    image = gen.add_argument_group("image (a diffusers pipeline folder)")
    image.add_argument("--steps", type=int, default=None,
                       help="denoising steps (default: the pipeline's own, e.g. 28 for Flux)")
    image.add_argument("--size", type=int, default=None, metavar="PIXELS",
                       help="the image's width and height (default: the pipeline's own, e.g. 1024 for Flux)")
    image.add_argument("--seed", type=int, default=None,
                       help="seed of the starting noise, drawn on the CPU so it is the same on any device "
                            "(default 0)")
    image.add_argument("--out", default=None,
                       help="the PNG file to write (default: image.png in the current folder; replaced if it "
                            "exists)")
    probe = sub.add_parser("probe", help="measure this GPU's link and GEMM rates for the planner (cached)")
    probe.add_argument("--refresh", action="store_true", help="measure again even if cached")
    plan = sub.add_parser("plan", help="show where a model's weights would go under a budget")
    plan.add_argument("model", help="a built-in shape (llama-3-8b, llama-3-70b, qwen2.5-32b, mixtral-8x7b, "
                                    "qwen3-30b-a3b, qwen3-235b-a22b, gpt-oss-20b, deepseek-v2-lite), a "
                                    "local folder with config.json (a transformers checkpoint, or a "
                                    "diffusers model such as FLUX.1-dev/transformer), or a diffusers "
                                    "pipeline folder (model_index.json): one budget split across its "
                                    "components")
    plan.add_argument("--gpu-memory", required=True, help='GPU budget for the weights, e.g. "20GiB"')
    plan.add_argument("--tokens", type=int, default=None,
                      help="tokens per forward to plan for (default 1; for a diffusers model folder what "
                           "it sees at its pipeline's default generation: 4608 for Flux at 1024x1024)")
    plan.add_argument("--strategy", default="auto", choices=["auto", "stream", "uva"])
    plan.add_argument("--dtype", default=None,
                      help="dtype to plan in (default: a folder's checkpoint dtype, for a pipeline each "
                           "component's; bfloat16 for built-ins)")
    plan.add_argument("--cpu-memory", default=None,
                      help='host memory for offloaded weights, as for from_pretrained (default: no limit); '
                           "for a pipeline folder the output shows each component's share and what stays on "
                           "disk")
    plan.add_argument("--steps", type=int, default=None,
                      help="denoising steps per generation (pipeline folders only; default 28)")
    plan.add_argument("--speculate", default=None, metavar="{prompt-lookup,self,DRAFT_FOLDER}",
                      help="plan for speculative decoding with this draft (as generate --speculate): its "
                           "weights count in --gpu-memory (self: int4 copies of the blocks kept off the "
                           "GPU); the output shows target resident, staging and draft bytes")
    plan.add_argument("--routing-skew", type=float, default=None, metavar="S",
                      help="a mixture of experts: plan the GPU expert cache for expert popularity that "
                           "follows a Zipf(S) law (S >= 0; trained routers are skewed), as "
                           "offload(routing_skew=S); default: uniform routing")
    plan.add_argument("--expert-copies", action="store_true",
                      help="a mixture of experts: plan its routed experts copied by the copy engine each "
                           "forward instead of read in place, as offload(expert_copies=True); not with "
                           "--speculate (the budget split plans no copies)")
    plan.add_argument("--json", action="store_true", help="print JSON for tools")
    plan.add_argument("--compress", default="auto", choices=["auto", "true", "false"],
                      help="stream groups losslessly compressed, as offload(compress=...): true, "
                           "false or auto (the default: when predicted faster; raw without a GPU); "
                           "the output shows the predicted wire bytes, ratio and landing buffers")
    args = parser.parse_args(argv)

    from .errors import WeightstreamError

    try:
        return _run(args)
    except WeightstreamError as err:
        message = " ".join(str(err).split())  # one line, whatever the message held
        print(f"weightstream {args.command}: {message}", file=sys.stderr)
        return USAGE_ERROR


def _run(args: argparse.Namespace) -> int:
    from .config import OffloadConfig  # every offload argument is checked there, before anything loads

    if args.command == "demo":
        from .demo import run_demo

        return 0 if run_demo(args.device, args.fraction, args.new_tokens) else 1
    if args.command == "probe":
        return _probe(args.refresh)
    if args.command == "plan":
        import json
        import os

        from .pipeline import DEFAULT_STEPS, format_pipeline_plan, plan_pipeline
        from .planview import format_report, plan_report

        pipeline = os.path.isfile(os.path.join(args.model, "model_index.json"))  # a diffusers pipeline folder
        _check_plan_options(args, pipeline)
        config = OffloadConfig(args.gpu_memory, strategy=args.strategy,
                               compress=COMPRESS_OPTION[args.compress], routing_skew=args.routing_skew,
                               expert_copies=args.expert_copies)
        report = (plan_pipeline(args.model, config, args.steps or DEFAULT_STEPS, dtype=args.dtype,
                                cpu_memory=args.cpu_memory)
                  if pipeline
                  else plan_report(args.model, config, args.tokens, dtype=args.dtype,
                                   cpu_memory=args.cpu_memory, speculate=args.speculate))
        if args.compress == "auto" and not config.compress:  # the config resolved "auto": raw without CUDA
            if pipeline:
                report["compress_auto_raw_without_cuda"] = True
            else:
                report["wire"]["auto_raw_without_cuda"] = True
        text = format_pipeline_plan(report) if pipeline else format_report(report)
        print(json.dumps(report, indent=1) if args.json else text)
        return 0
    if args.command == "generate":
        from .generate import generate_image, generate_text
        from .pipeline import is_pipeline_folder

        pipeline = is_pipeline_folder(args.path)
        _check_generate_options(args, pipeline)
        config = OffloadConfig(args.gpu_memory, device=args.device, routing_skew=args.routing_skew,
                               expert_copies=args.expert_copies, compress=COMPRESS_OPTION[args.compress])
        if pipeline:
            summary = generate_image(
                args.path, args.prompt, config, cpu_memory=args.cpu_memory, steps=args.steps,
                size=args.size, seed=0 if args.seed is None else args.seed, dtype=args.dtype,
                **({"out": args.out} if args.out is not None else {}),
            )
        else:
            summary = generate_text(
                args.path, args.prompt, config, max_new_tokens=64 if args.max_new_tokens is None else
                args.max_new_tokens, compile=COMPILE_OPTION.get(args.compile, False), chat=args.chat,
                dtype=args.dtype, speculate=args.speculate, tree=_tree_option(args),
                cpu_memory=args.cpu_memory,
            )
        print(summary)
        return 0
    return USAGE_ERROR


def _tree_option(args: argparse.Namespace) -> str:
    """--tree, refused without --speculate (it would be ignored)."""
    from .errors import ArgumentError

    if args.tree is not None and args.speculate is None:
        raise ArgumentError(f"--tree {args.tree} not used here: a tree is drafted with --speculate only; add "
                            "--speculate prompt-lookup (or self, or a draft folder), or drop --tree")
    return args.tree or "4x6"


COMPILE_OPTION = {"fullgraph": True, "graphs": "reduce-overhead"}  # --compile's value -> generate_text's
COMPRESS_OPTION = {"auto": "auto", "true": True, "false": False}  # --compress's value -> OffloadConfig's


def _refuse_unused(given: dict[str, object], why: str) -> None:
    """Raise ArgumentError naming every option of `given` (option: its value, None or False when not
    given) that this kind of model would ignore, `why` saying what it applies to."""
    from .errors import ArgumentError

    ignored = [option for option, value in given.items() if value is not None and value is not False]
    if ignored:
        names = " and ".join(ignored)
        raise ArgumentError(f"{names} not used here: {why}; drop {names}")


def _check_plan_options(args: argparse.Namespace, pipeline: bool) -> None:
    """Refuse an option `weightstream plan` would ignore for this kind of model, or a step count below 1."""
    from .errors import ArgumentError

    if args.steps is not None and args.steps < 1:
        raise ArgumentError(f"--steps {args.steps}: a generation takes at least 1 denoising step")
    if pipeline:
        _refuse_unused({"--tokens": args.tokens, "--speculate": args.speculate,
                        "--routing-skew": args.routing_skew, "--expert-copies": args.expert_copies},
                       "a pipeline folder (model_index.json) is planned per component at its default tokens, "
                       "without expert copies or a GPU expert cache, and speculative decoding is for causal "
                       "LMs")
    else:
        _refuse_unused({"--steps": args.steps},
                       "only a pipeline folder (model_index.json) has denoising steps")


def _check_generate_options(args: argparse.Namespace, pipeline: bool) -> None:
    """Refuse an option `weightstream generate` would ignore: the text options for a pipeline folder, the
    image options for a causal LM checkpoint."""
    if pipeline:
        _refuse_unused({"--max-new-tokens": args.max_new_tokens, "--compile": args.compile,
                        "--chat": args.chat, "--speculate": args.speculate, "--tree": args.tree,
                        "--routing-skew": args.routing_skew, "--expert-copies": args.expert_copies},
                       f"{args.path} is a diffusers pipeline folder (model_index.json), which makes an "
                       "image, not text")
    else:
        if args.expert_copies and args.compile == "graphs":
            from .errors import ArgumentError

            raise ArgumentError("--expert-copies and --compile graphs: expert copies read each step's "
                                "routing on the host, which a CUDA graph cannot capture; drop one of them (a "
                                "GPU expert cache, --routing-skew S, is what pays from CUDA graphs)")
        _refuse_unused({"--steps": args.steps, "--size": args.size, "--seed": args.seed, "--out": args.out},
                       "only a diffusers pipeline folder (model_index.json) makes an image")


def _probe(refresh: bool) -> int:
    import torch

    from .placement.probe import cache_path, cached_profile, load_profile

    if not torch.cuda.is_available():
        print("weightstream probe: no CUDA GPU here; the planner uses the reference H200 profile")
        return 1
    path = cache_path(torch.cuda.get_device_name())
    cached = not refresh and cached_profile(path) is not None
    profile = load_profile("cuda", refresh=refresh)
    source = "cached" if cached else "measured"
    print(f"{profile.gpu}: host->GPU {profile.h2d_GBps:.1f} GB/s ({source}, {path})")
    for m in sorted(profile.resident):
        print(f"  {m:5d} tokens: resident GEMM {1e-9 / profile.resident[m]:8.1f} GB/s of weights, "
              f"zero copy {1e-9 / profile.uva[m]:6.1f} GB/s, a 4096-wide block "
              f"{profile.block_extra_seconds(4096, m) * 1e3:.3f} ms outside its GEMMs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
