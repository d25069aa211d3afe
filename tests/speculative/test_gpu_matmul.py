"""The self-draft's low-bit matmul (`speculative/matmul_kernel.py`) on a real GPU: bit for bit the torch
reference `quantize.low_bit_linear` (on the GPU and on the CPU), eagerly and compiled (one graph, in
CUDA graphs too), without writing a dequantized weight; a self-draft's linear layers run through it and
give the tokens, logits and acceptance they give with the reference. Run with `pytest -m gpu
tests/speculative` on a CUDA machine; skipped elsewhere."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model
from hypothesis import given, settings
from hypothesis import strategies as st
from low_bit_cases import DTYPES, count_calls, cuda_linear, low_bit_case, same_bits
from test_gpu_speculative import offloaded, run
from torch import nn

import weightstream as ws
from weightstream.speculative import draft_linear
from weightstream.speculative.draft_linear import MAX_ROWS, low_bit_forward, use_low_bit_forward
from weightstream.speculative.quantize import low_bit_linear

pytestmark = pytest.mark.gpu


def kernel(*args):
    from weightstream.speculative import matmul_kernel

    return matmul_kernel.low_bit_linear(*args)


@pytest.fixture
def kernel_calls(monkeypatch):
    """How many times the kernel ran eagerly."""
    from weightstream.speculative import matmul_kernel

    return count_calls(monkeypatch, matmul_kernel, "low_bit_linear")


def cuda(*tensors):
    return [t.cuda() if t is not None else None for t in tensors]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 4, 8])
@pytest.mark.parametrize("shape", [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)])
def test_the_kernel_equals_the_reference_on_the_gpu_bit_for_bit_at_model_sizes(shape, rows, bits, dtype):
    outputs, columns = shape
    x, values, scales, bias = cuda(*low_bit_case((rows,), outputs, columns, bits, 128, dtype, True, False,
                                                 torch.Generator().manual_seed(rows)))
    got = kernel(x, values, scales, bits, columns, bias)
    assert got.is_cuda and same_bits(got, low_bit_linear(x, values, scales, bits, columns, bias))


@settings(max_examples=60, deadline=None)
@given(lead=st.sampled_from([(1,), (2,), (3,), (8,), (2, 3), (1, 1, 3)]),
       outputs=st.integers(1, 1500), columns=st.integers(1, 1500), bits=st.sampled_from([4, 8]),
       group=st.sampled_from([64, 96, 128, 256]), dtype=st.sampled_from(DTYPES), bias=st.booleans(),
       raw=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_any_case_multiplies_on_the_gpu_as_the_reference_does(lead, outputs, columns, bits, group, dtype,
                                                               bias, raw, seed):
    """Any scales from subnormal to 1e12 (`raw`), columns no group or lane count divides, one row to
    eight (the kernel takes more than `MAX_ROWS`, which only chooses where it is used): the GPU kernel,
    the reference on the GPU and the reference on the CPU agree bit for bit."""
    case = low_bit_case(lead, outputs, columns, bits, group, dtype, bias, raw,
                        torch.Generator().manual_seed(seed))
    got = kernel(*cuda(*case[:3]), bits, columns, cuda(case[3])[0])
    assert same_bits(got, low_bit_linear(*case[:3], bits, columns, case[3]))
    assert same_bits(got, low_bit_linear(*cuda(*case[:3]), bits, columns, cuda(case[3])[0]))


def test_the_kernel_writes_no_dequantized_weight():
    """The point of it: a 14336 x 4096 int4 layer over 4 rows allocates its output only (the bfloat16
    weight dequantization writes is 117 MB)."""
    x, values, scales, bias = cuda(*low_bit_case((4,), 14336, 4096, 4, 128, torch.bfloat16, False, False,
                                                 torch.Generator().manual_seed(0)))
    kernel(x, values, scales, 4, 4096, bias)  # compiled and loaded
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = kernel(x, values, scales, 4, 4096, bias)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before <= out.numel() * out.element_size() + (1 << 20)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_linear_layer_on_the_gpu_runs_its_few_rows_through_the_kernel(bits, kernel_calls):
    linear, bias, values, scales = cuda_linear(bits)
    assert use_low_bit_forward(linear) and linear.forward.__func__ is low_bit_forward
    x = torch.randn(MAX_ROWS, 1000, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        assert same_bits(linear(x), low_bit_linear(x, values, scales, bits, 1000, bias))
        assert kernel_calls[0] == 1
        many = torch.randn(MAX_ROWS + 1, 1000, device="cuda").to(torch.bfloat16)  # the dequantizing path
        assert torch.equal(linear(many), nn.functional.linear(many, linear.weight, bias))
        assert kernel_calls[0] == 1


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_the_kernel_compiles_in_one_graph_and_equals_the_reference(mode):
    torch._dynamo.reset()
    linear, bias, values, scales = cuda_linear(4)
    use_low_bit_forward(linear)
    x = torch.randn(MAX_ROWS, 1000, device="cuda").to(torch.bfloat16)
    want = low_bit_linear(x, values, scales, 4, 1000, bias)
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(linear, fullgraph=True, mode=mode, dynamic=False)
    with torch.no_grad():
        for _ in range(3):  # recorded, then replayed
            assert same_bits(compiled(x).clone(), want)
    assert not torch._dynamo.utils.counters["graph_break"]
    torch._dynamo.reset()


def self_draft_matches_its_reference(bits, do_sample, calls, monkeypatch, module, name, reference):
    """Offloaded (the draft holds copies of the streamed blocks) and resident: a self-draft generation
    whose kernel ran (`calls`) gives the tokens, logits and drafted tokens accepted per pass (which only
    the draft's proposals decide) it gives with `module.<name>` replaced by its torch `reference`."""
    ref = make_model("llama", dtype=torch.bfloat16).cuda()
    for model in (ref, offloaded(make_model("llama", dtype=torch.bfloat16).cuda())):
        calls[0] = 0
        a = run(model, draft=ws.SelfDraft(bits=bits), do_sample=do_sample)
        assert calls[0] > 0
        with monkeypatch.context() as patch:
            patch.setattr(module, name, reference)
            b = run(model, draft=ws.SelfDraft(bits=bits), do_sample=do_sample)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logits, b.logits)
        assert a.stats.accepted == b.stats.accepted


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_a_self_draft_gives_the_tokens_it_gives_with_the_reference(bits, do_sample, kernel_calls,
                                                                   monkeypatch):
    """The root's one-token steps run the kernel; with `low_bit_linear` instead, the same generation."""
    self_draft_matches_its_reference(bits, do_sample, kernel_calls, monkeypatch, draft_linear,
                                     "low_bit_linear_for_device", low_bit_linear)


def test_a_compiled_self_draft_runs_the_kernel_in_one_graph_and_keeps_the_tokens(monkeypatch):
    """Compiled in CUDA graphs, offloaded: no graph break, and the greedy tokens of the same compiled
    generation whose draft dequantizes instead (the draft proposes; the model's verify decides)."""
    model = offloaded(make_model("llama", dtype=torch.bfloat16).cuda())
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    got = run(model, draft="self", compile="reduce-overhead")
    assert not torch._dynamo.utils.counters["graph_break"]
    torch._dynamo.reset()
    monkeypatch.setattr(draft_linear, "runs_low_bit_linear", lambda x, dtype, group: False)
    want = run(model, draft="self", compile="reduce-overhead")
    assert torch.equal(got.tokens, want.tokens)
    torch._dynamo.reset()
