"""The GPU decoder's own code (`wire/triton_decoder.py`) run by Triton's interpreter on the CPU, against the
reference decoder. Run only in a Python started with TRITON_INTERPRET=1 (tests/wire/test_codec.py does)."""

from __future__ import annotations

import os

import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from test_codec import hf_init, tensors

from weightstream.placement.layout import pack
from weightstream.wire import codec

assert os.environ.get("TRITON_INTERPRET") == "1", "start this Python with TRITON_INTERPRET=1"
from weightstream.wire import triton_decoder as codec_triton  # noqa: E402 - after the check: compiled kernels need a GPU


@settings(max_examples=100, deadline=None)
@given(st.lists(tensors(max_n=3 * codec.CHUNK + 17), min_size=1, max_size=4), st.integers(0, 255))
def check_random_groups(group: list[torch.Tensor], fill: int) -> None:
    """Any group decodes as the reference decodes it, bytes between its tensors untouched."""
    slices, size = pack([t.numel() * t.element_size() for t in group])
    enc = codec.encode_group([(t, sl.offset) for t, sl in zip(group, slices, strict=True)], size)
    event("sent raw" if enc is None else "coded")
    if enc is None:  # nothing to decode
        return
    want = codec.decode_group(enc.blob, torch.full((size,), fill, dtype=torch.uint8))
    got = torch.full((size,), fill, dtype=torch.uint8)
    codec_triton.decode(enc.blob, got, enc.chunks)
    assert torch.equal(got, want)


def _spread(n: int, dtype: torch.dtype, width: int, seed: int) -> torch.Tensor:
    """Values whose exponents spread over `width` values, 1% of them far off."""
    gen = torch.Generator().manual_seed(seed)
    e = torch.randint(-8, -8 + width, (n,), generator=gen).float()
    e[torch.rand(n, generator=gen) < 0.01] -= 12
    return (torch.exp2(e) * (1 + torch.rand(n, generator=gen))).to(dtype)


def check_every_width() -> None:
    """Full and partial chunks of bf16 and fp16 at every code width the encoder picks (fp16 never codes
    at 4 bits: 15.2 bits a value would not pay), and raw segments."""
    for dtype, widths in ((torch.bfloat16, (1, 2, 3, 4)), (torch.float16, (1, 2, 3))):
        group = [_spread(8 * codec.CHUNK - 5 - w, dtype, 2**w - 1, w) for w in widths]
        group += [torch.arange(3000, dtype=torch.float32), hf_init(codec.CHUNK, dtype, 9)]
        slices, size = pack([t.numel() * t.element_size() for t in group])
        enc = codec.encode_group([(t, sl.offset) for t, sl in zip(group, slices, strict=True)], size)
        _, rows = codec.read_header(enc.blob)
        kind = codec.KINDS[dtype]
        assert [(row[0], row[7] & 0xFF) for row in rows] == [(kind, w) for w in widths] + [(codec.RAW, 0),
                                                                                            (kind, 3)]
        got = torch.zeros(size, dtype=torch.uint8)
        codec_triton.decode(enc.blob, got, enc.chunks)
        for t, sl in zip(group, slices, strict=True):
            assert torch.equal(got[sl.offset : sl.offset + sl.nbytes], t.view(torch.uint8))
