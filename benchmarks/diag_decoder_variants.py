"""Where the GPU decoder's time goes: the codec's chunk decode written several ways, each timed on one
256 MiB group of HF-initialized bf16 and checked bit for bit against the torch reference decoder
(ablations that leave the escapes out are timed only). Exploratory: codec_triton.py keeps the winner.

    PYTHONPATH=src python3 benchmarks/diag_decoder_variants.py [--only NAME] [--reps 20]
"""

from __future__ import annotations

import statistics

import torch
import triton
import triton.language as tl

from weightstream.placement.timing import time_calls
from weightstream.wire import codec


@triton.jit
def _vals(blob, raw_ptr, code_ptr, cursor, base, i, m, k, window, start, wlen, CHUNK: tl.constexpr,
          RAW16: tl.constexpr, ESC: tl.constexpr, W: tl.constexpr):
    half = CHUNK // 2
    if RAW16:
        raw = (tl.load(raw_ptr.to(tl.pointer_type(tl.int16)) + i % half, mask=m, other=0).to(tl.int32)
               >> (8 * (i // half))) & 0xFF
    else:
        raw = tl.load(raw_ptr + 2 * (i % half) + i // half, mask=m, other=0).to(tl.int32)
    lanes = CHUNK // (16 // k)
    esc = (1 << k) - 1
    code = (tl.load(code_ptr + i % lanes, mask=m, other=0).to(tl.int32) & 0xFFFF) >> (k * (i // lanes)) & esc
    if ESC == 0:  # no escapes (wrong values: timing only)
        e = (code + base) & 0xFF
        count = 0
    else:
        escaped = (code == esc) & m
        flag = escaped.to(tl.int32)
        rank = tl.cumsum(flag, 0) - flag
        count = tl.sum(flag, 0)
        if ESC == 1:  # each escape loaded from global memory
            got = tl.load(blob + cursor + rank, mask=escaped, other=0).to(tl.int32)
        elif ESC == 2:  # ranks only, no load (wrong values: timing only)
            got = rank
        else:  # from the window of escape bytes loaded at the chunk's start; past it, from global memory
            at = cursor - start + rank  # offset from the window's start
            inside = at < wlen
            got = tl.gather(window, tl.minimum(at, W - 1).to(tl.int32), 0)
            far = tl.load(blob + cursor + rank, mask=escaped & ~inside, other=0).to(tl.int32)
            got = tl.where(inside, got, far)
        e = tl.where(escaped, got, (code + base) & 0xFF)
    v = ((raw & 0x80) << 8) | (e << 7) | (raw & 0x7F)
    return v.to(tl.int16), count


@triton.jit
def _chunk(blob, raw_ptr, code_ptr, out_ptr, cursor, base, limit, k, window, wlen, CHUNK: tl.constexpr,
           STEP: tl.constexpr, RAW16: tl.constexpr, ESC: tl.constexpr, UNROLL: tl.constexpr, W: tl.constexpr):
    start = cursor
    if UNROLL:
        for b in tl.static_range(0, CHUNK, STEP):
            i = b + tl.arange(0, STEP)
            m = i < limit
            v, count = _vals(blob, raw_ptr, code_ptr, cursor, base, i, m, k, window, start, wlen, CHUNK,
                             RAW16, ESC, W)
            tl.store(out_ptr + i, v, mask=m)
            cursor += count
    else:
        for b in range(0, CHUNK, STEP):
            i = b + tl.arange(0, STEP)
            m = i < limit
            v, count = _vals(blob, raw_ptr, code_ptr, cursor, base, i, m, k, window, start, wlen, CHUNK,
                             RAW16, ESC, W)
            tl.store(out_ptr + i, v, mask=m)
            cursor += count


@triton.jit
def _kernel(blob, out, CHUNK: tl.constexpr, HEADER_WORDS: tl.constexpr, SEGMENT_WORDS: tl.constexpr,
            STEP: tl.constexpr, SPECIAL: tl.constexpr, RAW16: tl.constexpr, ESC: tl.constexpr,
            UNROLL: tl.constexpr, HINTS: tl.constexpr, W: tl.constexpr):
    """bf16 segments only (the benchmark's group is one bf16 tensor)."""
    pid = tl.program_id(0)
    words = blob.to(tl.pointer_type(tl.int64))
    chunk_word = tl.load(words + HEADER_WORDS + pid)
    row = words + HEADER_WORDS + tl.num_programs(0) + SEGMENT_WORDS * (chunk_word >> 40)
    n = tl.load(row + 1)
    dst = tl.load(row + 2)
    raw_off = tl.load(row + 3)
    code_off = tl.load(row + 4)
    if HINTS:
        dst = tl.multiple_of(dst, 16)
        raw_off = tl.multiple_of(raw_off, 16)
        code_off = tl.multiple_of(code_off, 16)
    params = tl.load(row + 7)
    c = pid - (params >> 24)
    k = (params & 0xFF).to(tl.int32)
    base = ((params >> 8) & 0xFF).to(tl.int32)
    valid = n - c * CHUNK
    cursor = chunk_word & 0xFFFFFFFFFF
    raw_ptr = blob + raw_off + c * CHUNK
    code_base = blob + code_off
    out_ptr = (out + dst).to(tl.pointer_type(tl.int16)) + c * CHUNK
    j = tl.arange(0, W)
    if ESC == 3:  # the escape bytes up to the next chunk's (this chunk's and perhaps more), at most W
        nprog = tl.num_programs(0)
        after = tl.load(words + HEADER_WORDS + tl.minimum(pid + 1, nprog - 1)) & 0xFFFFFFFFFF
        wlen = tl.where(pid + 1 < nprog, tl.minimum(tl.maximum(after - cursor, 0), W), 0)
        window = tl.load(blob + cursor + j, mask=j < wlen, other=0).to(tl.int32)
    else:
        wlen = cursor * 0
        window = j * 0
    if SPECIAL and valid >= CHUNK:
        if k == 3:
            code_ptr = (code_base + c * (2 * CHUNK // 5)).to(tl.pointer_type(tl.int16))
            _chunk(blob, raw_ptr, code_ptr, out_ptr, cursor, base, CHUNK, 3, window, wlen, CHUNK, STEP, RAW16,
                   ESC, UNROLL, W)
        else:
            code_ptr = (code_base + c * (2 * CHUNK // (16 // k))).to(tl.pointer_type(tl.int16))
            _chunk(blob, raw_ptr, code_ptr, out_ptr, cursor, base, CHUNK, k, window, wlen, CHUNK, STEP, RAW16,
                   ESC, UNROLL, W)
    else:
        code_ptr = (code_base + c * (2 * CHUNK // (16 // k))).to(tl.pointer_type(tl.int16))
        _chunk(blob, raw_ptr, code_ptr, out_ptr, cursor, base, tl.minimum(valid, CHUNK), k, window, wlen,
               CHUNK, STEP, RAW16, ESC, UNROLL, W)


VARIANTS = {  # name: (STEP, SPECIAL, RAW16, ESC, UNROLL, HINTS, warps, W)
    "base (like session 26)": (512, False, False, 1, False, False, 4, 16),
    "k3 w2": (512, True, True, 1, False, True, 2, 16),
    "k3 w1": (512, True, True, 1, False, True, 1, 16),
    "k3 w1 step256": (256, True, True, 1, False, True, 1, 16),
    "k3 w2 unroll": (512, True, True, 1, True, True, 2, 16),
    "k3 w2 window256": (512, True, True, 3, False, True, 2, 256),
    "k3 w2 window512": (512, True, True, 3, False, True, 2, 512),
    "k3 w1 window256": (512, True, True, 3, False, True, 1, 256),
    "k3 w2 unroll window256": (512, True, True, 3, True, True, 2, 256),
    "k3 w4 window256": (512, True, True, 3, False, True, 4, 256),
    "k3 w2 ranks, no loads (timing only)": (512, True, True, 2, False, True, 2, 16),
    "k3 w2 no escapes (timing only)": (512, True, True, 0, False, True, 2, 16),
    "k3 w1 no escapes (timing only)": (512, True, True, 0, False, True, 1, 16),
}


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run the variants whose name contains this")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda")
    nbytes = 256 << 20
    weights = (torch.randn(nbytes // 2, device=device) * 0.02).bfloat16()
    enc = codec.encode_group([(weights, 0)], nbytes, device=device)
    blob = enc.blob.to(device)
    want = codec.decode_group(blob, torch.zeros(nbytes, dtype=torch.uint8, device=device))
    copy = torch.empty_like(want)
    times, _ = time_calls(lambda: copy.copy_(want), 20, device, back_to_back=False)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"256 MiB bf16 (std 0.02), ratio {enc.wire_bytes / nbytes:.4f}, {enc.chunks} chunks; a plain "
          f"device copy of "
          f"the output: {statistics.median(times):.3f} ms")
    for name, (step, special, raw16, esc, unroll, hints, warps, w) in VARIANTS.items():
        if args.only not in name:
            continue
        out = torch.zeros(nbytes, dtype=torch.uint8, device=device)

        def call(out=out, step=step, special=special, raw16=raw16, esc=esc, unroll=unroll, hints=hints,
                 warps=warps, w=w):
            return _kernel[(enc.chunks,)](blob, out, CHUNK=codec.CHUNK, HEADER_WORDS=codec.HEADER_WORDS,
                                          SEGMENT_WORDS=codec.SEGMENT_WORDS, STEP=step, SPECIAL=special,
                                          RAW16=raw16, ESC=esc, UNROLL=unroll, HINTS=hints, W=w,
                                          num_warps=warps)
        try:
            k = call()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - report and go on to the next variant
            print(f"{name:32s} failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        exact = torch.equal(out, want)
        times, _ = time_calls(call, args.reps, device, back_to_back=False)
        ms = statistics.median(times)
        print(f"{name:32s} {ms:.3f} ms {nbytes / ms / 1e6:5.0f} GB/s exact {exact}  regs {k.n_regs} "
              f"spills {k.n_spills}")


if __name__ == "__main__":
    main()
