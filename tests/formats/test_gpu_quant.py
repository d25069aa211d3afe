"""Quantized weights on a real GPU: torchao int8 / float8 / int4 (tinygemm-packed) weight-only tensors and
plain fp8 + block scales stream exactly eager, compiled and in a CUDA graph; their bytes leave the GPU.

Run with `pytest -m gpu tests/formats/test_gpu_quant.py` on a CUDA machine (torchao optional: its tests skip).
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_gpu import assert_exact_eager_compiled_and_in_a_graph, eager_rounding  # noqa: F401
from test_subclass import assert_same_state, state_leaves, stored_bytes
from torch import nn

import weightstream as ws
from weightstream.engine.guards import live_parameters
from weightstream.formats import fp8, subclass
from weightstream.placement.blocks import find_blocks
from weightstream.placement.entries import _collect
from weightstream.placement.layout import align_up

pytestmark = pytest.mark.gpu


def wide_llama(seed=0):
    """A 4-layer bf16 Llama on the GPU, wide enough for tinygemm's int4 packing (K % 128 == 0)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(config).to(torch.bfloat16).cuda().eval().requires_grad_(False)


def quantized(kind: str) -> nn.Module:
    model = wide_llama()
    if kind == "fp8":
        return fp8.quantize_model(model, (128, 128))
    ao = pytest.importorskip("torchao.quantization")
    configs = {
        "int8": lambda: ao.Int8WeightOnlyConfig(),
        "float8": lambda: ao.Float8WeightOnlyConfig(),
        "int4": lambda: ao.Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d"),
    }
    decoder_linear = lambda m, fqn: isinstance(m, nn.Linear) and "layers" in fqn  # noqa: E731
    ao.quantize_(model, configs[kind](), filter_fn=decoder_linear)
    return model


def streaming_budget(model) -> int:
    """Everything outside the decoder layers plus two slots of one layer's stored bytes, plus slack."""
    blocks = [b.module for b in find_blocks(model)]
    entries = _collect(model, blocks)
    fixed = sum(e.nbytes for e in entries if e.owner is None)
    layer = max(sum(align_up(e.nbytes) for e in entries if e.owner == i) for i in range(len(blocks)))
    return fixed + 2 * layer + 1024


@pytest.mark.parametrize("kind", ["fp8", "int8", "float8", "int4"])
def test_quantized_weights_stream_exactly_and_leave_the_gpu(kind, eager_rounding):  # noqa: F811
    ref = quantized(kind)
    model = copy.deepcopy(ref)
    original = state_leaves(model)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    handle = ws.offload(model, gpu_memory=streaming_budget(model), strategy="stream")
    stats = handle.stats
    assert stats.groups >= 2 and stats.resident_bytes + stats.streamed_bytes == stored_bytes(ref)
    freed = before - torch.cuda.memory_allocated()
    leaves = sum(len(subclass.leaves_of(t)) for t in model.parameters())
    assert abs(freed - (stats.streamed_bytes - stats.staging_bytes)) <= 512 * leaves
    assert_exact_eager_compiled_and_in_a_graph(ref, model)
    handle.restore()
    assert_same_state(model, original)


def test_a_quantized_model_on_the_host_offloads_to_the_gpu_exactly():
    """Quantized on the CPU, offloaded to the GPU: resident subclass weights are rebuilt on the device,
    streamed ones in pinned memory."""
    ao = pytest.importorskip("torchao.quantization")
    ref = wide_llama()
    ao.quantize_(ref, ao.Int8WeightOnlyConfig())
    model = copy.deepcopy(ref).cpu()
    handle = ws.offload(model, gpu_memory=streaming_budget(ref), device="cuda", strategy="stream")
    assert handle.stats.groups >= 2
    # as the forward reads them (parameters() gives the true weights, host tensors for streamed ones)
    assert all(leaf.is_cuda for t in live_parameters(model) for leaf in subclass.leaves_of(t))
    ids = torch.randint(0, 128, (2, 16), device="cuda")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    handle.restore(device="cpu")
    assert all(not leaf.is_cuda for t in model.parameters() for leaf in subclass.leaves_of(t))
