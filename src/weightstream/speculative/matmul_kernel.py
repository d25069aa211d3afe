"""The GPU kernel of the self-draft's low-bit linear layers: the matmul reads the packed integers itself.

A draft step runs its linear layers on a few tokens, so they are bound by reading the weights.
Dequantizing into a weight buffer that cuBLAS then reads (`dequant_kernel.py`) reads each weight three
times over (integers, then the written weight twice); this kernel reads the integers and scales once
and never writes a weight: y = x W^T (+ bias) with W dequantized in registers.

The arithmetic is `quantize.low_bit_linear`'s, so the bytes are the same: w = q (float32, exact) times its
group's float32 scale, x widened to float32, each product rounded once (a multiply the compiler may not
fuse into the following add: `mul.rn.f32`, which PTX never contracts), added to lane k mod `LANES` of
the output's accumulator in increasing k, the lanes then summed in pairs (0+1, 2+3, ...) until one is
left, the bias added in float32, the result cast to the dtype with round-to-nearest-even (bfloat16 by
hand, as `dequant_kernel.py` does, so Triton's interpreter checks the GPU's rounding on the CPU).

Program p computes outputs [p * BN, (p + 1) * BN) of every row, `UNROLL` steps of `LANES` columns a
loop iteration (their loads issued together). It reads the integers as 32-bit words (8 int4 or 4 int8
columns each) and x as float32 rearranged by residue (`_launch`: residue r of row m holds columns
W i + r, so word i's column r meets x contiguously); lane W i + r of the contract is accumulator r's
element i, the sums between the W accumulators are the pairwise sum's first levels, and every block
is (rows, outputs, words) from its load on, so no product changes layout and every load is a 16-byte
vector. Where a group holds whole steps a row loads one scale a step. BN shrinks with the rows so a
program's accumulator stays in registers, and with the outputs so a GPU gets enough programs to keep
its memory busy. None of the tiling (`PROGRAMS`, `UNROLL`, `WARPS`, `ACCUMULATOR`) changes a bit of the
result. Groups must be multiples of 8 columns (a word never straddles two). Eagerly launched straight
from Python; under torch.compile the op `weightstream::low_bit_linear` (a `torch.library.triton_op`),
which Inductor launches and a CUDA graph captures, with no graph break. Imported lazily: the CPU build
of torch has no Triton.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .quantize import LANES

# the tiling (none of it changes a bit of the result: tests/speculative/interpreted_matmul_kernel.py)
PROGRAMS = 1024  # programs a launch aims for (fewer outputs per program until it has them)
UNROLL = 2  # steps of LANES columns a loop iteration loads together
WARPS = 2
ACCUMULATOR = 4096  # at most this many float32 accumulator lanes a program


@triton.jit
def _pair_sum(a):
    """Lanes (..., 2j) + (..., 2j + 1) of a (BM, BN, L) block: (BM, BN, L / 2)."""
    even, odd = tl.split(tl.reshape(a, (a.shape[0], a.shape[1], a.shape[2] // 2, 2)))
    return even + odd


@triton.jit
def _product(w, x, EXACT_MUL: tl.constexpr):
    """w * x broadcast to one shape, rounded once: `mul.rn.f32` on a GPU (never fused with the add that
    follows), numpy's multiply in Triton's interpreter."""
    w, x = tl.broadcast(w, x)
    if EXACT_MUL:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [w, x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    return w * x


@triton.jit
def _nibble(word, R: tl.constexpr):
    """int4 value R of each 32-bit word (column 8i + R of word i), as float32."""
    return (((word >> (4 * R)) & 15) - 8).to(tl.float32)


@triton.jit
def _byte(word, R: tl.constexpr):
    """int8 value R of each 32-bit word (column 4i + R of word i), sign-extended, as float32."""
    return ((word << (24 - 8 * R)) >> 24).to(tl.float32)


@triton.jit
def _term(word, R: tl.constexpr, s, x_at, x_in, BITS: tl.constexpr, EXACT_MUL: tl.constexpr):
    """Residue R's products of a step: its integers of each word times their scale `s`, times x's
    residue R (at `x_at`)."""
    q = _nibble(word, R) if BITS == 4 else _byte(word, R)
    return _product(q * s, tl.load(x_at, mask=x_in, other=0.0), EXACT_MUL)


@triton.jit
def _low_bit_linear(out, x, words, scales, bias, rows, outputs, steps, x_residue, words_row, stored_words,
                    groups, GROUP: tl.constexpr, BITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BF16_BITS: tl.constexpr, EXACT_MUL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    L: tl.constexpr, UNROLL: tl.constexpr):
    # W columns a 32-bit word; every block is (rows, outputs, L / W words) from its load on, and every
    # load reads 4-byte elements contiguously, so loads and products share one layout
    W: tl.constexpr = 32 // BITS
    P: tl.constexpr = L // W
    n = (tl.program_id(0) * BN + tl.arange(0, BN))[None, :, None]
    m = tl.arange(0, BM)[:, None, None]
    i = tl.arange(0, P)[None, None, :]
    n_in = n < outputs
    m_in = m < rows
    weight_at = words + (n.to(tl.int64) * words_row + m * 0) + i  # (BM, BN, P): each row's words
    x_at = x + (m * (W * x_residue) + n * 0) + i  # residue r of row m: x_at + r * x_residue
    scale_row = scales + n.to(tl.int64) * groups
    a0 = tl.zeros((BM, BN, P), dtype=tl.float32)
    a1 = tl.zeros((BM, BN, P), dtype=tl.float32)
    a2 = tl.zeros((BM, BN, P), dtype=tl.float32)
    a3 = tl.zeros((BM, BN, P), dtype=tl.float32)
    if BITS == 4:
        a4 = tl.zeros((BM, BN, P), dtype=tl.float32)
        a5 = tl.zeros((BM, BN, P), dtype=tl.float32)
        a6 = tl.zeros((BM, BN, P), dtype=tl.float32)
        a7 = tl.zeros((BM, BN, P), dtype=tl.float32)
    for t_step in range(0, steps, UNROLL):
        for u in tl.static_range(UNROLL):  # unrolled: the loads of every sub-step issued together
            t = t_step + u
            word_in = n_in & (t < steps) & (t * P + i < stored_words)
            word = tl.load(weight_at + t * P, mask=word_in, other=0)
            if GROUP % L == 0:  # one scale a row a step
                s = tl.load(scale_row + (t * L) // GROUP, mask=n_in & (t < steps), other=0.0)
            else:  # a word's columns share their group (groups are multiples of W)
                s = tl.load(scale_row + (t * L + W * i) // GROUP, mask=word_in, other=0.0)
            x_in = m_in & (t < steps)
            xt = x_at + t * P
            a0 += _term(word, 0, s, xt, x_in, BITS, EXACT_MUL)
            a1 += _term(word, 1, s, xt + x_residue, x_in, BITS, EXACT_MUL)
            a2 += _term(word, 2, s, xt + 2 * x_residue, x_in, BITS, EXACT_MUL)
            a3 += _term(word, 3, s, xt + 3 * x_residue, x_in, BITS, EXACT_MUL)
            if BITS == 4:
                a4 += _term(word, 4, s, xt + 4 * x_residue, x_in, BITS, EXACT_MUL)
                a5 += _term(word, 5, s, xt + 5 * x_residue, x_in, BITS, EXACT_MUL)
                a6 += _term(word, 6, s, xt + 6 * x_residue, x_in, BITS, EXACT_MUL)
                a7 += _term(word, 7, s, xt + 7 * x_residue, x_in, BITS, EXACT_MUL)
    # the pairwise sum's first levels are between the residues' accumulators: lane W i + r is a_r[i]
    if BITS == 4:
        acc = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))
    else:
        acc = (a0 + a1) + (a2 + a3)
    for _ in tl.static_range(P.bit_length() - 1):
        acc = _pair_sum(acc)
    y = tl.reshape(acc, (BM, BN))
    n2 = tl.program_id(0) * BN + tl.arange(0, BN)
    m2 = tl.arange(0, BM)
    if HAS_BIAS:
        y = y + tl.load(bias + n2, mask=n2 < outputs, other=0.0).to(tl.float32)[None, :]
    where = out + m2[:, None] * outputs + n2[None, :]
    ok = (m2 < rows)[:, None] & (n2 < outputs)[None, :]
    if BF16_BITS:
        b = y.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        b = tl.where(y != y, 0x7FC0, b)
        tl.store(where, b.to(tl.int16), mask=ok)
    else:
        tl.store(where, y.to(out.dtype.element_ty), mask=ok)


def _tile(rows: int, outputs: int) -> tuple[int, int]:
    """(BM, BN): the rows padded to a power of two, and outputs per program: at most `ACCUMULATOR`
    accumulator lanes a program, and at least about `PROGRAMS` programs where the outputs allow it."""
    bm = triton.next_power_of_2(max(rows, 1))
    bn = max(1, ACCUMULATOR // (bm * LANES))
    while bn > 1 and triton.cdiv(outputs, bn) < PROGRAMS:
        bn //= 2
    return bm, bn


def _launch(kernel, out: torch.Tensor, x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
            bias: torch.Tensor | None, bits: int) -> None:
    columns, outputs = x.shape[-1], out.shape[-1]
    rows = x.numel() // columns if columns else 0
    if rows == 0 or outputs == 0:
        return
    per_word = 32 // bits
    stored = values.shape[-1] * (8 // bits)
    total = -(-stored // LANES) * LANES
    # x as float32, zero-padded to whole steps, residue-major: residue r of row m holds columns W i + r
    xs = torch.nn.functional.pad(x.reshape(rows, columns).float(), (0, total - columns))
    xs = xs.reshape(rows, total // per_word, per_word).transpose(1, 2).contiguous()
    words = values.contiguous().view(torch.int32)
    scales = scales.contiguous()
    bm, bn = _tile(rows, outputs)
    bf16 = out.dtype == torch.bfloat16
    exact_mul = os.environ.get("TRITON_INTERPRET") != "1"
    kernel[(triton.cdiv(outputs, bn),)](
        out.view(torch.int16) if bf16 else out, xs, words, scales, bias if bias is not None else scales,
        rows, outputs, total // LANES, total // per_word, words.shape[-1], stored // per_word,
        scales.shape[-2], GROUP=stored // scales.shape[-2], BITS=bits, HAS_BIAS=bias is not None,
        BF16_BITS=bf16, EXACT_MUL=exact_mul, BM=bm, BN=bn, L=LANES, UNROLL=UNROLL, num_warps=WARPS)


def low_bit_linear(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, bits: int, columns: int,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """What `quantize.low_bit_linear(x, values, scales, bits, columns, bias)` returns, bit for bit, in one
    launch: x (..., columns) in the weight's dtype, a few rows (beyond 32 a program's accumulator no
    longer fits its registers; `draft_linear.MAX_ROWS` is where it is used); (values, scales) as
    `quantize` stores a (outputs, columns) weight, in groups of whole 32-bit words. Launched straight
    from Python (no op dispatch)."""
    if x.shape[-1:] != (columns,):
        raise ValueError(f"low_bit_linear: x of shape {tuple(x.shape)} for a weight of {columns} columns")
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
