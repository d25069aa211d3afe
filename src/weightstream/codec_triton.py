"""The GPU decoder of the wire codec (`codec.py`): one Triton program per chunk, writing the slot.

Each program reads its chunk word (where its escapes start, which segment) and its segment's row from
the blob's header, then decodes the chunk's values in blocks: one raw byte, one 16-bit code lane and,
for escapes only, one escape byte per value; escapes are ranked with a prefix sum inside the block.
A raw segment's chunk is a plain byte copy. Imported lazily: the CPU build of torch has no Triton.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from . import codec

_BLOCK = 512  # values per step; CHUNK is a multiple of it
_WARPS = 4  # warps per program (benchmarks/bench_decoder.py sweeps it)


@triton.jit
def _decode_kernel(blob, out, CHUNK: tl.constexpr, RAW_CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                   HEADER_WORDS: tl.constexpr, SEGMENT_WORDS: tl.constexpr):
    pid = tl.program_id(0)
    words = blob.to(tl.pointer_type(tl.int64))
    chunk_word = tl.load(words + HEADER_WORDS + pid)
    seg = chunk_word >> 40
    row = words + HEADER_WORDS + tl.num_programs(0) + SEGMENT_WORDS * seg
    kind = tl.load(row)
    n = tl.load(row + 1)
    dst = tl.load(row + 2)
    raw_off = tl.load(row + 3)
    params = tl.load(row + 7)
    c = pid - (params >> 24)
    offs = tl.arange(0, BLOCK)
    if kind == 0:  # raw bytes
        start = c * RAW_CHUNK
        for b in range(0, RAW_CHUNK, BLOCK):
            i = start + b + offs
            m = i < n
            tl.store(out + dst + i, tl.load(blob + raw_off + i, mask=m), mask=m)
    else:
        code_off = tl.load(row + 4)
        x_off = tl.load(row + 5)
        k = (params & 0xFF).to(tl.int32)
        base = ((params >> 8) & 0xFF).to(tl.int32)
        esc = (1 << k) - 1
        lanes = CHUNK // (16 // k)  # code lanes per row
        valid = n - c * CHUNK
        raw_ptr = blob + raw_off + c * CHUNK
        code_ptr = (blob + code_off + c * (2 * lanes)).to(tl.pointer_type(tl.int16))
        x_ptr = (blob + x_off + c * (2 * (CHUNK // 5))).to(tl.pointer_type(tl.int16))
        out_ptr = (out + dst).to(tl.pointer_type(tl.int16)) + c * CHUNK
        cursor = chunk_word & 0xFFFFFFFFFF  # this chunk's next escape (byte offset in the blob)
        for b in range(0, CHUNK, BLOCK):
            i = b + offs
            m = i < valid
            raw = tl.load(raw_ptr + 2 * (i % (CHUNK // 2)) + i // (CHUNK // 2), mask=m, other=0).to(tl.int32)
            lane = tl.load(code_ptr + i % lanes, mask=m, other=0).to(tl.int32) & 0xFFFF
            code = (lane >> (k * (i // lanes))) & esc
            escaped = (code == esc) & m
            flag = escaped.to(tl.int32)
            rank = tl.cumsum(flag, 0) - flag
            got = tl.load(blob + cursor + rank, mask=escaped, other=0).to(tl.int32)
            e = tl.where(escaped, got, (code + base) & 0xFF)
            cursor += tl.sum(flag, 0)
            if kind == 1:  # bf16
                v = ((raw & 0x80) << 8) | (e << 7) | (raw & 0x7F)
            else:  # fp16: sign and top mantissa bits in the 3-bit extra field
                xl = tl.load(x_ptr + i % (CHUNK // 5), mask=m, other=0).to(tl.int32) & 0xFFFF
                x = (xl >> (3 * (i // (CHUNK // 5)))) & 7
                v = ((x & 4) << 13) | (e << 10) | ((x & 3) << 8) | raw
            tl.store(out_ptr + i, v.to(tl.int16), mask=m)


def decode(blob: torch.Tensor, out: torch.Tensor, chunks: int) -> None:
    """Enqueue the decode of `blob` (a CUDA uint8 tensor starting with an encoded group; it may be
    longer) into `out` (CUDA uint8, the group's layout) on the current stream. `chunks` is the
    group's `EncodedGroup.chunks`. No host synchronization: safe inside CUDA-graph capture."""
    if chunks:
        with torch.cuda.device(out.device) if out.is_cuda else contextlib.nullcontext():
            _decode_kernel[(chunks,)](blob, out, CHUNK=codec.CHUNK, RAW_CHUNK=codec.RAW_CHUNK, BLOCK=_BLOCK,
                                      HEADER_WORDS=codec.HEADER_WORDS, SEGMENT_WORDS=codec.SEGMENT_WORDS,
                                      num_warps=_WARPS)


def decode_seconds_per_byte(device: torch.device, nbytes: int = 256 << 20) -> float:
    """Median decode time per output byte of `nbytes` of Hugging Face-initialized bf16 weights."""
    import statistics

    from .timing import time_calls

    weights = (torch.randn(nbytes // 2, device=device) * 0.02).bfloat16()
    enc = codec.encode_group([(weights, 0)], nbytes, device=device)
    blob = enc.blob.to(device)
    out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for _ in range(3):
        decode(blob, out, enc.chunks)
    times, _ = time_calls(lambda: decode(blob, out, enc.chunks), 10, device)
    return statistics.median(times) / 1e3 / nbytes
