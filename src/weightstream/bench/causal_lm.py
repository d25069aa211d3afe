"""The causal-LM model kind of the bench: a transformers `AutoModelForCausalLM` from a shape's config
with random bf16 weights, fed fixed random token ids, timed as one forward without a KV cache.

The decode step's cost is its weight traffic, not attention over a context: `use_cache=False` and one
new token per sequence. A `generate-N` phase is `model.generate` of N greedy new tokens after a
PROMPT_TOKENS-token prompt, with its KV cache (what a user runs; eager only).
"""

from __future__ import annotations

import weakref

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

    def __init__(self) -> None:
        self._masks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {shape: masks}

    def config(self, fields: dict):
        """The transformers config, SDPA attention where the model class has it (the resident reference
        and every method run the same attention); eager attention otherwise (GPT-OSS in transformers 5:
        its attention sinks have no SDPA path), which `attention` names for the result record."""
        return shape_config(fields, attn_implementation=self.attention(fields))

    def attention(self, fields: dict) -> str:
        """The attention implementation the bench builds this shape with: "sdpa" or "eager"."""
        from transformers import AutoModelForCausalLM

        model_class = AutoModelForCausalLM._model_mapping[type(shape_config(fields))]
        return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"

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
        """One forward without KV cache; the logits (batch, seq, vocab). An eager-attention model gets
        the attention masks of its input shape built once, before a graph capture (`masks`)."""
        masks = None if torch.compiler.is_compiling() else self.masks(model, ids)
        if masks is None:
            return model(ids, use_cache=False).logits
        return model(ids, attention_mask=masks, use_cache=False).logits

    def masks(self, model: nn.Module, ids: torch.Tensor):
        """The attention masks of a forward over `ids` without KV cache for an eager-attention model
        (GPT-OSS), built by transformers' own `create_masks_for_generate` at the first forward of this
        input shape (the bench's warm-up, before any capture) and passed to every later one; None for
        other attention. Why: transformers 5.17's eager mask writes `torch.tensor(0.0, device=...)` at every
        forward, a copy from host memory that a CUDA graph capture refuses (later versions build it on
        the device). Same masks, same bits."""
        if getattr(model.config, "_attn_implementation", None) != "eager":
            return None
        built = self._masks.setdefault(model, {})
        key = (tuple(ids.shape), ids.device)
        if key not in built:
            from transformers.masking_utils import create_masks_for_generate

            shape_only = torch.empty(*ids.shape, 0, dtype=model.dtype, device=ids.device)
            built[key] = create_masks_for_generate(model.config, shape_only, None, None)
        return built[key]

    def generate(self, model: nn.Module, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """A greedy generation of `new_tokens` after the prompt `ids`, with a KV cache; the token ids."""
        return greedy(model, ids, new_tokens, attention_mask=torch.ones_like(ids))


CAUSAL_LM = CausalLM()


def routing_skew_text(s: float | None, seed: int) -> str:
    """What a result records of its routing: the synthetic skew, or that there is none."""
    if s is None:
        return ("routing as the random weights give it, no synthetic routing skew: the first layer spreads "
                "a prefill's tokens over nearly every expert, deeper layers over fewer (random weights make "
                "the tokens' hidden states alike), so a prefill reaches fewer experts than uniform routing")
    law = "uniform over the experts" if s == 0 else f"a Zipf({s:g}) law"
    return (f"synthetic routing skew: each router's logits are log(rank^-{s:g}) plus Gumbel noise hashed "
            f"from the token's hidden state, so each token draws its experts without replacement from "
            f"{law}, over a random permutation of the experts per layer (seed {seed})")


# the hash of a token's hidden state into Gumbel noise: fractional parts of this multiple of random
# projections of the unit-RMS state (tokens alike in random weights still get unrelated noise)
HASH_SCALE = 1000.0


class _SyntheticLogits:
    """A router's forward pre-hook: the router (its weight set to [I | 0], bias 0) then computes, from
    the input this returns, logits = popularity + Gumbel noise, the noise hashed from the token's hidden
    state (`HASH_SCALE`); the experts still read the unchanged input."""

    def __init__(self, popularity: torch.Tensor, projection: torch.Tensor) -> None:
        self.popularity = popularity  # (experts,) float32, log(rank^-s) permuted
        self.projection = projection  # (hidden, experts) float32, N(0, 1)

    def __call__(self, module: nn.Module, args: tuple):
        hidden = args[0].float()
        unit = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6)
        u = torch.frac((unit @ self.projection).abs() * HASH_SCALE).clamp(1e-6, 1 - 1e-6)
        logits = self.popularity - torch.log(-torch.log(u))
        wide = torch.zeros_like(hidden)
        wide[..., :logits.shape[-1]] = logits
        return (wide.to(args[0].dtype), *args[1:])


@torch.no_grad()
def skew_routing(model: nn.Module, s: float, seed: int) -> int:
    """Make every router of `model` (a mixture of experts) draw each token's experts without
    replacement from a Zipf(`s`) popularity (`s` 0: uniform), over a random permutation of the experts
    per layer (seeded by `seed`): Gumbel top-k, with logits log(rank^-s) plus Gumbel noise that a
    forward pre-hook hashes from the token's hidden state (unit-RMS state, fixed random projections,
    fractional parts of a large multiple), passed through the router as [logits | 0] against a weight
    [I | 0] (bias 0 where it has one). Random weights alone make the tokens' hidden states alike in
    deeper layers, which concentrates routing; the hash does not care. Deterministic: the same input
    routes the same way resident and offloaded. Returns how many routers were changed."""
    from ..placement.experts import routers

    found = routers(model)
    model.synthetic_routing_skew = float(s)  # what `ws-auto-skew` tells the planner
    for layer, (_, router) in enumerate(found):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + layer)
        experts = router.num_experts
        weight = router.weight
        if weight.shape[1] < experts:
            raise ValueError(f"a router of {experts} experts over {weight.shape[1]} hidden channels: the "
                             "synthetic routing needs at least as many channels as experts")
        popularity = -s * torch.log(torch.arange(1, experts + 1, dtype=torch.float64))
        popularity = popularity[torch.randperm(experts, generator=gen)].float()
        projection = torch.randn(weight.shape[1], experts, generator=gen)
        weight.zero_()
        weight[:, :experts] = torch.eye(experts, dtype=weight.dtype)
        if isinstance(getattr(router, "bias", None), torch.Tensor):
            router.bias.zero_()
        router.register_forward_pre_hook(_SyntheticLogits(popularity.to(weight.device),
                                                          projection.to(weight.device)))
    return len(found)
