"""The GPU decoder of the wire codec (`codec.py`): one Triton program per chunk, writing the slot.

Each program reads its chunk word (where its escapes start, which segment) and its segment's row from
the blob's header, then decodes the chunk's values in steps: one raw byte (two values share a 16-bit
word), one 16-bit code lane and, for escapes only, one escape byte per value; escapes are ranked with
a prefix sum inside the step. A full chunk runs code compiled for its kind and code width, so that its
loads and stores are vectorized; a tensor's last, partial chunk runs the general code. A raw segment's
chunk is a plain byte copy. Imported lazily: the CPU build of torch has no Triton."""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from . import codec

_STEP = 512  # values per step of a program; CHUNK is a multiple of it
_RAW_STEP = 1024  # bytes per step of a raw chunk; RAW_CHUNK is a multiple of it
_WARPS = 2  # warps per program (`weightstream bench --kind codec --warps ...` sweeps it)


@triton.jit
def _values(blob, raw_ptr, code_ptr, x_ptr, cursor, base, i, m, k, KIND: tl.constexpr, CHUNK: tl.constexpr):
    """The 16-bit values at positions `i` of a chunk (where `m`) and its escapes among them."""
    half = CHUNK // 2  # the raw bytes of values j and half + j share one 16-bit word
    lanes = CHUNK // (16 // k)  # 16-bit code lanes of a chunk: 16 // k codes of k bits in each
    esc = (1 << k) - 1
    raw = (tl.load(raw_ptr + i % half, mask=m, other=0).to(tl.int32) >> (8 * (i // half))) & 0xFF
    lane = tl.load(code_ptr + i % lanes, mask=m, other=0).to(tl.int32) & 0xFFFF
    code = (lane >> (k * (i // lanes))) & esc
    escaped = (code == esc) & m
    flag = escaped.to(tl.int32)
    rank = tl.cumsum(flag, 0) - flag
    got = tl.load(blob + cursor + rank, mask=escaped, other=0).to(tl.int32)
    e = tl.where(escaped, got, (code + base) & 0xFF)
    if KIND == 1:  # bf16
        v = ((raw & 0x80) << 8) | (e << 7) | (raw & 0x7F)
    else:  # fp16: the sign and the top mantissa bits in the 3-bit extra field
        xlanes = CHUNK // 5
        x = ((tl.load(x_ptr + i % xlanes, mask=m, other=0).to(tl.int32) & 0xFFFF) >> (3 * (i // xlanes))) & 7
        v = ((x & 4) << 13) | (e << 10) | ((x & 3) << 8) | raw
    return v.to(tl.int16), tl.sum(flag, 0)


@triton.jit
def _chunk(blob, raw_ptr, code_base, x_ptr, out_ptr, c, cursor, base, limit, k, KIND: tl.constexpr,
           CHUNK: tl.constexpr, STEP: tl.constexpr):
    """Decode chunk `c` of a segment: its first `limit` values. A full chunk is decoded by code
    compiled for its kind and code width (`limit` and `k` constants), which is what lets the loads
    and stores be vectorized (2.2x faster on an H200:
    benchmarks/results/2026-12-04_h200_decoder/diag_decoder_variants.log)."""
    code_ptr = (code_base + c * (2 * (CHUNK // (16 // k)))).to(tl.pointer_type(tl.int16))
    for b in range(0, CHUNK, STEP):
        i = b + tl.arange(0, STEP)
        m = i < limit
        v, count = _values(blob, raw_ptr, code_ptr, x_ptr, cursor, base, i, m, k, KIND, CHUNK)
        tl.store(out_ptr + i, v, mask=m)
        cursor += count


@triton.jit
def _decode_kernel(blob, out, CHUNK: tl.constexpr, RAW_CHUNK: tl.constexpr, STEP: tl.constexpr,
                   RAW_STEP: tl.constexpr, HEADER_WORDS: tl.constexpr, SEGMENT_WORDS: tl.constexpr):
    pid = tl.program_id(0)
    words = blob.to(tl.pointer_type(tl.int64))
    chunk_word = tl.load(words + HEADER_WORDS + pid)
    row = words + HEADER_WORDS + tl.num_programs(0) + SEGMENT_WORDS * (chunk_word >> 40)
    kind = tl.load(row)
    n = tl.load(row + 1)
    dst = tl.multiple_of(tl.load(row + 2), 16)  # encode_group refuses tensors at unaligned offsets
    raw_off = tl.multiple_of(tl.load(row + 3), 16)  # every plane starts 16-byte aligned
    params = tl.load(row + 7)
    c = pid - (params >> 24)
    if kind == 0:  # raw bytes
        start = c * RAW_CHUNK
        src = blob + raw_off + start
        to = out + dst + start
        if n - start >= RAW_CHUNK:
            for b in range(0, RAW_CHUNK, RAW_STEP):
                j = b + tl.arange(0, RAW_STEP)
                tl.store(to + j, tl.load(src + j))
        else:
            for b in range(0, RAW_CHUNK, RAW_STEP):
                j = b + tl.arange(0, RAW_STEP)
                m = j < n - start
                tl.store(to + j, tl.load(src + j, mask=m), mask=m)
    else:
        codes = blob + tl.multiple_of(tl.load(row + 4), 16)
        xs = blob + tl.multiple_of(tl.load(row + 5), 16) + c * (2 * (CHUNK // 5))
        xs = xs.to(tl.pointer_type(tl.int16))
        k = (params & 0xFF).to(tl.int32)
        base = ((params >> 8) & 0xFF).to(tl.int32)
        valid = n - c * CHUNK
        cursor = chunk_word & 0xFFFFFFFFFF  # this chunk's first escape (byte offset in the blob)
        raws = (blob + raw_off + c * CHUNK).to(tl.pointer_type(tl.int16))
        dest = (out + dst).to(tl.pointer_type(tl.int16)) + c * CHUNK
        if valid >= CHUNK:  # a full chunk: code compiled for each kind and code width
            if kind == 1:
                if k == 1:
                    _chunk(blob, raws, codes, xs, dest, c, cursor, base, CHUNK, 1, 1, CHUNK, STEP)
                elif k == 2:
                    _chunk(blob, raws, codes, xs, dest, c, cursor, base, CHUNK, 2, 1, CHUNK, STEP)
                elif k == 3:
                    _chunk(blob, raws, codes, xs, dest, c, cursor, base, CHUNK, 3, 1, CHUNK, STEP)
                else:
                    _chunk(blob, raws, codes, xs, dest, c, cursor, base, CHUNK, 4, 1, CHUNK, STEP)
            else:
                if k == 1:
                    _chunk(blob, raws, codes, xs, dest, c, cursor, base, CHUNK, 1, 2, CHUNK, STEP)
                elif k == 2:
                    _chunk(blob, raws, codes, xs, dest, c, cursor, base, CHUNK, 2, 2, CHUNK, STEP)
                elif k == 3:
                    _chunk(blob, raws, codes, xs, dest, c, cursor, base, CHUNK, 3, 2, CHUNK, STEP)
                else:
                    _chunk(blob, raws, codes, xs, dest, c, cursor, base, CHUNK, 4, 2, CHUNK, STEP)
        elif kind == 1:  # a tensor's last chunk, `valid` values: the code width at run time
            _chunk(blob, raws, codes, xs, dest, c, cursor, base, valid, k, 1, CHUNK, STEP)
        else:
            _chunk(blob, raws, codes, xs, dest, c, cursor, base, valid, k, 2, CHUNK, STEP)


def decode(blob: torch.Tensor, out: torch.Tensor, chunks: int) -> None:
    """Enqueue the decode of `blob` (a CUDA uint8 tensor starting with an encoded group; it may be
    longer) into `out` (CUDA uint8, the group's layout) on the current stream. `chunks` is the
    group's `EncodedGroup.chunks`. No host synchronization: safe inside CUDA-graph capture."""
    if chunks:
        with torch.cuda.device(out.device) if out.is_cuda else contextlib.nullcontext():
            _decode_kernel[(chunks,)](blob, out, CHUNK=codec.CHUNK, RAW_CHUNK=codec.RAW_CHUNK, STEP=_STEP,
                                      RAW_STEP=_RAW_STEP, HEADER_WORDS=codec.HEADER_WORDS,
                                      SEGMENT_WORDS=codec.SEGMENT_WORDS, num_warps=_WARPS)


def decode_seconds_per_byte(device: torch.device, nbytes: int = 256 << 20) -> float:
    """Median decode time per output byte of `nbytes` of Hugging Face-initialized bf16 weights."""
    import statistics

    from ..placement.timing import time_calls

    weights = (torch.randn(nbytes // 2, device=device) * 0.02).bfloat16()
    enc = codec.encode_group([(weights, 0)], nbytes, device=device)
    blob = enc.blob.to(device)
    out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for _ in range(3):
        decode(blob, out, enc.chunks)
    times, _ = time_calls(lambda: decode(blob, out, enc.chunks), 10, device, back_to_back=False)
    return statistics.median(times) / 1e3 / nbytes
