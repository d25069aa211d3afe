"""FP8 models as transformers' fine-grained FP8 checkpoints lay them out, runnable anywhere.

transformers 5.x represents such a model with `FP8Linear` modules: `weight` in float8_e4m3fn of shape
(out, in) and `weight_scale_inv` in float32 of shape (ceil(out / bn), ceil(in / bk)) for the block
size [bn, bk] of `quantization_config.weight_block_size` (e.g. [128, 128]). Its forward calls a Triton
kernel that transformers fetches from the Hugging Face Hub at run time (kernels-community/finegrained-
fp8): useless without network and on a CPU. `Fp8Linear` has the same parameters (names, dtypes,
shapes: the same state dict) and a plain PyTorch forward: dequantize the weight block by block into
the activation's dtype on the device, then `F.linear`. weightstream streams the fp8 bytes and their
scales as they are (1 byte a weight, not 2); the dequantize runs where the weight is used.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | None,
               dtype: torch.dtype) -> torch.Tensor:
    """`weight` (fp8, (out, in)) times its per-block `scale_inv` ((ceil(out/bn), ceil(in/bk)), or one
    scalar when `block` is None), in `dtype`."""
    w = weight.to(dtype)
    if block is None:
        return w * scale_inv.to(dtype)
    (n, k), (bn, bk) = weight.shape, block
    s = scale_inv.to(dtype)
    if n % bn == 0 and k % bk == 0:  # broadcast the scales over the blocks: no weight-sized scale tensor
        return (w.view(n // bn, bn, k // bk, bk) * s[:, None, :, None]).view(n, k)
    return w * s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def quantize(weight: torch.Tensor, block: tuple[int, int] | None, dtype: torch.dtype = FP8):
    """(fp8 weight, float32 scale_inv) of a float `weight` (out, in): each block scaled so its largest
    magnitude maps to the fp8 maximum (what transformers' FP8 quantizer does)."""
    top = torch.finfo(dtype).max
    w = weight.float()
    if block is None:
        scale = w.abs().amax().clamp(min=1e-12) / top
        return (w / scale).clamp(-top, top).to(dtype), scale
    (n, k), (bn, bk) = w.shape, block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = F.pad(w, (0, cols * bk - k, 0, rows * bn - n))
    blocks = padded.view(rows, bn, cols, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / top
    q = (blocks / scale[:, None, :, None]).clamp(-top, top).view(rows * bn, cols * bk)[:n, :k]
    return q.to(dtype).contiguous(), scale


class Fp8Linear(nn.Module):
    """A linear layer with an fp8 weight and per-block float32 inverse scales, parameter for
    parameter like transformers' `FP8Linear` (weight, weight_scale_inv, bias)."""

    def __init__(self, in_features: int, out_features: int, block_size: tuple[int, int] | None = (128, 128),
                 bias: bool = False, dtype: torch.dtype = FP8, device: torch.device | str | None = None,
                 bias_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block_size = tuple(block_size) if block_size is not None else None
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        scale_shape = (() if block_size is None
                       else (-(-out_features // block_size[0]), -(-in_features // block_size[1])))
        self.weight_scale_inv = nn.Parameter(torch.empty(scale_shape, dtype=torch.float32, device=device),
                                             requires_grad=False)
        bias_value = torch.empty(out_features, dtype=bias_dtype, device=device) if bias else None
        self.bias = nn.Parameter(bias_value, requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = dequantize(self.weight, self.weight_scale_inv, self.block_size, x.dtype)
        return F.linear(x, weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"block_size={self.block_size}")


def replace_linears(model: nn.Module, block_size: tuple[int, int] | None = (128, 128),
                    skip: tuple[str, ...] = ("lm_head",), dtype: torch.dtype = FP8) -> list[str]:
    """Swap every `nn.Linear` of `model` whose qualified name has no part in `skip` for an empty
    `Fp8Linear` on the same device (meta stays meta), as transformers' FP8 loading does; returns the
    swapped names. Fill the new parameters from a checkpoint or with `quantize_model`."""
    swapped = []
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or any(part in skip for part in name.split(".")) or name in skip:
            continue
        new = Fp8Linear(module.in_features, module.out_features, block_size, module.bias is not None, dtype,
                        module.weight.device, module.weight.dtype)
        model.set_submodule(name, new)
        swapped.append(name)
    return swapped


def quantize_model(model: nn.Module, block_size: tuple[int, int] | None = (128, 128),
                   skip: tuple[str, ...] = ("lm_head",), dtype: torch.dtype = FP8) -> nn.Module:
    """Quantize `model`'s linear layers (but `skip`) to fp8 with per-block scales, in place: the model a
    fine-grained FP8 checkpoint of it would load into. Returns the model."""
    originals = {name: m for name, m in model.named_modules() if type(m) is nn.Linear}
    for name in replace_linears(model, block_size, skip, dtype):
        old, new = originals[name], model.get_submodule(name)
        q, scale = quantize(old.weight.detach(), new.block_size, dtype)
        new.weight.data, new.weight_scale_inv.data = q, scale.to(torch.float32)
        if old.bias is not None:
            new.bias.data = old.bias.detach().clone()
    return model


def convert_for_checkpoint(model: nn.Module, quantization_config: dict) -> list[str]:
    """Give `model` (built from a config, parameters on meta) the FP8 modules its checkpoint's
    `quantization_config` describes (transformers' "fp8" method); returns the swapped names. Raises
    ValueError for what `Fp8Linear` does not compute (static activation scales, UE8M0 scales)."""
    if quantization_config.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"activation_scheme={quantization_config['activation_scheme']!r}: weightstream's "
                         "Fp8Linear computes with dynamic (unquantized) activations only")
    if quantization_config.get("scale_fmt", "float") != "float":
        raise ValueError(f"scale_fmt={quantization_config['scale_fmt']!r}: Fp8Linear reads float32 scales "
                         "only")
    block = quantization_config.get("weight_block_size")
    skip = tuple(quantization_config.get("modules_to_not_convert") or ()) + ("lm_head",)
    return replace_linears(model, tuple(block) if block is not None else None, skip)
