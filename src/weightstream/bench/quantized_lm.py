"""The quantized causal-LM model kind of the bench: the causal LM of `causal_lm.py` with its decoder
linears converted after the random bf16 weights are made, streamed as they are stored (formerly
`benchmarks/bench_quant.py`):

- `fp8`: transformers' fine-grained FP8 layout, float8_e4m3fn weights with 128x128 float32
  `weight_scale_inv`, run through `weightstream.formats.fp8.Fp8Linear` (the LM head stays bf16, as in
  those checkpoints); runs on a CPU too.
- `int4`: torchao int4 weight-only, tinygemm-packed (`tile_packed_to_4d`), group 128, on the decoder
  linears only; needs CUDA and torchao.

The weight bytes of a quantized shape (budgets given as fractions, `shape_weight_bytes`) are its stored
bytes: fp8 from a meta-device build with the FP8 modules in place, int4 estimated (half a byte per
weight plus a bf16 scale and zero point per group of 128).
"""

from __future__ import annotations

import torch
from torch import nn

from .causal_lm import CausalLM

INT4_GROUP = 128


def decoder_linear(module: nn.Module, fqn: str) -> bool:
    """A linear layer inside the decoder blocks (`model.layers.N...`): what int4 quantizes."""
    return isinstance(module, nn.Linear) and ".layers." in f".{fqn}"


class QuantizedLM(CausalLM):
    """A causal LM whose linears are quantized after building (see the module docstring)."""

    name = "quantized-lm"

    def __init__(self, variant: str) -> None:
        if variant not in ("fp8", "int4"):
            raise ValueError(f"quantized variant {variant!r}: fp8 or int4")
        self.variant = variant
        self.dtype_name = "float8_e4m3fn (128x128 scales), bfloat16 rest" if variant == "fp8" else \
            f"int4 weight-only (torchao, group {INT4_GROUP}), bfloat16 rest"
        # what `bench/cli.py` checks before building anything: a CUDA-only kind, a module to import
        self.cuda_only = variant == "int4"
        self.requires = "torchao" if variant == "int4" else None

    def build(self, fields: dict, device: torch.device, seed: int) -> nn.Module:
        """The bf16 model with random weights on `device`, then its linears quantized in place."""
        return self.quantize(super().build(fields, device, seed))

    def quantize(self, model: nn.Module) -> nn.Module:
        if self.variant == "fp8":
            from ..formats import fp8

            return fp8.quantize_model(model, (128, 128))
        from torchao.quantization import Int4WeightOnlyConfig, quantize_

        quantize_(model, Int4WeightOnlyConfig(group_size=INT4_GROUP, int4_packing_format="tile_packed_to_4d"),
                  filter_fn=decoder_linear)
        return model

    def meta(self, fields: dict) -> nn.Module:
        """fp8: the model on the meta device with its FP8 modules. int4: the bf16 model on meta with each
        decoder linear's weight replaced by a uint8 meta tensor of its estimated stored bytes."""
        model = super().meta(fields)
        if self.variant == "fp8":
            from ..formats import fp8

            fp8.replace_linears(model, (128, 128))
            return model
        for name, module in list(model.named_modules()):
            if decoder_linear(module, name):
                n = module.weight.numel()
                stored = n // 2 + 2 * 2 * (n // INT4_GROUP)  # packed nibbles + bf16 scale and zero
                module.weight = nn.Parameter(torch.empty(stored, dtype=torch.uint8, device="meta"),
                                             requires_grad=False)
        return model
