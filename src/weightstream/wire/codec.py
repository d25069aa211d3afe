"""The wire codec: lossless compression of a group's bf16/fp16 bytes, decoded on the GPU in parallel.

A 16-bit float's sign and mantissa are close to random, its exponent is not (about 2.6 bits of
entropy for trained and for Hugging Face-initialized weights). Each value is split into its raw bits
(bf16: the sign and 7 mantissa bits, one byte; fp16: the low 8 mantissa bits, one byte, plus the sign
and the top 2 mantissa bits in a 3-bit "extra" field) and its exponent, coded at k bits (1..4) as
the offset from a per-tensor base: codes 0..2^k-2 are exponents base..base+2^k-2, code 2^k-1 escapes
and the exponent follows in the chunk's escape list. Values come in chunks of CHUNK, each decoded by
one GPU program on its own (its first escape's offset is in the header). k-bit fields are packed in
16-bit lanes, floor(16/k) rows of a chunk per lane, so encoding is a few whole-array integer
operations (four values per int64 word) and decoding one load and one shift per value. Tensors of
other dtypes, and tensors whose coding would not pay (over MAX_RATIO of their bytes), pass raw. See
docs/compression.md for the layout and why it was chosen.

Everything here is pure torch and runs on any device: the CPU reference decoder checks the GPU
kernel (`triton_decoder.py`) bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The GPU decoder's generation (triton_decoder.py): a profile's decode rate counts only when measured with
# this one; bump it whenever the kernel's speed changes, so cached profiles are measured again.
# 2: 2026-12-04 (code per kind and code width, vectorized; about 2.2x the first).
DECODER_VERSION = "2"
CHUNK = 2560  # values per chunk: a multiple of 4 * rows for every row count (16, 8, 5, 4) and of 8
RAW_CHUNK = 2 * CHUNK  # bytes per chunk of a raw segment
MAX_RATIO = 0.95  # a tensor whose coded size exceeds this share of its bytes passes raw
MAGIC = 0x3156435357  # "WSCV1"
RAW, BF16, FP16 = 0, 1, 2
KINDS = {torch.bfloat16: BF16, torch.float16: FP16}
HEADER_WORDS, SEGMENT_WORDS = 4, 8
# wire bytes / bytes of large Hugging Face-initialized tensors (normal, std 0.02), measured with this
# codec (tests/wire/test_codec.py); trained weights have a similar exponent entropy (DESIGN.md)
TYPICAL_RATIO = {BF16: 0.712, FP16: 0.918}
_L = 0x0001000100010001  # one in every 16-bit lane of an int64 word
_FF = 0x00FF * _L
_ALIGN = 16


def rows(width: int) -> int:
    """Fields of `width` bits packed into one 16-bit lane."""
    return 16 // width


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class Coding:
    """How one tensor is coded: kind (RAW, BF16, FP16), code width k in bits, exponent base, and its
    predicted or exact size in bytes on the wire (planes and escapes, no header)."""

    kind: int
    k: int = 0
    base: int = 0
    nbytes: int = 0


def _exponents(words: torch.Tensor, kind: int) -> torch.Tensor:
    """Exponent of every value in int64 `words` (four 16-bit values each), one per 16-bit lane."""
    shift, mask = (7, 0xFF) if kind == BF16 else (10, 0x1F)
    return (words >> shift) & (mask * _L)


def coded_bytes(n: int, kind: int, k: int, escapes: int) -> int:
    """Bytes of `n` values coded at k bits with `escapes` escapes: planes padded to whole chunks, and
    the tensor's share of the header."""
    chunks = -(-n // CHUNK)
    size = _align(chunks * CHUNK) + _align(chunks * CHUNK // rows(k) * 2) + _align(escapes)
    if kind == FP16:
        size += _align(chunks * CHUNK // rows(3) * 2)
    return size + 8 * (chunks + SEGMENT_WORDS)  # its chunk words and segment row in the header


def raw_bytes_on_wire(nbytes: int) -> int:
    """Bytes of a tensor of `nbytes` passed raw: its bytes (aligned) and its share of the header."""
    return _align(nbytes) + 8 * (-(-nbytes // RAW_CHUNK) + SEGMENT_WORDS)


def choose(tensor: torch.Tensor, sample: int = 1 << 20) -> Coding:
    """The coding of `tensor` predicted smallest from the exponents of about `sample` of its values
    (a strided sample); RAW when the dtype is not bf16/fp16, the tensor is tiny, or nothing pays.
    Works on tensors of any device; costs one pass over the sample."""
    kind = KINDS.get(tensor.dtype, RAW)
    n = tensor.numel()
    if kind == RAW or n < 64:
        return Coding(RAW, nbytes=raw_bytes_on_wire(n * tensor.element_size()))
    if tensor.is_meta:  # no values yet (planning from a config): what HF-initialized weights code to,
        # planes padded to whole chunks as coded_bytes counts them (it matters for small tensors)
        size = int(TYPICAL_RATIO[kind] * 2 * -(-n // CHUNK) * CHUNK) + 8 * (-(-n // CHUNK) + SEGMENT_WORDS)
        if size > MAX_RATIO * 2 * n:
            return Coding(RAW, nbytes=raw_bytes_on_wire(2 * n))
        return Coding(kind, 3, 0, size)
    flat = tensor.detach().reshape(-1)[: n // 4 * 4]
    if flat.data_ptr() % 8:
        flat = flat.clone()
    flat = flat.view(torch.int64)
    flat = flat[:: max(1, flat.numel() * 4 // sample)]
    lanes = _exponents(flat, kind).view(torch.int16)
    hist = torch.bincount(lanes.to(torch.int32), minlength=256)[:256].to(torch.float64).cpu()
    total = float(hist.sum())
    best = Coding(RAW, nbytes=raw_bytes_on_wire(2 * n))
    window = torch.cat([hist, hist[:15]])  # bases near 255 may wrap (the offsets are mod 256)
    for k in range(1, 5):
        cover = window.unfold(0, 2**k - 1, 1).sum(1)[:256]
        base = int(cover.argmax())
        escapes = round(n * (1 - float(cover[base]) / total))
        size = coded_bytes(n, kind, k, escapes)
        if size < best.nbytes:
            best = Coding(kind, k, base, size)
    return best if best.nbytes <= MAX_RATIO * 2 * n else Coding(RAW, nbytes=raw_bytes_on_wire(2 * n))


@dataclass
class _Planes:
    raw: torch.Tensor  # uint8 (chunks, CHUNK)
    code: torch.Tensor  # uint8 (chunks, 2 * CHUNK / rows(k))
    extra: torch.Tensor | None  # fp16: uint8 (chunks, 2 * CHUNK / 5)
    escapes: torch.Tensor  # uint8, in value order
    counts: torch.Tensor  # int64 (chunks,): escapes per chunk


# chunks coded at once: on a CPU 384 chunks (2 MB of int64 words per buffer) are large enough for
# torch's elementwise ops to use every core (48, which kept a buffer in L2, coded at half the rate:
# 0.31 against 0.67 GB/s of bf16 on the 2-core development machine); on a GPU fewer, larger launches
_BLOCK = {"cpu": 384, "cuda": 3072}
_SHIFTS = (0, 16, 32, 48)


class _Scratch:
    """Reused int64 buffers of one encoding thread (fresh memory costs a page fault per 4 KB)."""

    def __init__(self, device: torch.device, block: int) -> None:
        shape = (block, CHUNK // 4)
        self.d, self.g, self.r, self.t = (torch.empty(shape, dtype=torch.int64, device=device)
                                          for _ in range(4))
        self.shifts = torch.tensor(_SHIFTS, device=device)


def _pack_into(lanes: torch.Tensor, width: int, out: torch.Tensor, tmp: torch.Tensor) -> None:
    """Pack fields (one per 16-bit lane of int64 words, shape (chunks, CHUNK / 4)) `width` bits wide
    into `out` (int64, chunks x CHUNK / 4 / rows): lane j of a chunk's plane holds the fields of
    values r * CHUNK / R + j at bit width * r."""
    r = rows(width)
    view = lanes.view(lanes.shape[0], r, -1)
    out.copy_(view[:, 0])
    tmp = tmp.view(-1)[: out.numel()].view(out.shape)
    for i in range(1, r):
        torch.bitwise_left_shift(view[:, i], width * i, out=tmp)
        out |= tmp


def _encode_block(words: torch.Tensor, coding: Coding, raw_out: torch.Tensor, code_out: torch.Tensor,
                  extra_out: torch.Tensor | None, s: _Scratch) -> tuple[torch.Tensor, torch.Tensor]:
    """Code int64 `words` (b, CHUNK / 4): whole chunks of values. Writes the raw, code and extra
    planes (int64 views, b rows each); returns (escaped exponents in value order, escapes per chunk)."""
    kind, k, base = coding.kind, coding.k, coding.base
    b = words.shape[0]
    d, g, r, t = s.d[:b], s.g[:b], s.r[:b], s.t[:b]
    esc = 2**k - 1
    torch.bitwise_right_shift(words, 7 if kind == BF16 else 10, out=d)
    d &= _FF if kind == BF16 else 0x1F * _L
    d += (256 - base) * _L
    d &= _FF  # exponent offset from base, mod 256, per lane
    torch.add(d, (256 - esc) * _L, out=g)
    g >>= 8
    g &= _L  # 1 in the lanes that escape (offset >= esc)
    lane_sums = g.sum(1)  # per chunk, each lane's escapes in its own 16 bits (at most CHUNK / 4)
    counts = sum((lane_sums >> sh) & 0xFFFF for sh in _SHIFTS)
    hit = g.view(-1).nonzero().squeeze(1)
    lane_d = (d.view(-1)[hit, None] >> s.shifts) & 0xFF
    lane_g = ((g.view(-1)[hit, None] >> s.shifts) & 1).bool()
    escapes = ((lane_d[lane_g] + base) & 0xFF).to(torch.uint8)
    g *= esc
    d |= g
    d &= esc * _L  # the code: the offset, or esc
    _pack_into(d, k, code_out, t)
    if kind == BF16:
        torch.bitwise_right_shift(words, 8, out=r)
        r &= 0x80 * _L
        torch.bitwise_and(words, 0x7F * _L, out=t)
        r |= t
    else:
        torch.bitwise_right_shift(words, 13, out=g)
        g &= 4 * _L
        torch.bitwise_right_shift(words, 8, out=t)
        t &= 3 * _L
        g |= t
        _pack_into(g, 3, extra_out, t)
        torch.bitwise_and(words, _FF, out=r)
    half = r.shape[1] // 2  # two raw bytes per lane: values j and CHUNK / 2 + j
    torch.bitwise_left_shift(r[:, half:], 8, out=raw_out)
    raw_out |= r[:, :half]
    return escapes, counts


def _encode_tensor(tensor: torch.Tensor, coding: Coding) -> _Planes:
    """Planes of `tensor` (bf16/fp16, any shape, on any device) coded as `coding`."""
    flat = tensor.detach().reshape(-1).view(torch.int16)
    n, device = flat.numel(), flat.device
    chunks = -(-n // CHUNK)
    raw = torch.empty(chunks, CHUNK // 8, dtype=torch.int64, device=device)
    code = torch.empty(chunks, CHUNK // 4 // rows(coding.k), dtype=torch.int64, device=device)
    extra = torch.empty(chunks, CHUNK // 4 // rows(3), dtype=torch.int64, device=device) \
        if coding.kind == FP16 else None
    full = n // CHUNK
    body = flat[: full * CHUNK]
    if body.data_ptr() % 8:
        body = body.clone()
    body = body.view(torch.int64).view(full, CHUNK // 4)
    block = min(_BLOCK.get(device.type, 16), chunks)
    scratch = _Scratch(device, block)
    escapes, counts = [], []
    for c0 in range(0, chunks, block):
        c1 = min(c0 + block, chunks)
        if c1 <= full:
            words = body[c0:c1]
        else:  # the last chunk, padded with values that code as 0 (exponent = base)
            shift = 7 if coding.kind == BF16 else 10
            tail = torch.full((CHUNK,), coding.base << shift, dtype=torch.int16, device=device)
            tail[: n - full * CHUNK] = flat[full * CHUNK :]
            words = torch.cat([body[c0:full], tail.view(torch.int64).view(1, -1)])
        e, c = _encode_block(words, coding, raw[c0:c1], code[c0:c1],
                             None if extra is None else extra[c0:c1], scratch)
        escapes.append(e)
        counts.append(c)

    def as_bytes(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8).view(chunks, -1)

    return _Planes(as_bytes(raw), as_bytes(code), None if extra is None else as_bytes(extra),
                   torch.cat(escapes), torch.cat(counts))


@dataclass(frozen=True)
class EncodedGroup:
    """A group's bytes on the wire: `blob` (uint8, header included) decodes into `raw_bytes` bytes of
    the group's layout. `chunks` is the number of GPU programs that decode it.

    Blob layout (int64 words, then 16-byte aligned planes): MAGIC, segments S, chunks K, raw bytes;
    K chunk words (escape list start, absolute byte offset | segment << 40); S segment rows of 8
    (kind, n, dst, raw/code/extra/escape offsets, k | base << 8 | first chunk << 24); the planes."""

    blob: torch.Tensor
    raw_bytes: int
    chunks: int

    @property
    def wire_bytes(self) -> int:
        return self.blob.numel()


def encode_group(tensors: list[tuple[torch.Tensor, int]], raw_bytes: int,
                 device: torch.device | None = None) -> EncodedGroup | None:
    """Encode a group: each (tensor, byte offset in the group's layout) is coded or passed raw.
    Returns None when the whole group would not shrink below MAX_RATIO (send it raw instead).
    The coding runs on `device` (default: each tensor's own; a GPU codes far faster than a CPU), and
    the blob is built there (default: on the CPU)."""
    segments, cursor_chunks = [], 0
    for tensor, dst in tensors:
        if dst % _ALIGN:  # the GPU decoder writes whole aligned words (layout.pack aligns to 256)
            raise ValueError(f"a tensor at byte {dst} of its group: the codec needs offsets that are "
                             f"multiples of {_ALIGN} (place tensors with weightstream.placement.layout.pack)")
        if device is not None and tensor.dtype in KINDS:
            tensor = tensor.to(device)
        coding = choose(tensor)
        n = tensor.numel()
        if coding.kind != RAW:
            planes = _encode_tensor(tensor, coding)
            exact = coded_bytes(n, coding.kind, coding.k, planes.escapes.numel())
            if exact <= MAX_RATIO * 2 * n:
                segments.append((coding, n, dst, planes, cursor_chunks))
                cursor_chunks += planes.counts.numel()
                continue
        nbytes = n * tensor.element_size()
        segments.append((Coding(RAW), nbytes, dst, tensor, cursor_chunks))
        cursor_chunks += -(-nbytes // RAW_CHUNK)
    header = _align(8 * (HEADER_WORDS + SEGMENT_WORDS * len(segments) + cursor_chunks))
    offsets, cursor = [], header
    for coding, n, _, planes, _ in segments:
        if coding.kind == RAW:
            sizes = [n]
        else:
            sizes = [planes.raw.numel(), planes.code.numel(),
                     planes.extra.numel() if planes.extra is not None else 0, planes.escapes.numel()]
        starts = []
        for size in sizes:
            starts.append(cursor)
            cursor += _align(size)
        offsets.append(starts)
    if cursor > MAX_RATIO * raw_bytes:
        return None
    blob = torch.zeros(cursor, dtype=torch.uint8, device=device or "cpu")
    words = blob[:header].view(torch.int64)
    words[:HEADER_WORDS] = torch.tensor([MAGIC, len(segments), cursor_chunks, raw_bytes])
    chunk_words = words[HEADER_WORDS : HEADER_WORDS + cursor_chunks]
    for s, ((coding, n, dst, planes, first), starts) in enumerate(zip(segments, offsets, strict=True)):
        params = coding.k | coding.base << 8 | first << 24
        if coding.kind == RAW:
            row = [RAW, n, dst, starts[0], 0, 0, 0, params]
            src = planes.detach().reshape(-1).view(torch.uint8)
            blob[starts[0] : starts[0] + n].copy_(src)
            count = -(-n // RAW_CHUNK)
            chunk_words[first : first + count] = s << 40
        else:
            raw_off, code_off, x_off, esc_off = starts
            row = [coding.kind, n, dst, raw_off, code_off, x_off, esc_off, params]
            sources = [planes.raw, planes.code, planes.extra, planes.escapes]
            for off, plane in zip(starts, sources, strict=True):
                if plane is not None and plane.numel():
                    blob[off : off + plane.numel()].copy_(plane.reshape(-1))
            counts = planes.counts.cpu()
            esc_start = esc_off + torch.cumsum(counts, 0) - counts
            chunk_words[first : first + counts.numel()] = esc_start | (s << 40)
        base = HEADER_WORDS + cursor_chunks + SEGMENT_WORDS * s
        words[base : base + SEGMENT_WORDS] = torch.tensor(row)
    return EncodedGroup(blob, raw_bytes, cursor_chunks)


def read_header(blob: torch.Tensor) -> tuple[int, list[list[int]]]:
    """(raw bytes, segment rows) of an encoded blob; each row: kind, n, dst, raw/code/extra/escape
    offsets, params (k | base << 8 | first chunk << 24)."""
    head = blob[: 8 * HEADER_WORDS].cpu().view(torch.int64).tolist()
    if head[0] != MAGIC:
        raise ValueError("not a weightstream codec blob (bad magic)")
    start = HEADER_WORDS + head[2]
    segs = blob[8 * start : 8 * (start + SEGMENT_WORDS * head[1])].cpu().view(torch.int64)
    return head[3], segs.view(-1, SEGMENT_WORDS).tolist()


def _unpack(plane: torch.Tensor, width: int) -> torch.Tensor:
    """Inverse of _pack: (chunks, plane bytes) -> int32 fields (chunks, CHUNK) in value order."""
    r = rows(width)
    lanes = plane.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    shifts = torch.arange(r, device=plane.device, dtype=torch.int32)[None, :, None] * width
    return ((lanes[:, None, :] >> shifts) & (2**width - 1)).reshape(plane.shape[0], -1)


def decode_group(blob: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Decode `blob` into `out` (uint8, at least the group's raw bytes, same device as blob): the
    reference decoder, pure torch. Bytes of `out` outside the group's tensors are left as they are."""
    _, segments = read_header(blob)
    for kind, n, dst, raw_off, code_off, x_off, esc_off, params in segments:
        if kind == RAW:
            out[dst : dst + n].copy_(blob[raw_off : raw_off + n])
            continue
        k, base = params & 0xFF, (params >> 8) & 0xFF
        chunks = -(-n // CHUNK)
        raw = blob[raw_off : raw_off + chunks * CHUNK].view(chunks, CHUNK // 2, 2)
        raw = raw.transpose(1, 2).reshape(-1).to(torch.int32)
        code_bytes = chunks * CHUNK // rows(k) * 2
        code = _unpack(blob[code_off : code_off + code_bytes].view(chunks, -1), k).reshape(-1)
        escaped = code == 2**k - 1
        exp = (code + base) & 0xFF
        count = int(escaped.sum())
        exp[escaped] = blob[esc_off : esc_off + count].to(torch.int32)
        if kind == BF16:
            value = ((raw & 0x80) << 8) | (exp << 7) | (raw & 0x7F)
        else:
            x_bytes = chunks * CHUNK // rows(3) * 2
            x = _unpack(blob[x_off : x_off + x_bytes].view(chunks, -1), 3).reshape(-1)
            value = ((x & 4) << 13) | (exp << 10) | ((x & 3) << 8) | raw
        value = value[:n].to(torch.int16)  # int32 -> int16 keeps the low 16 bits
        out[dst : dst + 2 * n].copy_(value.view(torch.uint8))
    return out
