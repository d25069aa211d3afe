"""A mixture of experts offloaded with its routed experts copied to the GPU each token, held compressed
in host memory (compress=True). Mixtral-shaped, random weights built from a
config (never downloaded).

    python examples/moe_offload.py                          # Mixtral-8x7B's shape, 25% on the GPU
    python examples/moe_offload.py --tiny --device cpu      # a tiny Mixtral on the CPU backend

The full shape holds about 87 GiB of bf16 weights: it is built on the GPU where they fit (an H200),
else in host memory (about 90 GiB free needed). Prints the placement, ms per decode step and tokens/s,
the experts' wire ratio, and with --check (where the resident model fits the device) whether the
greedy tokens equal the resident model's.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import weightstream as ws


def build(tiny: bool, device: str):
    """A Mixtral from its config, random bf16 weights, on `device` where they fit (else the CPU)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    if tiny:
        config = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                               num_experts_per_tok=2, max_position_embeddings=256)
    else:
        config = MixtralConfig()  # Mixtral-8x7B: 32 layers, 8 experts of 4096 x 14336, top 2
    torch.manual_seed(0)
    where = device
    if device == "cuda":
        need = 87 << 30 if not tiny else 0
        where = "cuda" if torch.cuda.mem_get_info()[0] > need + (8 << 30) else "cpu"
    with torch.device(where):
        model = MixtralForCausalLM(config).to(torch.bfloat16)
    return model.eval().requires_grad_(False), where


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny Mixtral (seconds, any device)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--budget", type=float, default=None,
                        help="share of the weights on the GPU (default 0.25; --tiny 0.5: a layer's work "
                             "buffers take a larger share of a tiny model)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens to decode")
    parser.add_argument("--check", action="store_true", help="compare with the resident model's tokens")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU here: run with --tiny --device cpu (the CPU backend)")
        return 2
    model, built_on = build(args.tiny, args.device)
    print(f"{'tiny ' if args.tiny else ''}Mixtral, random weights, built on {built_on}")
    prompt = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    prompt = prompt.to(args.device)
    expected = None
    if args.check and built_on == args.device:
        expected = greedy(model, prompt, args.tokens)
        model = copy.deepcopy(model) if args.tiny else model
    elif args.check:
        print("--check: the resident model does not fit this device, so there is nothing to compare with")
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    # compress=True: the copied experts held compressed ("auto" copies them raw)
    share = args.budget if args.budget is not None else 0.5 if args.tiny else 0.25
    handle = ws.offload(model, gpu_memory=int(share * total), device=args.device, expert_copies=True,
                        compress=True)
    p = handle.placement
    held = (f"held compressed, ratio {handle.stats.expert_wire_ratio:.3f}" if p.copy_landing_bytes
            else "held raw")
    print(f"placement at {share:.0%}: {len(p.expert_copies)} blocks' routed experts copied each token "
          f"({held}), {len(p.uva) - len(p.expert_copies)} other blocks read in place; predicted "
          f"{p.prediction.ms:.1f} ms a token")
    tokens = greedy(model, prompt, args.tokens, timed=True)
    if expected is not None:
        same = torch.equal(tokens, expected)
        print("greedy tokens " + ("identical to the resident model's" if same
                                  else "DIFFER from the resident model's"))
        return 0 if same else 1
    return 0


def greedy(model, prompt: torch.Tensor, n: int, timed: bool = False) -> torch.Tensor:
    """`n` greedy tokens after `prompt` (no KV cache: every step runs the whole sequence, simple and the
    same resident and offloaded); with `timed`, each step's ms printed and the median's tokens/s."""
    ids, times = prompt, []
    with torch.no_grad():
        for _ in range(n):
            start = time.perf_counter()
            logits = model(ids, use_cache=False).logits[:, -1]
            if ids.is_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    if timed:
        median = sorted(times)[len(times) // 2]
        print(f"{n} steps: median {median * 1e3:.1f} ms a step ({1 / median:.1f} tokens/s; the first "
              f"{times[0] * 1e3:.1f} ms)")
    return ids[:, prompt.shape[1]:]


if __name__ == "__main__":
    raise SystemExit(main())
