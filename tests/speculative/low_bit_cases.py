"""What the tests of the self-draft's kernels share (their interpreted runs on the CPU,
`interpreted_dequant_kernel.py` and `interpreted_matmul_kernel.py`, and their GPU tests,
`test_gpu_dequant.py` and `test_gpu_matmul.py`): the dtypes, a bitwise comparison, stored low-bit
weights that reach every rounding case of the cast, matmul cases, and a count of a kernel's calls."""

from __future__ import annotations

import torch

from weightstream.speculative.quantize import padded

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BITS_OF = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (compared on the CPU)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.view(BITS_OF[a.dtype]).cpu(), b.view(BITS_OF[b.dtype]).cpu())


def raw_stored(lead: tuple[int, ...], columns: int, bits: int, group: int,
               gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, scales) as `quantize` stores them, of any bytes and any finite float32 scales
    (subnormal, huge, negative: every rounding case of the cast, overflow to inf)."""
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


def low_bit_case(lead: tuple[int, ...], outputs: int, columns: int, bits: int, group: int, dtype: torch.dtype,
                 bias: bool, raw: bool, gen: torch.Generator):
    """(x, values, scales, bias) for the low-bit matmul: x (*lead, columns) in `dtype`, an (outputs,
    columns) weight stored as `quantize` stores it (of a random weight, or, raw, any bytes and any
    scales from subnormal to 1e12 with either sign), and a bias in `dtype` or None. Every sum stays
    finite in float32 (NaN bits differ between processors), and float16 may still overflow."""
    from weightstream.speculative.quantize import quantize

    if raw:
        values, _ = raw_stored((outputs,), columns, bits, group, gen)
        width = padded(columns, group) // group
        magnitude = 10.0 ** (torch.rand(outputs, width, 1, generator=gen) * 50 - 38)
        sign = torch.randint(0, 2, (outputs, width, 1), generator=gen) * 2 - 1
        scales = (magnitude * sign).float()
    else:
        values, scales = quantize(torch.randn(outputs, columns, generator=gen) * 0.05, bits, group)
    spread = 10.0 ** torch.randint(-3, 4, (), generator=gen)
    x = (torch.randn(*lead, columns, generator=gen) * spread).to(dtype)
    b = torch.randn(outputs, generator=gen).to(dtype) if bias else None
    return x, values, scales, b


def count_calls(monkeypatch, module, name: str) -> list[int]:
    """Replace `module.<name>` by a wrapper that counts its calls; the count is the list's one item."""
    calls = [0]
    launch = getattr(module, name)

    def counted(*args):
        calls[0] += 1
        return launch(*args)

    monkeypatch.setattr(module, name, counted)
    return calls


def cuda_linear(bits: int, columns: int = 1000, outputs: int = 96):
    """(linear, bias, values, scales): a bfloat16 `nn.Linear` on CUDA whose weight
    `quantize.quantize_parameter` replaced (groups of 128), its bias, and its original weight's stored
    (values, scales)."""
    from torch import nn

    from weightstream.speculative.quantize import quantize, quantize_parameter

    linear = nn.Linear(columns, outputs).to(torch.bfloat16).cuda().requires_grad_(False)
    values, scales = quantize(linear.weight.clone(), bits, 128)
    quantize_parameter(linear, "weight", bits, 128)
    return linear, linear.bias, values, scales
