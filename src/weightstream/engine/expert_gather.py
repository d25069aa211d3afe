"""The GPU kernel of the expert cache (`expert_cache.py`): copy rows chosen by an index table, each from
one of two sources, with a launch whose shape never depends on the table.

Program (i, c) copies chunk c of row i: when `dst_row[i]` >= 0 it reads row `src_row[i]` of `src1`
(where `which[i]` is nonzero) or of `src0`, and writes row `dst_row[i]` of `dst`; otherwise it returns at
once. So a CUDA graph captures one launch that copies whatever rows the table names at replay, and a
source in pinned host memory (a zero-copy view) is read only for the rows named. Rows are words of the
widest integer type that divides the row bytes and every base address. Imported lazily: the CPU build
of torch has no Triton. `expert_cache.copy_rows_reference` is the same copy in plain torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 2048  # words per program


@triton.jit
def _copy_rows(dst, src0, src1, dst_row, src_row, which, row_words, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    c = tl.program_id(1)
    d = tl.load(dst_row + i)
    if d >= 0:
        s = tl.load(src_row + i).to(tl.int64)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        m = offs < row_words
        if tl.load(which + i) != 0:
            v = tl.load(src1 + s * row_words + offs, mask=m)
        else:
            v = tl.load(src0 + s * row_words + offs, mask=m)
        tl.store(dst + d.to(tl.int64) * row_words + offs, v, mask=m)


def _word(*rows: torch.Tensor) -> torch.dtype:
    """The widest integer type whose size divides every row's bytes and base address."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if all(r.shape[1] % size == 0 and r.data_ptr() % size == 0 for r in rows):
            return dtype
    return torch.uint8


def copy_rows(dst: torch.Tensor, src0: torch.Tensor, src1: torch.Tensor, dst_row: torch.Tensor,
              src_row: torch.Tensor, which: torch.Tensor) -> None:
    """`dst[dst_row[i]] = (src1 if which[i] else src0)[src_row[i]]` for every i with dst_row[i] >= 0.
    dst, src0, src1: contiguous uint8 [rows, row bytes] of one row size; dst_row, src_row: int64 [n];
    which: bool or integer [n]. One launch of n x chunks programs; no host synchronization."""
    word = _word(dst, src0, src1)
    dst, src0, src1 = (t.view(word) for t in (dst, src0, src1))
    n, row_words = dst_row.numel(), dst.shape[1]
    if n == 0 or row_words == 0:
        return
    grid = (n, triton.cdiv(row_words, _BLOCK))
    _copy_rows[grid](dst, src0, src1, dst_row, src_row, which.to(torch.int8), row_words, BLOCK=_BLOCK)
