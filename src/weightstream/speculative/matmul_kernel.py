"""The GPU kernel of the self-draft's low-bit linear layers: the matmul reads the packed integers itself.

A draft step runs its linear layers on a few tokens (1 to `MAX_ROWS`), so they are bound by reading the
weights. Dequantizing into a weight buffer that cuBLAS then reads (`dequant_kernel.py`) reads each weight
three times over (integers, then the written weight twice); this kernel reads the integers and scales
once and never writes a weight: y = x W^T (+ bias) with W dequantized in registers.

The arithmetic is `quantize.low_bit_linear`'s, so the bytes are the same: w = q (float32, exact) times its
group's float32 scale, x widened to float32, each product rounded once (a multiply the compiler may not
fuse into the following add: `mul.rn.f32`, which PTX never contracts), added to lane k mod `LANES` of
the output's accumulator in increasing k, the lanes then summed in pairs (0+1, 2+3, ...) until one is
left, the bias added in float32, the result cast to the dtype with round-to-nearest-even (bfloat16 by
hand, as `dequant_kernel.py` does, so Triton's interpreter checks the GPU's rounding on the CPU).

Program p computes outputs [p * BN, (p + 1) * BN) of every row, `UNROLL` steps of `LANES` columns a
loop iteration (their loads issued together); BN shrinks with the rows so a program's accumulator stays
in registers, and with the outputs so a GPU gets enough programs to keep its memory busy; none of these
changes a bit of the result. Eagerly launched straight from Python; under torch.compile
the op `weightstream::low_bit_linear` (a `torch.library.triton_op`), which Inductor launches and a CUDA
graph captures, with no graph break. Imported lazily: the CPU build of torch has no Triton.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .quantize import LANES, MAX_ROWS

_LOG_LANES = LANES.bit_length() - 1
PROGRAMS = 1024  # programs a launch aims for (fewer outputs per program until it has them)
UNROLL = 4  # steps of LANES columns a loop iteration loads together
WARPS = 4


@triton.jit
def _pair_sum(a):
    """Lanes (..., 2j) + (..., 2j + 1) of a (BM, BN, L) block: (BM, BN, L / 2)."""
    even, odd = tl.split(tl.reshape(a, (a.shape[0], a.shape[1], a.shape[2] // 2, 2)))
    return even + odd


@triton.jit
def _low_bit_linear(out, x, values, scales, bias, rows, outputs, columns, stored, value_row, groups,
                    GROUP: tl.constexpr, BITS: tl.constexpr, HAS_BIAS: tl.constexpr, BF16_BITS: tl.constexpr,
                    EXACT_MUL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, L: tl.constexpr,
                    LOG_L: tl.constexpr, UNROLL: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    n_in = n < outputs
    m = tl.arange(0, BM)
    m_in = m < rows
    acc = tl.zeros((BM, BN, L), dtype=tl.float32)
    for k_step in range(0, stored, L * UNROLL):
        for u in tl.static_range(UNROLL):  # unrolled: the loads of every sub-step issued together
            k0 = k_step + u * L
            k = k0 + tl.arange(0, L)
            k_in = k < stored
            xk = tl.load(x + m[:, None] * columns + k[None, :], mask=m_in[:, None] & (k < columns)[None, :],
                         other=0.0).to(tl.float32)
            if BITS == 4:  # the row's bytes read once, contiguously; low nibble the even column
                h = k0 // 2 + tl.arange(0, L // 2)
                byte = tl.load(values + n[:, None].to(tl.int64) * value_row + h[None, :],
                               mask=n_in[:, None] & (h * 2 < stored)[None, :], other=0x88).to(tl.int32)
                q = tl.interleave((byte & 15) - 8, (byte >> 4) - 8)
            else:
                q = tl.load(values + n[:, None].to(tl.int64) * value_row + k[None, :],
                            mask=n_in[:, None] & k_in[None, :], other=0).to(tl.int32)
            s = tl.load(scales + n[:, None].to(tl.int64) * groups + (k // GROUP)[None, :],
                        mask=n_in[:, None] & k_in[None, :], other=0.0)
            w = q.to(tl.float32) * s
            wb, xb = tl.broadcast(w[None, :, :], xk[:, None, :])
            if EXACT_MUL:  # rounded on its own: never fused with the add below
                p = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [wb, xb],
                                              dtype=tl.float32, is_pure=True, pack=1)
            else:  # Triton's interpreter (numpy) rounds every multiply
                p = wb * xb
            acc = acc + p
    for _ in tl.static_range(LOG_L):
        acc = _pair_sum(acc)
    y = tl.reshape(acc, (BM, BN))
    if HAS_BIAS:
        y = y + tl.load(bias + n, mask=n_in, other=0.0).to(tl.float32)[None, :]
    where = out + m[:, None] * outputs + n[None, :]
    ok = m_in[:, None] & n_in[None, :]
    if BF16_BITS:
        b = y.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        b = tl.where(y != y, 0x7FC0, b)
        tl.store(where, b.to(tl.int16), mask=ok)
    else:
        tl.store(where, y.to(out.dtype.element_ty), mask=ok)


def _tile(rows: int, outputs: int) -> tuple[int, int]:
    """(BM, BN): the rows padded to a power of two, and outputs per program: at most 4096 accumulator
    lanes a program (32 registers a thread of 4 warps), and at least about `PROGRAMS` programs where the
    outputs allow it."""
    bm = triton.next_power_of_2(max(rows, 1))
    bn = max(1, 4096 // (bm * LANES))
    while bn > 1 and triton.cdiv(outputs, bn) < PROGRAMS:
        bn //= 2
    return bm, bn


def _launch(kernel, out: torch.Tensor, x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
            bias: torch.Tensor | None, bits: int) -> None:
    x, values, scales = x.contiguous(), values.contiguous(), scales.contiguous()
    columns, outputs = x.shape[-1], out.shape[-1]
    rows = x.numel() // columns if columns else 0
    if rows == 0 or outputs == 0:
        return
    value_row, groups = values.shape[-1], scales.shape[-2]
    stored = value_row * (8 // bits)
    bm, bn = _tile(rows, outputs)
    bf16 = out.dtype == torch.bfloat16
    exact_mul = os.environ.get("TRITON_INTERPRET") != "1"
    kernel[(triton.cdiv(outputs, bn),)](
        out.view(torch.int16) if bf16 else out, x, values, scales, bias if bias is not None else scales,
        rows, outputs, columns, stored, value_row, groups, GROUP=stored // groups, BITS=bits,
        HAS_BIAS=bias is not None, BF16_BITS=bf16, EXACT_MUL=exact_mul, BM=bm, BN=bn, L=LANES,
        LOG_L=_LOG_LANES, UNROLL=UNROLL, num_warps=WARPS)


def low_bit_linear(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, bits: int, columns: int,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """What `quantize.low_bit_linear(x, values, scales, bits, columns, bias)` returns, bit for bit, in one
    launch: x (..., columns) of at most `MAX_ROWS` rows in the weight's dtype; (values, scales) as
    `quantize` stores a (outputs, columns) weight. Launched straight from Python (no op dispatch)."""
    out = torch.empty(*x.shape[:-1], values.shape[0], dtype=x.dtype, device=x.device)
    _launch(_low_bit_linear, out, x, values, scales, bias, bits)
    return out


@torch.library.triton_op("weightstream::low_bit_linear", mutates_args=())
def low_bit_linear_op(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, bits: int, columns: int,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """`low_bit_linear` as the op torch.compile traces (Inductor launches the kernel from its own code)."""
    out = torch.empty(*x.shape[:-1], values.shape[0], dtype=x.dtype, device=x.device)
    _launch(torch.library.wrap_triton(_low_bit_linear), out, x, values, scales, bias, bits)
    return out


assert MAX_ROWS * LANES <= 4096, "a program's accumulator must fit its registers"
