"""Encoder-decoder decoder steps on the H200: does every decoder step stream at the link rate?

Builds a T5-XXL-sized encoder-decoder (T5 v1.1 XXL config, random bf16 weights, never downloaded) on
the GPU, keeps its resident decoder-step output and time, offloads it at a budget (default 25% of its
weights, strategy auto), and times one decoder step (one new token for one sequence, encoder states
given, no KV cache) eagerly and replayed from a CUDA graph, with CUDA events after warm-up (medians).
The link bound is the bytes the step moves (its streamed and zero-copy decoder blocks) over the
measured pinned host->GPU bandwidth. Then a greedy `generate` of a few tokens checks exactness against
the resident model and counts misses per decoder step (the schedule's `misses`; each step should
start one pass and miss nothing).

    python3 benchmarks/bench_encdec.py --out benchmarks/results/encdec_t5-xxl.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import weightstream as ws
from weightstream.bench.measure import h2d_bandwidth, link_bound_ms
from weightstream.placement.timing import capture_graph, time_calls
from weightstream.sizes import parse_size

T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_decoder_layers=24,
              num_heads=64, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
              decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
SMALL = dict(T5_XXL, d_model=256, d_ff=512, num_heads=4, num_layers=4, num_decoder_layers=4, vocab_size=512)


def log(msg: str) -> None:
    print(msg, flush=True)


def build(fields: dict, device: torch.device):
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    with torch.device(device):
        model = T5ForConditionalGeneration(T5Config(**fields)).to(torch.bfloat16)
    return model.eval().requires_grad_(False)


def median_ms(fn, reps: int, device: torch.device) -> float:
    for _ in range(2):
        fn()
    times, _ = time_calls(fn, reps, device)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON result path")
    ap.add_argument("--budget", default="0.25", help="fraction of the weights, or a size like 6GiB")
    ap.add_argument("--small", action="store_true", help="a small config (smoke run)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=8, help="new tokens of the generate check")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        log("needs a CUDA GPU")
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    fields = SMALL if args.small else T5_XXL
    t0 = time.perf_counter()
    model = build(fields, device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    log(f"built T5 ({weight_bytes / 1e9:.2f} GB of bf16 weights) in {time.perf_counter() - t0:.1f} s")
    bandwidth = h2d_bandwidth(device)
    log(f"host->GPU pinned bandwidth {bandwidth:.1f} GB/s")

    gen = torch.Generator().manual_seed(1)
    src = torch.randint(2, fields["vocab_size"], (1, 64), generator=gen).to(device)
    step_ids = torch.randint(2, fields["vocab_size"], (1, 1), generator=gen).to(device)
    with torch.no_grad():
        enc = model.get_encoder()(input_ids=src).last_hidden_state.clone()

    def step(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(encoder_outputs=(enc,), decoder_input_ids=ids, use_cache=False).logits

    kwargs = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)
    resident_ms = median_ms(lambda: step(step_ids), args.reps, device)
    ref_step = step(step_ids).clone()
    ref_tokens = model.generate(src, **kwargs)
    log(f"resident decoder step {resident_ms:.2f} ms")

    budget = (int(float(args.budget) * weight_bytes) if args.budget.replace(".", "").isdigit()
              else parse_size(args.budget))
    t0 = time.perf_counter()
    handle = ws.offload(model, gpu_memory=budget)
    log(f"offload in {time.perf_counter() - t0:.1f} s: {handle.stats}")
    groups = zip(handle._groups + handle._uva_groups, handle.streamed_blocks + handle.uva_blocks,
                 strict=True)
    decoder_bytes = sum(sum(e.nbytes for e, _ in g) for g, name in groups if name.startswith("decoder."))
    bound = link_bound_ms(decoder_bytes, bandwidth)

    before = handle.stats
    eager_ms = median_ms(lambda: step(step_ids), args.reps, device)
    eager_exact = torch.equal(step(step_ids), ref_step)
    after = handle.stats
    steps = args.reps + 3
    replay = capture_graph(step, step_ids)
    graph_ms = median_ms(replay, args.reps, device)
    graph_exact = torch.equal(replay(), ref_step)
    misses0 = handle.stats.misses
    tokens = model.generate(src, **kwargs)
    generate_exact = torch.equal(tokens, ref_tokens)
    result = {
        "command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__, "config": fields, "weight_bytes": weight_bytes, "budget_bytes": budget,
        "h2d_bandwidth_GBps": bandwidth,
        "placement": str(handle.stats), "decoder_streamed_bytes": decoder_bytes, "link_bound_ms": bound,
        "resident_step_ms": resident_ms, "eager_step_ms": eager_ms, "graph_step_ms": graph_ms,
        "eager_ratio": eager_ms / bound if bound else None,
        "graph_ratio": graph_ms / bound if bound else None,
        "eager_exact": eager_exact, "graph_exact": graph_exact, "generate_exact": generate_exact,
        "eager_misses_per_step": (after.misses - before.misses) / steps,
        "eager_prologues_per_step": (after.prologues - before.prologues) / steps,
        "generate_misses": handle.stats.misses - misses0, "generate_tokens": args.tokens,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    log(json.dumps({k: v for k, v in result.items() if k not in ("config", "command")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
