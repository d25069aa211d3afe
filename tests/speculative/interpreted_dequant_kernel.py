"""The self-draft's Triton dequantization (`speculative/dequant_kernel.py`) run by Triton's interpreter on
the CPU, against the torch reference `quantize.dequantize`, bit for bit. Run only in a Python started
with TRITON_INTERPRET=1 (tests/speculative/test_quantize.py does)."""

from __future__ import annotations

import os

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightstream.speculative.quantize import dequantize, padded, quantize

assert os.environ.get("TRITON_INTERPRET") == "1", "start this Python with TRITON_INTERPRET=1"
from weightstream.speculative import dequant_kernel  # noqa: E402 - after the check: compiled kernels need a GPU

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BITS_OF = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(BITS_OF[a.dtype]),
                                                                      b.view(BITS_OF[b.dtype]))


def stored(lead: tuple[int, ...], columns: int, bits: int, group: int, gen: torch.Generator, spread: float,
           raw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, scales) as `quantize` stores them: of a random weight, or (raw) any bytes and any finite
    float32 scales (subnormal, huge, negative: every rounding case of the cast, overflow to inf)."""
    if not raw:
        return quantize(torch.randn(*lead, columns, generator=gen) * spread, bits, group)
    width = padded(columns, group)
    if bits == 4:
        values = torch.randint(0, 256, (*lead, width // 2), generator=gen, dtype=torch.uint8)
    else:
        values = torch.randint(-128, 128, (*lead, width), generator=gen, dtype=torch.int8)
    scales = torch.randint(-2**31, 2**31, (*lead, width // group, 1), generator=gen, dtype=torch.int32)
    # half of them end in a tie (or next to one) of the cast to bfloat16 or float16, which q of a power of
    # two keeps exact: round to nearest even is tested where it differs from other roundings
    ends = torch.tensor([0x8000, 0x7FFF, 0x8001, 0x1000, 0x0FFF], dtype=torch.int32)
    end = ends[torch.randint(0, len(ends), scales.shape, generator=gen)]
    tie = torch.rand(scales.shape, generator=gen) < 0.5
    scales = torch.where(tie, (scales & ~0xFFFF) | end, scales).view(torch.float32)
    return values, torch.where(scales.isfinite(), scales, torch.ones(()))


@settings(max_examples=60, deadline=None)
@given(lead=st.lists(st.integers(1, 4), min_size=1, max_size=2).map(tuple),
       columns=st.one_of(st.integers(1, 600), st.sampled_from([1024, 1025, 2100])),
       bits=st.sampled_from([4, 8]), group=st.sampled_from([64, 128, 256]), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**31 - 1), spread=st.floats(1e-6, 1e3), raw=st.booleans())
def check_random_weights(lead, columns, bits, group, dtype, seed, spread, raw) -> None:
    """Any shape (leading dimensions included, columns the group does not divide, several programs per
    row), bits, group and dtype: the kernel writes what the reference returns, bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    values, scales = stored(lead, columns, bits, group, gen, spread, raw)
    want = dequantize(values, scales, bits, columns, dtype)
    got = dequant_kernel.dequantize(values, scales, bits, columns, dtype)
    assert same_bits(got, want), (got, want)
