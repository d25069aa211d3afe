"""Symmetric int8 / int4 weight-only quantization in groups: the error bound of a round trip, int4 packing,
the bytes stored, a module reading its weight through `QuantizedWeight`, and the Triton kernel against
the reference (Triton's interpreter)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import run_interpreted
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from weightstream.speculative.quantize import (
    dequantize,
    pack_int4,
    qmax,
    quantize,
    quantize_parameter,
    quantized_bytes,
    unpack_int4,
)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5), columns=st.integers(1, 300), bits=st.sampled_from([4, 8]),
       group=st.sampled_from([64, 128, 256]), seed=st.integers(0, 2**31 - 1),
       spread=st.floats(1e-6, 1e3))
def test_a_round_trip_is_off_by_at_most_half_a_groups_scale(rows, columns, bits, group, seed, spread):
    weight = torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed)) * spread
    values, scales = quantize(weight, bits, group)
    back = dequantize(values, scales, bits, columns, torch.float32)
    assert back.shape == weight.shape and back.dtype == torch.float32
    padded = -(-columns // group) * group
    assert scales.shape == (rows, padded // group, 1) and scales.dtype == torch.float32
    assert values.shape == (rows, padded // 2 if bits == 4 else padded)
    assert values.dtype == (torch.uint8 if bits == 4 else torch.int8)
    # each column's bound is half its own group's scale, max |w| / qmax, plus the float32 rounding of
    # q * scale and of w / scale (a few ulps of |w|)
    per_column = scales.repeat_interleave(group, dim=1)[:, :columns, 0]
    ulps = weight.abs() * 4 * torch.finfo(torch.float32).eps
    assert torch.all((back - weight).abs() <= per_column / 2 * (1 + 1e-5) + ulps + 1e-30)
    top = weight.reshape(rows, -1).abs().max()
    assert torch.allclose(scales.max(), top / qmax(bits), rtol=1e-6)


@given(bits=st.sampled_from([4, 8]), seed=st.integers(0, 1000))
def test_a_weight_on_the_grid_comes_back_exactly(bits, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-qmax(bits), qmax(bits) + 1, (3, 128), generator=gen).float()
    q[:, 0] = qmax(bits)  # every group reaches the grid's end, so its scale is the step
    step = torch.tensor([[0.5], [0.25], [2.0]])
    weight = torch.cat([q[:, :64] * step, q[:, 64:] * step * 4], dim=1)
    q[:, 64] = qmax(bits)
    weight[:, 64] = qmax(bits) * step[:, 0] * 4
    values, scales = quantize(weight, bits, 64)
    assert torch.equal(dequantize(values, scales, bits, 128, torch.float32), weight)


@given(st.lists(st.integers(-8, 7), min_size=2, max_size=64).filter(lambda v: len(v) % 2 == 0))
def test_int4_packing_is_exact_and_two_per_byte(values):
    q = torch.tensor(values, dtype=torch.int8).reshape(1, -1)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (1, len(values) // 2)
    assert torch.equal(unpack_int4(packed), q)
    assert int(packed[0, 0]) == (values[0] + 8) | ((values[1] + 8) << 4)  # the even value in the low nibble


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
def test_a_module_reads_its_weight_dequantized_and_stores_the_bytes_counted(bits, dtype):
    torch.manual_seed(0)
    linear = nn.Linear(200, 24).to(dtype).requires_grad_(False)
    weight, bias = linear.weight.clone(), linear.bias
    stored = quantize_parameter(linear, "weight", bits, 128)
    assert stored == quantized_bytes(weight.shape, bits, 128) == 24 * 256 * bits // 8 + 24 * 2 * 4
    values, scales = quantize(weight, bits, 128)
    want = dequantize(values, scales, bits, 200, dtype)
    assert linear.weight.dtype == dtype and torch.equal(linear.weight, want)
    x = torch.randn(3, 200).to(dtype)
    assert torch.equal(linear(x), nn.functional.linear(x, want, bias))


def test_a_three_dimensional_weight_is_grouped_along_its_last_dimension():
    weight = torch.randn(4, 6, 96)  # fused experts: (experts, out, in)
    values, scales = quantize(weight, 4, 64)
    assert values.shape == (4, 6, 64) and scales.shape == (4, 6, 2, 1)
    back = dequantize(values, scales, 4, 96, torch.float32)
    for e in range(4):  # the same as each expert alone
        v, s = quantize(weight[e], 4, 64)
        assert torch.equal(back[e], dequantize(v, s, 4, 96, torch.float32))
    assert quantized_bytes(weight.shape, 4, 64) == values.numel() + scales.numel() * 4


def test_the_kernel_run_by_tritons_interpreter_matches_the_reference():
    """The self-draft's Triton dequantization run by Triton's interpreter on the CPU (a fresh Python with
    TRITON_INTERPRET=1) against `dequantize`, bit for bit, over hypothesis-drawn shapes, bits, groups
    and dtypes."""
    pytest.importorskip("triton")
    run = run_interpreted(Path(__file__).parent, "import interpreted_dequant_kernel as m; "
                          "m.check_random_weights()")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
