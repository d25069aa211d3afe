"""Symmetric weight-only quantization in pure torch: the low-bit copies a self-draft keeps on the GPU.

A weight of shape (..., K) is cut along its last dimension (a Linear's input columns) into groups of
`group` values; a row whose K the group does not divide has a shorter last group (the row is padded
with zeros, which change no scale, and the padding is cut off again). Each group has one float32
scale, max |w| / qmax (qmax 127 for 8 bits, 7 for 4 bits), and integers round(w / scale) clamped to
[-qmax, qmax]: a symmetric grid, so a value is off by at most half its group's scale. int8 values are
stored as int8; int4 values as q + 8 in [1, 15], two per byte (the even column in the low nibble).
A module's forward dequantizes (q * scale in float32, cast to the weight's dtype) and then runs its own
matmul (`QuantizedWeight`, a torch parametrization). `dequantize` here is the reference and the CPU
path; on CUDA the same arithmetic runs as one Triton kernel (`dequant_kernel.py`), bit for bit.

A `torch.nn.Linear` of the draft runs on a few tokens at a time, where reading its weight is the whole
cost: `low_bit_linear` here is the reference of a matmul that reads the integers itself
(`matmul_kernel.py`, bit for bit), which a drafted Linear runs where it pays (`draft_linear.py`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

BITS = (4, 8)
LEAST_GROUP = 64
LANES = 128  # low_bit_linear's accumulator lanes per output (its order of additions)


def qmax(bits: int) -> int:
    """The largest integer of the symmetric grid: 7 for 4 bits, 127 for 8 bits."""
    return (1 << (bits - 1)) - 1


def padded(columns: int, group: int) -> int:
    """`columns` rounded up to whole groups."""
    return math.ceil(columns / group) * group


def quantized_bytes(shape: tuple[int, ...] | torch.Size, bits: int, group: int) -> int:
    """Bytes of the integers and float32 scales of a weight of `shape` quantized to `bits` in groups of
    `group` along its last dimension."""
    rows = math.prod(shape[:-1])
    columns = padded(shape[-1], group)
    return rows * columns * bits // 8 + rows * (columns // group) * 4


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int values in [-8, 7] of shape (..., 2n) to (..., n) uint8: q + 8, the even column in the low
    nibble, the odd one in the high nibble."""
    u = (q + 8).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`: (..., n) uint8 to (..., 2n) int8 in [-8, 7]."""
    pairs = torch.stack([packed & 15, packed >> 4], dim=-1)
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2).to(torch.int8) - 8


def quantize(weight: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, scales) of `weight` (..., K): values (..., padded K) int8 for 8 bits or (..., padded K
    / 2) uint8 for 4 bits, scales (..., groups, 1) float32. Computed in float32 on the weight's
    device."""
    columns = weight.shape[-1]
    w = weight.detach().float()
    w = torch.nn.functional.pad(w, (0, padded(columns, group) - columns))
    grouped = w.reshape(*w.shape[:-1], -1, group)
    top = qmax(bits)
    scales = grouped.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / top
    q = (grouped / scales).round().clamp(-top, top).to(torch.int8).reshape(w.shape)
    return (pack_int4(q) if bits == 4 else q), scales


def dequantize(values: torch.Tensor, scales: torch.Tensor, bits: int, columns: int,
               dtype: torch.dtype) -> torch.Tensor:
    """The weight (..., columns) in `dtype` that `quantize` stored as (values, scales)."""
    q = unpack_int4(values) if bits == 4 else values
    grouped = q.reshape(*scales.shape[:-1], -1).float() * scales
    return grouped.reshape(*q.shape)[..., :columns].to(dtype)


def dequantize_for_device(values: torch.Tensor, scales: torch.Tensor, bits: int, columns: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """`dequantize`, bit for bit: on CUDA one Triton kernel (one read of the integers and scales, one
    write of the weight; under torch.compile the traceable op `weightstream::dequantize_low_bit`),
    elsewhere the reference."""
    if not values.is_cuda:
        return dequantize(values, scales, bits, columns, dtype)
    from . import dequant_kernel  # needs Triton, which the CPU build of torch lacks

    if torch.compiler.is_compiling():
        return torch.ops.weightstream.dequantize_low_bit(values, scales, bits, columns, dtype)
    return dequant_kernel.dequantize(values, scales, bits, columns, dtype)


def low_bit_linear(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, bits: int, columns: int,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., columns) times the transpose of the (outputs, columns) weight that `quantize` stored as
    (values, scales), plus `bias`, in x's dtype, with this arithmetic (the contract `matmul_kernel.py`
    meets bit for bit): w = q * scale and x in float32; the columns padded with zeros to whole groups
    and then to a multiple of `LANES`; each product rounded once and added to lane k mod `LANES` of its
    output in increasing k (from +0.0); the lanes summed in pairs, (0+1, 2+3, ...), until one is left;
    plus the bias in float32; cast to x's dtype. The reference: memory (rows x outputs x LANES)."""
    q = unpack_int4(values) if bits == 4 else values
    stored = q.shape[-1]
    w = (q.reshape(*scales.shape[:-1], -1).float() * scales).reshape(q.shape)
    total = padded(stored, LANES)
    w = torch.nn.functional.pad(w, (0, total - stored)).reshape(q.shape[0], -1, LANES)
    xs = torch.nn.functional.pad(x.reshape(-1, columns).float(), (0, total - columns))
    xs = xs.reshape(xs.shape[0], -1, LANES)
    acc = torch.zeros(xs.shape[0], w.shape[0], LANES, dtype=torch.float32, device=x.device)
    for step in range(w.shape[1]):
        acc = acc + w[None, :, step] * xs[:, None, step]
    while acc.shape[-1] > 1:
        acc = acc[..., 0::2] + acc[..., 1::2]
    y = acc[..., 0]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], q.shape[0])


class QuantizedWeight(nn.Module):
    """A parametrization (`torch.nn.utils.parametrize`): the module stores (values, scales) and reads
    its weight dequantized on each access (`dequantize_for_device`), so the module's own forward runs on the
    low-bit copy."""

    def __init__(self, bits: int, group: int, columns: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.bits, self.group, self.columns, self.dtype = bits, group, columns, dtype

    def forward(self, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return dequantize_for_device(values, scales, self.bits, self.columns, self.dtype)

    def right_inverse(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize(weight, self.bits, self.group)


def quantize_parameter(module: nn.Module, name: str, bits: int, group: int) -> int:
    """Replace `module.<name>` (a weight of two or more dimensions, already where the draft runs) by its
    quantized copy read through `QuantizedWeight`; return the bytes now stored."""
    from torch.nn.utils import parametrize

    weight = getattr(module, name)
    parametrize.register_parametrization(
        module, name, QuantizedWeight(bits, group, weight.shape[-1], weight.dtype), unsafe=True)
    stored = module.parametrizations[name]
    return sum(t.numel() * t.element_size() for t in (stored.original0, stored.original1))
