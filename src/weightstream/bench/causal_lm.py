"""The causal-LM model kind of the bench: a transformers `AutoModelForCausalLM` from a shape's config
with random bf16 weights, fed fixed random token ids, timed as one forward without a KV cache.

The decode step's cost is its weight traffic, not attention over a context: `use_cache=False` and one
new token per sequence. A `generate-N` phase is `model.generate` of N greedy new tokens after a
PROMPT_TOKENS-token prompt, with its KV cache (what a user runs; eager only).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..placement.shapes import shape_config
from .phases import Phase

PROMPT_TOKENS = 16  # the prompt of a `generate-N` phase


def greedy(model: nn.Module, ids: torch.Tensor, new_tokens: int, **inputs) -> torch.Tensor:
    """`model.generate` of exactly `new_tokens` greedy tokens (random weights may well emit EOS early:
    min_new_tokens keeps going); the token ids, prompt included."""
    return model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=0, **inputs)


class CausalLM:
    """Build, feed and run a causal LM (see `shapes.ModelKind`)."""

    name = "causal-lm"
    dtype_name = "bfloat16"  # recorded in the result document's `shape`

    def config(self, fields: dict):
        """The transformers config, SDPA attention."""
        return shape_config(fields, attn_implementation="sdpa")

    def build(self, fields: dict, device: torch.device, seed: int) -> nn.Module:
        """Random bf16 weights created on `device`, in eval mode, no grads."""
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(self.config(fields), dtype=torch.bfloat16)
        model = model.to(device)  # a no-op unless the library built it elsewhere
        return model.eval().requires_grad_(False)

    def meta(self, fields: dict) -> nn.Module:
        """The same model on the meta device (no memory): for sizes."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(self.config(fields), dtype=torch.bfloat16)

    def inputs(self, model: nn.Module, phases: list[Phase], device: torch.device,
               seed: int) -> dict[str, torch.Tensor]:
        """Fixed random input ids per phase, shape (batch, seq), on `device`; a generation's prompt is
        (batch, PROMPT_TOKENS)."""
        gen = torch.Generator().manual_seed(seed + 1)
        vocab = model.config.vocab_size
        return {p.name: torch.randint(vocab, (p.batch, PROMPT_TOKENS if p.kind == "generate" else p.seq),
                                      generator=gen).to(device) for p in phases}

    def forward(self, model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """One forward without KV cache; the logits (batch, seq, vocab)."""
        return model(ids, use_cache=False).logits

    def generate(self, model: nn.Module, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """A greedy generation of `new_tokens` after the prompt `ids`, with a KV cache; the token ids."""
        return greedy(model, ids, new_tokens, attention_mask=torch.ones_like(ids))


CAUSAL_LM = CausalLM()


# std of a standard Gumbel variable: router logits of this spread around log-popularity make top-k about
# Zipf sampling without replacement (Gumbel top-k); the rows' own logits stand in for the Gumbel noise
GUMBEL_STD = math.pi / math.sqrt(6)


def routing_skew_text(s: float | None, seed: int) -> str:
    """What a result records of its routing: the synthetic skew, or that there is none."""
    if s is None:
        return ("routing as the random weights give it, no synthetic routing skew: the first layer spreads "
                "a prefill's tokens over nearly every expert, deeper layers over fewer (random weights make "
                "the tokens' hidden states alike), so a prefill reaches fewer experts than uniform routing")
    return (f"synthetic routing skew: each router's logits are log(rank^-{s:g}) plus its own random rows' "
            f"logits (rows scaled to a Gumbel spread for unit-RMS inputs), so expert popularity follows "
            f"about a Zipf({s:g}) law, over a random permutation of the experts per layer (seed {seed})")


def _pin_channel(module: nn.Module, args: tuple):
    """A router's forward pre-hook: its input with the last hidden channel set to 1, so that column of
    its weight acts as a bias (routers without one); the experts still read the unchanged input."""
    hidden = args[0].clone()
    hidden[..., -1] = 1.0
    return (hidden, *args[1:])


@torch.no_grad()
def skew_routing(model: nn.Module, s: float, seed: int) -> int:
    """Make expert popularity of every router of `model` (a mixture of experts) follow about a Zipf(`s`)
    law: logits log(rank^-s) over a random permutation of the experts per layer (seeded by `seed`), plus
    the router's own random logits scaled to a Gumbel spread (std pi/sqrt(6) for inputs of unit RMS, as
    an RMS norm with unit weights gives). The popularity term goes into the router's bias where it has
    one (GPT-OSS), else into the weight's last column, with a forward pre-hook that gives the router
    (only) an input whose last channel is 1. Returns how many routers were changed."""
    from ..placement.experts import routers

    found = routers(model)
    for layer, (_, router) in enumerate(found):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + layer)
        experts = router.num_experts
        popularity = -s * torch.log(torch.arange(1, experts + 1, dtype=torch.float64))
        bias = popularity[torch.randperm(experts, generator=gen)]
        weight = router.weight
        rows = weight.float()
        has_bias = isinstance(getattr(router, "bias", None), torch.Tensor)
        columns = rows.shape[1] if has_bias else rows.shape[1] - 1
        rows = rows[:, :columns]
        rows = rows / rows.norm(dim=1, keepdim=True).clamp_min(1e-12) * GUMBEL_STD
        weight[:, :columns] = rows.to(weight.dtype)
        if has_bias:
            router.bias.copy_(bias.to(router.bias.dtype))
        else:
            weight[:, -1] = bias.to(weight.device, weight.dtype)
            router.register_forward_pre_hook(_pin_channel)
    return len(found)
