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

from weightstream.speculative import draft_linear
from weightstream.speculative.draft_linear import (
    MAX_ROWS,
    low_bit_forward,
    runs_low_bit_linear,
    use_low_bit_forward,
)
from weightstream.speculative.quantize import (
    LANES,
    dequantize,
    low_bit_linear,
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


def contract(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, bits: int, columns: int,
             bias: torch.Tensor | None) -> torch.Tensor:
    """`low_bit_linear`'s arithmetic one float32 scalar at a time, as its docstring states it."""
    weight = dequantize(values, scales, bits, values.shape[-1] * (8 // bits), torch.float32)
    total = -(-weight.shape[-1] // LANES) * LANES
    rows = x.reshape(-1, columns).float()
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=x.dtype)
    for m in range(rows.shape[0]):
        for n in range(weight.shape[0]):
            lanes = [torch.zeros((), dtype=torch.float32) for _ in range(LANES)]
            for k in range(total):
                w = weight[n, k] if k < weight.shape[1] else torch.zeros(())
                v = rows[m, k] if k < columns else torch.zeros(())
                lanes[k % LANES] = lanes[k % LANES] + w * v
            while len(lanes) > 1:
                lanes = [lanes[i] + lanes[i + 1] for i in range(0, len(lanes), 2)]
            y = lanes[0] + bias[n].float() if bias is not None else lanes[0]
            out[m, n] = y.to(x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 2), outputs=st.integers(1, 2), columns=st.integers(1, 300),
       bits=st.sampled_from([4, 8]), group=st.sampled_from([64, 96, 128]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), bias=st.booleans(),
       raw=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_the_low_bit_matmul_reference_adds_in_the_order_its_contract_states(rows, outputs, columns, bits,
                                                                            group, dtype, bias, raw, seed):
    """The vectorized reference against the contract computed one scalar at a time (the order of the
    additions decides the last bits, and the GPU kernel is held to this order)."""
    from low_bit_cases import low_bit_case, same_bits

    x, values, scales, b = low_bit_case((rows,), outputs, columns, bits, group, dtype, bias, raw,
                                        torch.Generator().manual_seed(seed))
    assert same_bits(low_bit_linear(x, values, scales, bits, columns, b),
                     contract(x, values, scales, bits, columns, b))


@pytest.mark.parametrize("bits", [4, 8])
def test_the_low_bit_matmul_is_the_linear_layer_of_the_dequantized_weight(bits):
    """Within float32 rounding of a float64 product: the reference computes y = x W^T + b."""
    gen = torch.Generator().manual_seed(1)
    values, scales = quantize(torch.randn(70, 333, generator=gen), bits, 128)
    x, bias = torch.randn(2, 5, 333, generator=gen), torch.randn(70, generator=gen)
    weight = dequantize(values, scales, bits, 333, torch.float64)
    want = nn.functional.linear(x.double(), weight, bias.double())
    got = low_bit_linear(x, values, scales, bits, 333, bias)
    assert got.shape == (2, 5, 70) and got.dtype == torch.float32
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4)


def test_a_linear_layer_gets_the_low_bit_forward_and_other_modules_keep_theirs():
    class OwnForward(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    plain, own, conv = nn.Linear(64, 8), OwnForward(64, 8), nn.Conv1d(4, 8, 3)
    for module in (plain, own, conv):
        quantize_parameter(module.requires_grad_(False), "weight", 4, 64)
    assert [use_low_bit_forward(m) for m in (plain, own, conv)] == [True, False, False]
    assert not use_low_bit_forward(nn.Linear(64, 8))  # its weight not quantized
    assert plain.forward.__func__ is low_bit_forward
    assert "forward" not in own.__dict__ and "forward" not in conv.__dict__


@pytest.mark.parametrize("bits", [4, 8])
def test_the_low_bit_forward_takes_its_matmul_where_it_runs_and_the_dequantized_weight_elsewhere(
        bits, monkeypatch):
    """On the CPU the layer dequantizes and calls its own matmul; where `runs_low_bit_linear` holds (CUDA,
    forced here), it returns `low_bit_linear_for_device` of its stored integers, scales and bias."""
    linear = nn.Linear(200, 24).requires_grad_(False)
    weight, bias = linear.weight.clone(), linear.bias
    quantize_parameter(linear, "weight", bits, 64)
    use_low_bit_forward(linear)
    values, scales = quantize(weight, bits, 64)
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(2))
    assert not runs_low_bit_linear(x, torch.float32, 64)
    with torch.no_grad():
        assert torch.equal(linear(x), nn.functional.linear(x, dequantize(values, scales, bits, 200,
                                                                          torch.float32), bias))
        monkeypatch.setattr(draft_linear, "runs_low_bit_linear", lambda x, dtype, group: True)
        monkeypatch.setattr(draft_linear, "low_bit_linear_for_device", low_bit_linear)
        assert torch.equal(linear(x), low_bit_linear(x, values, scales, bits, 200, bias))
        with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):  # as nn.Linear refuses it
            linear(torch.randn(3, 199))


def test_only_a_few_cuda_rows_in_the_weights_dtype_and_word_groups_run_the_low_bit_matmul():
    meta = torch.empty(MAX_ROWS, 64, device="meta")
    assert not runs_low_bit_linear(meta, torch.float32, 128)  # not CUDA
    if torch.cuda.is_available():
        x = torch.zeros(MAX_ROWS, 64, device="cuda")
        assert runs_low_bit_linear(x, torch.float32, 128) and runs_low_bit_linear(x[:1], torch.float32, 64)
        assert not runs_low_bit_linear(torch.zeros(MAX_ROWS + 1, 64, device="cuda"), torch.float32, 128)
        assert not runs_low_bit_linear(x, torch.bfloat16, 128)
        assert not runs_low_bit_linear(x, torch.float32, 66)  # a word would straddle two groups


def test_the_low_bit_matmul_run_by_tritons_interpreter_matches_the_reference():
    """The low-bit matmul's Triton code run by Triton's interpreter on the CPU (a fresh Python with
    TRITON_INTERPRET=1) against `low_bit_linear`, bit for bit, over hypothesis-drawn rows, outputs,
    columns, bits, groups, dtypes and stored bytes."""
    pytest.importorskip("triton")
    run = run_interpreted(Path(__file__).parent, "import interpreted_matmul_kernel as m; "
                          "m.check_random_cases(); m.check_a_wrong_width_is_refused()")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
