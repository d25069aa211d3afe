"""The GPU kernel of the self-draft's low-bit copies (`quantize.py`): dequantize in one pass.

`quantize.dequantize` in plain torch runs about six full passes over a weight per call (unpack the
nibbles, widen, float32, times the scales, the cut, the cast); this kernel reads the packed integers and
the float32 group scales once and writes the weight in its dtype once. The arithmetic is the
reference's, so the bytes are the same: an int4 byte holds q + 8 (the even column in the low nibble),
q goes to float32 exactly, is multiplied by its group's float32 scale (one rounding, no fused add) and
is cast to the dtype with round-to-nearest-even (for bfloat16 by hand, as torch does it). Program
(r, c) writes columns [c * BLOCK, (c + 1) * BLOCK) of row r. Eagerly the kernel is launched straight
from Python; under torch.compile it is the op `weightstream::dequantize_low_bit` (a
`torch.library.triton_op`), which Inductor launches from its own code and a CUDA graph captures, with
no graph break. Imported lazily: the CPU build of torch has no Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024  # output columns per program


@triton.jit
def _dequantize(out, values, scales, columns, value_row, groups, GROUP: tl.constexpr, BITS: tl.constexpr,
                BF16_BITS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < columns
    if BITS == 4:  # the block's bytes read once, contiguously; low nibble the even column
        h = tl.program_id(1) * (BLOCK // 2) + tl.arange(0, BLOCK // 2)
        byte = tl.load(values + r * value_row + h, mask=h * 2 < columns, other=0).to(tl.int32)
        q = tl.interleave((byte & 15) - 8, (byte >> 4) - 8)
    else:
        q = tl.load(values + r * value_row + c, mask=m, other=0).to(tl.int32)
    s = tl.load(scales + r * groups + c // GROUP, mask=m, other=0.0)
    w = q.to(tl.float32) * s
    if BF16_BITS:
        # round to nearest even by hand, as torch does (NaN to 0x7FC0): Triton's interpreter truncates a
        # float32 -> bfloat16 cast, so the CPU test could not check the GPU's rounding otherwise
        b = w.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        b = tl.where(w != w, 0x7FC0, b)
        tl.store(out + r * columns + c, b.to(tl.int16), mask=m)
    else:
        tl.store(out + r * columns + c, w.to(out.dtype.element_ty), mask=m)


def _launch(kernel, out: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, bits: int) -> None:
    values, scales = values.contiguous(), scales.contiguous()
    columns, groups, value_row = out.shape[-1], scales.shape[-2], values.shape[-1]
    rows = out.numel() // columns if columns else 0
    if rows == 0:
        return
    group = value_row * (8 // bits) // groups
    bf16 = out.dtype == torch.bfloat16
    grid = (rows, triton.cdiv(columns, _BLOCK))
    kernel[grid](out.view(torch.int16) if bf16 else out, values, scales, columns, value_row, groups,
                 GROUP=group, BITS=bits, BF16_BITS=bf16, BLOCK=_BLOCK)


def dequantize(values: torch.Tensor, scales: torch.Tensor, bits: int, columns: int,
               dtype: torch.dtype) -> torch.Tensor:
    """What `quantize.dequantize(values, scales, bits, columns, dtype)` returns, bit for bit, in one
    launch of rows x ceil(columns / 1024) programs: a new tensor (..., columns) in `dtype` on `values`'
    device. Launched straight from Python: a custom op's dispatch costs about 15 us a call eagerly, some
    2.5 ms a draft step of 168 drafted weights."""
    out = torch.empty(*values.shape[:-1], columns, dtype=dtype, device=values.device)
    _launch(_dequantize, out, values, scales, bits)
    return out


@torch.library.triton_op("weightstream::dequantize_low_bit", mutates_args=())
def dequantize_op(values: torch.Tensor, scales: torch.Tensor, bits: int, columns: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """`dequantize` as the op torch.compile traces: Inductor sees the Triton kernel and launches it from
    its own code (and a CUDA graph captures it), with no graph break."""
    out = torch.empty(*values.shape[:-1], columns, dtype=dtype, device=values.device)
    _launch(torch.library.wrap_triton(_dequantize), out, values, scales, bits)
    return out
