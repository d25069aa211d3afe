"""The self-draft's Triton dequantization (`speculative/dequant_kernel.py`) on a real GPU: bit for bit the
torch reference `quantize.dequantize` (on the GPU and on the CPU), eagerly and compiled (one graph, in
CUDA graphs too); a self-draft reads its weights through it and gives the tokens and logits it gives
with the reference. Run with `pytest -m gpu tests/speculative` on a CUDA machine; skipped elsewhere."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model
from hypothesis import given, settings
from hypothesis import strategies as st
from low_bit_cases import DTYPES, count_calls, cuda_linear, raw_stored, same_bits
from test_gpu import eager_rounding  # noqa: F401  (a fixture)
from test_gpu_matmul import self_draft_matches_its_reference
from test_gpu_speculative import offloaded, run
from torch import nn

from weightstream.speculative import draft_linear
from weightstream.speculative import quantize as quantize_module
from weightstream.speculative.quantize import dequantize, quantize

pytestmark = pytest.mark.gpu

def kernel(values, scales, bits, columns, dtype):
    from weightstream.speculative import dequant_kernel

    return dequant_kernel.dequantize(values, scales, bits, columns, dtype)


@pytest.fixture
def kernel_calls(monkeypatch):
    """How many times the kernel ran (eager calls; a compiled graph launches it from its own code)."""
    from weightstream.speculative import dequant_kernel

    return count_calls(monkeypatch, dequant_kernel, "dequantize")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(4096, 4096), (1024, 14336), (14336, 4096), (8, 3, 1000), (5, 1)])
def test_the_kernel_equals_the_reference_on_the_gpu_bit_for_bit(shape, bits, dtype):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.02
    values, scales = quantize(weight.cuda(), bits, 128)
    got = kernel(values, scales, bits, shape[-1], dtype)
    assert got.is_cuda and same_bits(got, dequantize(values, scales, bits, shape[-1], dtype))
    assert same_bits(got, dequantize(values.cpu(), scales.cpu(), bits, shape[-1], dtype))


@settings(max_examples=100, deadline=None)
@given(lead=st.lists(st.integers(1, 40), min_size=1, max_size=2).map(tuple),
       columns=st.integers(1, 3000), bits=st.sampled_from([4, 8]), group=st.sampled_from([64, 128, 256]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1), raw=st.booleans())
def test_any_stored_weight_dequantizes_on_the_gpu_as_the_reference_does(lead, columns, bits, group, dtype,
                                                                        seed, raw):
    """Subnormal, huge and negative scales and rounding ties included (`raw`)."""
    if raw:
        values, scales = raw_stored(lead, columns, bits, group, torch.Generator().manual_seed(seed))
    else:
        weight = torch.randn(*lead, columns, generator=torch.Generator().manual_seed(seed))
        values, scales = quantize(weight, bits, group)
    want = dequantize(values, scales, bits, columns, dtype)
    got = kernel(values.cuda(), scales.cuda(), bits, columns, dtype)
    assert same_bits(got, want)
    assert same_bits(got, dequantize(values.cuda(), scales.cuda(), bits, columns, dtype))


@pytest.mark.parametrize("bits", [4, 8])
def test_a_module_on_the_gpu_reads_its_weight_through_the_kernel(bits, kernel_calls):
    linear, bias, values, scales = cuda_linear(bits)
    want = dequantize(values, scales, bits, 1000, torch.bfloat16)
    x = torch.randn(7, 1000, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        assert same_bits(linear.weight, want) and kernel_calls[0] == 1
        assert torch.equal(linear(x), nn.functional.linear(x, want, bias)) and kernel_calls[0] == 2


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_the_kernel_compiles_in_one_graph_and_equals_the_reference(mode):
    torch._dynamo.reset()
    linear, bias, values, scales = cuda_linear(4)
    want = dequantize(values, scales, 4, 1000, torch.bfloat16)
    x = torch.randn(7, 1000, device="cuda").to(torch.bfloat16)
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(lambda x: (linear.weight * 1, linear(x)), fullgraph=True, mode=mode,
                             dynamic=False)
    with torch.no_grad():
        for _ in range(3):  # recorded, then replayed
            got_weight, got = compiled(x)
            got_weight, got = got_weight.clone(), got.clone()
            assert same_bits(got_weight, want)
            assert torch.equal(got, nn.functional.linear(x, want, bias))
    assert not torch._dynamo.utils.counters["graph_break"]
    torch._dynamo.reset()


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_a_self_draft_gives_the_tokens_it_gives_with_the_reference(bits, do_sample, kernel_calls,
                                                                   monkeypatch):
    """Offloaded (the draft holds copies of the streamed blocks) and resident: the same tokens, logits and
    drafted tokens accepted per pass (which only the draft's proposals decide) with the kernel as with
    `dequantize`, and the kernel ran (the low-bit matmul turned off: its own tests are
    test_gpu_matmul.py)."""
    monkeypatch.setattr(draft_linear, "runs_low_bit_linear", lambda x, dtype, group: False)
    self_draft_matches_its_reference(bits, do_sample, kernel_calls, monkeypatch, quantize_module,
                                     "dequantize_for_device", dequantize)


@pytest.mark.parametrize("mode", [True, "reduce-overhead"])
def test_a_compiled_self_draft_gives_the_tokens_it_gives_with_the_reference(mode, monkeypatch,
                                                                           eager_rounding):  # noqa: F811
    monkeypatch.setattr(draft_linear, "runs_low_bit_linear", lambda x, dtype, group: False)
    model = offloaded(make_model("llama", dtype=torch.bfloat16).cuda())
    torch._dynamo.utils.counters.clear()
    a = run(model, draft="self", compile=mode, do_sample=True)
    assert not torch._dynamo.utils.counters["graph_break"]
    torch._dynamo.reset()
    with monkeypatch.context() as patch:
        patch.setattr(quantize_module, "dequantize_for_device", dequantize)
        b = run(model, draft="self", compile=mode, do_sample=True)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logits, b.logits)
    assert a.stats.accepted == b.stats.accepted
