"""The causal-LM model kind of the bench: a transformers `AutoModelForCausalLM` from a shape's config
with random bf16 weights, fed fixed random token ids, timed as one forward without a KV cache.

The decode step's cost is its weight traffic, not attention over a context: `use_cache=False` and one
new token per sequence. A `generate-N` phase is `model.generate` of N greedy new tokens after a
PROMPT_TOKENS-token prompt, with its KV cache (what a user runs; eager only).
"""

from __future__ import annotations

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
