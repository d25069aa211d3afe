"""A self-draft's `nn.Linear` over a low-bit copy: the low-bit matmul where it pays, else the dequantized
weight through the Linear's own matmul.

`quantize.low_bit_linear` states the matmul's arithmetic and `matmul_kernel.py` runs it on CUDA, bit for
bit. Its products run on the CUDA cores, so it pays only for a few rows: measured on an H100
(benchmarks/results/2026-12-07_h100_low-bit-matmul), it beats dequantizing into a bf16 weight for
cuBLAS on the large layers at one row and loses at four; `MAX_ROWS` is where it is used.
"""

from __future__ import annotations

import types

import torch
from torch import nn

MAX_ROWS = 1  # the most rows (tokens) a CUDA low-bit linear runs through its own matmul
WORD_GROUP = 8  # the matmul's groups are multiples of this many columns (a 32-bit word of int4)


def low_bit_linear_for_device(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, bits: int,
                              columns: int, bias: torch.Tensor | None) -> torch.Tensor:
    """`quantize.low_bit_linear`, bit for bit, as one Triton kernel (`matmul_kernel.py`; under
    torch.compile the op `weightstream::low_bit_linear`). For CUDA tensors only: callers go by
    `runs_low_bit_linear`."""
    from . import matmul_kernel  # needs Triton, which the CPU build of torch lacks

    if torch.compiler.is_compiling():
        return torch.ops.weightstream.low_bit_linear(x, values, scales, bits, columns, bias)
    return matmul_kernel.low_bit_linear(x, values, scales, bits, columns, bias)


def low_bit_rows(device: torch.device, rows: int) -> bool:
    """Whether `rows` rows (a draft step's tokens) on `device` are few enough for the low-bit matmul:
    CUDA, at most `MAX_ROWS`."""
    return device.type == "cuda" and rows <= MAX_ROWS


def runs_low_bit_linear(x: torch.Tensor, dtype: torch.dtype, group: int) -> bool:
    """Whether a low-bit linear layer of weight dtype `dtype` in groups of `group` columns runs `x`
    through its own matmul: `low_bit_rows`, x in that dtype, groups of whole 32-bit words; otherwise it
    dequantizes and calls the layer's own matmul."""
    return (x.dim() >= 1 and x.dtype == dtype and group % WORD_GROUP == 0
            and low_bit_rows(x.device, x.numel() // x.shape[-1] if x.shape[-1] else 0))


def low_bit_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The forward of a draft's `nn.Linear` whose weight is a `QuantizedWeight` (set on the instance by
    `use_low_bit_forward`): `low_bit_linear_for_device` where `runs_low_bit_linear`, else the Linear's
    own forward over the dequantized weight."""
    stored = self.parametrizations["weight"]
    how = stored[0]
    # an input of another width goes to the Linear's own forward, which refuses it as any Linear does
    if x.shape[-1:] == (how.columns,) and runs_low_bit_linear(x, how.dtype, how.group):
        return low_bit_linear_for_device(x, stored.original0, stored.original1, how.bits, how.columns,
                                         self.bias)
    return nn.functional.linear(x, self.weight, self.bias)


def use_low_bit_forward(module: nn.Module) -> bool:
    """Give `module` `low_bit_forward` where it is an `nn.Linear` running `nn.Linear`'s own forward whose
    weight `quantize.quantize_parameter` replaced; whether it did."""
    linear = (isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward
              and "weight" in getattr(module, "parametrizations", {}))
    if linear:
        module.forward = types.MethodType(low_bit_forward, module)
    return linear
