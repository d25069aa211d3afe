"""The self-draft's low-bit matmul (`speculative/matmul_kernel.py`) run by Triton's interpreter on the CPU,
against the torch reference `quantize.low_bit_linear`, bit for bit. Run only in a Python started with
TRITON_INTERPRET=1 (tests/speculative/test_quantize.py does)."""

from __future__ import annotations

import os

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from low_bit_cases import DTYPES, low_bit_case, same_bits

from weightstream.speculative.quantize import low_bit_linear

assert os.environ.get("TRITON_INTERPRET") == "1", "start this Python with TRITON_INTERPRET=1"
from weightstream.speculative import matmul_kernel  # noqa: E402 - after the check: compiled kernels need a GPU


@settings(max_examples=12, deadline=None)  # the interpreter takes seconds a case; the GPU tests run more
@given(lead=st.sampled_from([(1,), (3,), (8,), (16,), (2, 5), (1, 1, 7)]),
       outputs=st.one_of(st.integers(1, 40), st.just(257)),
       columns=st.one_of(st.integers(1, 400), st.just(1025)),
       bits=st.sampled_from([4, 8]), group=st.sampled_from([64, 96, 128, 256]), dtype=st.sampled_from(DTYPES),
       bias=st.booleans(), raw=st.booleans(), programs=st.sampled_from([1, 16]),
       unroll=st.sampled_from([1, 2, 4]),
       seed=st.integers(0, 2**31 - 1))
def check_random_cases(lead, outputs, columns, bits, group, dtype, bias, raw, programs, unroll,
                       seed) -> None:
    """Any rows up to 16 (leading dimensions included; `MAX_ROWS` only chooses where the kernel is
    used), outputs (several programs; more than a program's block), columns (groups and lanes they do
    not divide, many steps), bits, groups, dtypes, with and without a bias, stored bytes of random
    weights or any bytes and scales, one output a program or several (`PROGRAMS`), any `UNROLL`: the
    kernel returns what the reference returns, bit for bit."""
    matmul_kernel.PROGRAMS, matmul_kernel.UNROLL = programs, unroll
    x, values, scales, b = low_bit_case(lead, outputs, columns, bits, group, dtype, bias, raw,
                                        torch.Generator().manual_seed(seed))
    want = low_bit_linear(x, values, scales, bits, columns, b)
    got = matmul_kernel.low_bit_linear(x, values, scales, bits, columns, b)
    assert same_bits(got, want), (got, want)


def check_a_wrong_width_is_refused() -> None:
    """x of another width than the weight's columns raises (the padding would otherwise cut x)."""
    import pytest

    x, values, scales, b = low_bit_case((1,), 8, 200, 4, 64, torch.float32, False, False,
                                        torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="columns"):
        matmul_kernel.low_bit_linear(x[:, :199], values, scales, 4, 200, None)
