"""FP8 as transformers' fine-grained FP8 lays it out: Fp8Linear, and from_pretrained of such checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_model
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from torch import nn

import weightstream as ws
from weightstream.formats import fp8

BLOCK = (32, 32)


def ids_for(seed=0, batch=2, length=9):
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 70), st.integers(1, 70), st.sampled_from([(16, 16), (32, 8), None]),
       st.sampled_from([torch.float8_e4m3fn, torch.float8_e5m2]))
def test_quantize_then_dequantize_is_within_half_an_fp8_step(n, k, block, dtype):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n * 100 + k)) * 3
    q, scale = fp8.quantize(w, block, dtype)
    assert q.dtype == dtype and q.shape == w.shape
    assert scale.shape == (() if block is None else (-(-n // block[0]), -(-k // block[1])))
    back = fp8.dequantize(q, scale, block, torch.float32)
    # relative step of the format (3 or 2 mantissa bits), of the block's largest magnitude at worst
    step = 2.0 ** -(3 if dtype == torch.float8_e4m3fn else 2)
    per = scale.max() * torch.finfo(dtype).max
    assert (back - w).abs().max() <= step * per + 1e-6


def test_blockwise_dequantize_broadcast_equals_the_expanded_scales():
    q, scale = fp8.quantize(torch.randn(64, 96), (32, 32))
    expanded = scale.repeat_interleave(32, 0).repeat_interleave(32, 1)
    assert torch.equal(fp8.dequantize(q, scale, (32, 32), torch.float32), q.float() * expanded)


def test_fp8_linear_has_the_parameters_of_transformers_fp8_linear():
    from transformers.integrations.finegrained_fp8 import FP8Linear

    theirs = FP8Linear(96, 160, block_size=(128, 128), has_bias=True)
    ours = fp8.Fp8Linear(96, 160, (128, 128), bias=True)
    want = {k: (v.dtype, v.shape) for k, v in theirs.state_dict().items()}
    got = {k: (v.dtype, v.shape) for k, v in ours.state_dict().items()}
    assert got.keys() == want.keys() and got["weight"] == want["weight"]
    assert got["weight_scale_inv"] == want["weight_scale_inv"]


def fp8_checkpoint(folder, block=BLOCK, shards=2):
    """A tiny Llama quantized to fp8 with block scales, saved as transformers' FP8 checkpoints are:
    config.json with quantization_config, safetensors shards holding weight + weight_scale_inv."""
    model = fp8.quantize_model(make_model("llama"), block)
    model.config.quantization_config = {"quant_method": "fp8", "weight_block_size": list(block),
                                        "activation_scheme": "dynamic"}
    model.config.save_pretrained(folder)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"
             or not model.config.tie_word_embeddings}
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        part = {k: state[k] for k in names[i::shards]}
        save_file(part, folder / f"model-{i}.safetensors", metadata={"format": "pt"})
        weight_map.update({k: f"model-{i}.safetensors" for k in part})
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return model


@pytest.mark.parametrize("strategy", ["stream", "uva"])
def test_from_pretrained_loads_an_fp8_checkpoint_straight_into_place(tmp_path, strategy):
    ref = fp8_checkpoint(tmp_path)
    stored = {}
    for f in tmp_path.glob("*.safetensors"):
        stored.update(load_file(f))
    assert stored["model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    total = sum(t.numel() * t.element_size() for t in stored.values())
    model = ws.from_pretrained(tmp_path, gpu_memory=int(total * 0.6), device="cpu", progress=False,
                               strategy=strategy)
    assert isinstance(model.model.layers[0].mlp.up_proj, fp8.Fp8Linear)
    stats = ws.handle_of(model).stats
    assert stats.streamed_bytes + stats.uva_bytes > 0
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())  # rotary tables, not stored
    assert stats.resident_bytes + stats.streamed_bytes + stats.uva_bytes == total + buffers
    with torch.no_grad():
        for seed in range(2):
            assert torch.equal(model(ids_for(seed)).logits, ref(ids_for(seed)).logits)
    ws.handle_of(model).restore()
    state = model.state_dict()
    for name, tensor in stored.items():  # bit for bit what the checkpoint holds, in its dtype
        assert state[name].dtype == tensor.dtype and torch.equal(state[name].view(torch.uint8),
                                                                 tensor.view(torch.uint8)), name


def test_fp8_streams_half_the_bytes_of_bf16(tmp_path):
    fp8_checkpoint(tmp_path)
    model = ws.from_pretrained(tmp_path, gpu_memory="10MB", device="cpu", progress=False)
    handle = ws.handle_of(model)
    quantized = [e for e in handle.engine.entries if e.dtype == torch.float8_e4m3fn]
    assert quantized and all(e.nbytes == e.tensor.numel() for e in quantized)  # one byte a weight
    assert all(e.bf16_bytes == 2 * e.nbytes for e in quantized)


@pytest.mark.slow
def test_a_compiled_fp8_model_is_exact(tmp_path):
    ref = fp8_checkpoint(tmp_path)
    model = ws.from_pretrained(tmp_path, gpu_memory="100KB", device="cpu", progress=False, strategy="stream")
    assert ws.handle_of(model).stats.groups >= 1
    torch._dynamo.reset()
    with torch.no_grad():
        assert torch.equal(torch.compile(model, fullgraph=True)(ids_for()).logits,
                           torch.compile(ref, fullgraph=True)(ids_for()).logits)
    torch._dynamo.reset()


def test_other_quantization_methods_are_refused(tmp_path):
    fp8_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ws.CheckpointError, match="quant_method='bitsandbytes'.*offload"):
        ws.from_pretrained(tmp_path, gpu_memory="10MB", device="cpu", progress=False)


def test_static_activation_scales_are_refused(tmp_path):
    fp8_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["activation_scheme"] = "static"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ws.CheckpointError, match="activation_scheme='static'"):
        ws.from_pretrained(tmp_path, gpu_memory="10MB", device="cpu", progress=False)


def test_fp8_tensors_are_never_dequantized_silently_on_load(tmp_path):
    """A checkpoint of fp8 tensors whose config lost its quantization_config: the model would ask for
    float32 weights, and converting would be a silent dequantize."""
    fp8_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ws.CheckpointError, match="float8_e4m3fn in the checkpoint but the model expects"):
        ws.from_pretrained(tmp_path, gpu_memory="10MB", device="cpu", progress=False)


def test_replace_linears_keeps_the_lm_head_and_meta():
    with torch.device("meta"):
        model = nn.ModuleDict({"layers": nn.ModuleList([nn.Linear(64, 64)]), "lm_head": nn.Linear(64, 10)})
    swapped = fp8.replace_linears(model, (32, 32))
    assert swapped == ["layers.0"] and type(model["lm_head"]) is nn.Linear
    assert model["layers"][0].weight.is_meta and model["layers"][0].weight.dtype == torch.float8_e4m3fn


def test_fp8_groups_stream_from_the_disk_tier_as_stored(tmp_path):
    ref = fp8_checkpoint(tmp_path)
    load = dict(gpu_memory="100KB", device="cpu", progress=False, strategy="stream")
    plain = ws.handle_of(ws.from_pretrained(tmp_path, **load)).stats
    group = plain.staging_bytes // plain.slots
    model = ws.from_pretrained(tmp_path, cpu_memory=3 * group + group // 2, **load)
    stats = ws.handle_of(model).stats
    assert 0 < stats.disk_bytes < stats.streamed_bytes  # fp8 bytes read from the shards every forward
    with torch.no_grad():
        for seed in range(2):
            assert torch.equal(model(ids_for(seed)).logits, ref(ids_for(seed)).logits)
