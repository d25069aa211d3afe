"""The self-draft's Triton dequantization (`speculative/dequant_kernel.py`) run by Triton's interpreter on
the CPU, against the torch reference `quantize.dequantize`, bit for bit. Run only in a Python started
with TRITON_INTERPRET=1 (tests/speculative/test_quantize.py does)."""

from __future__ import annotations

import os

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from low_bit_cases import DTYPES, raw_stored, same_bits

from weightstream.speculative.quantize import dequantize, quantize

assert os.environ.get("TRITON_INTERPRET") == "1", "start this Python with TRITON_INTERPRET=1"
from weightstream.speculative import dequant_kernel  # noqa: E402 - after the check: compiled kernels need a GPU


def stored(lead: tuple[int, ...], columns: int, bits: int, group: int, gen: torch.Generator, spread: float,
           raw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, scales) as `quantize` stores them: of a random weight, or (raw) any bytes and any finite
    float32 scales (subnormal, huge, negative: every rounding case of the cast, overflow to inf)."""
    if not raw:
        return quantize(torch.randn(*lead, columns, generator=gen) * spread, bits, group)
    return raw_stored(lead, columns, bits, group, gen)


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
