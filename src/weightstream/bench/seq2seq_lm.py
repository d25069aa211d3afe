"""The encoder-decoder model kind of the bench: a T5 `T5ForConditionalGeneration` from a config (the T5
v1.1 XXL config: 22.0 GB of random bf16 weights, never downloaded), timed as decoder steps (formerly
`benchmarks/bench_encdec.py`).

- `decode-bN` / `prefill-N`: one decoder forward of N sequences of one token (or one sequence of N
  tokens), the encoder's states given (computed once from a fixed source of `input_source_tokens`
  tokens when the inputs are made), no KV cache: the step's weight traffic is the decoder's blocks.
- `generate-N`: `model.generate` of N greedy tokens from the source (encoder once, then N decoder
  steps with a KV cache), the token ids compared with the resident model's.

A weightstream row's link bytes are what one decoder step moves: the streamed and zero-copy groups of
the decoder's blocks (`link_bytes`), not the encoder's, which a step never runs.
"""

from __future__ import annotations

import torch
from torch import nn

from ..dtypes import default_dtype
from .causal_lm import greedy
from .phases import Phase

# T5 v1.1 XXL (google/t5-v1_1-xxl's config), the encoder and the decoder
T5_XXL = dict(model_type="t5", vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24,
              num_decoder_layers=24, num_heads=64, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
              decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, input_source_tokens=64)
TINY_T5_ENCDEC = dict(T5_XXL, vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_decoder_layers=3,
                      num_heads=2, input_source_tokens=8)


def _config(fields: dict):
    from transformers import T5Config

    return T5Config(**{k: v for k, v in fields.items() if k != "model_type" and not k.startswith("input_")})


class Seq2SeqLM:
    """Build, feed and run an encoder-decoder LM (see `shapes.ModelKind`); one instance per shape,
    holding the encoder's states for each batch size."""

    name = "seq2seq-lm"
    dtype_name = "bfloat16"

    def __init__(self, fields: dict) -> None:
        self.source_tokens = fields["input_source_tokens"]
        self.encoder_states: dict[int, torch.Tensor] = {}  # batch -> the encoder's last hidden state
        self.sources: dict[int, torch.Tensor] = {}  # batch -> the source ids

    def build(self, fields: dict, device: torch.device, seed: int) -> nn.Module:
        """Random bf16 weights created on `device` (T5's own initialization), eval mode, no grads."""
        from transformers import T5ForConditionalGeneration

        torch.manual_seed(seed)
        with torch.device(device), default_dtype(torch.bfloat16):
            model = T5ForConditionalGeneration(_config(fields))
        return model.to(device).eval().requires_grad_(False)

    def meta(self, fields: dict) -> nn.Module:
        """The same model on the meta device (no memory): for sizes."""
        from transformers import T5ForConditionalGeneration

        with torch.device("meta"), default_dtype(torch.bfloat16):
            return T5ForConditionalGeneration(_config(fields))

    def inputs(self, model: nn.Module, phases: list[Phase], device: torch.device,
               seed: int) -> dict[str, torch.Tensor]:
        """Per phase: the decoder's input ids (batch, seq), or for `generate-N` the source ids (batch,
        source tokens). The source of each batch size is encoded here, once, by the model as built."""
        gen = torch.Generator().manual_seed(seed + 1)
        vocab = model.config.vocab_size
        home = next(model.parameters()).device
        out = {}
        for p in phases:
            if p.batch not in self.sources:
                src = torch.randint(2, vocab, (p.batch, self.source_tokens), generator=gen)
                with torch.no_grad():
                    states = model.get_encoder()(input_ids=src.to(home)).last_hidden_state
                self.sources[p.batch] = src.to(device)
                self.encoder_states[p.batch] = states.to(device)
            if p.kind == "generate":
                out[p.name] = self.sources[p.batch]
            else:
                out[p.name] = torch.randint(2, vocab, (p.batch, p.seq), generator=gen).to(device)
        return out

    def forward(self, model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """One decoder forward on the fixed encoder states, no KV cache; the logits."""
        states = self.encoder_states[ids.shape[0]]
        return model(encoder_outputs=(states,), decoder_input_ids=ids, use_cache=False).logits

    def generate(self, model: nn.Module, src: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """A greedy generation of `new_tokens` from the source ids; the decoder's token ids."""
        return greedy(model, src, new_tokens, attention_mask=torch.ones_like(src))

    def link_bytes(self, handle) -> int:
        """Bytes one decoder step moves over the link under an offload handle: the decoder blocks'
        streamed groups (each compressed group's blob in place of its raw bytes) and zero-copy groups."""
        engine = handle.engine
        total = 0
        for i, (group, name) in enumerate(zip(engine.groups, handle.streamed_blocks, strict=True)):
            if name.startswith("decoder."):
                raw = sum(e.nbytes for e, _ in group)
                enc = engine.wire[i] if i < len(engine.wire) else None
                total += raw - (engine.group_bytes[i] - enc.wire_bytes) if enc is not None else raw
        for group, name in zip(engine.uva_groups, handle.uva_blocks, strict=True):
            if name.startswith("decoder."):
                total += sum(e.nbytes for e, _ in group)
        return total
