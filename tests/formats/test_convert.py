"""Checkpoints transformers converts on load (per-expert MoE tensors fused into 3-D experts, renamed
keys, chunked projections), saved by transformers itself and loaded straight into their offloaded
places: every tensor, logit and generated token equal to transformers' own resident load."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import rss_while, weight_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_zoo import MOE, ZOO
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import weightstream as ws


def saved(name: str, folder, shard="40KB", dtype=torch.float32):
    model, _ = ZOO[name]()
    model.to(dtype).save_pretrained(folder, max_shard_size=shard)
    return folder


def ids_for(seed=0, batch=2, length=7, vocab=64):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def load(folder, fraction=0.35, **kwargs):
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=kwargs.get("dtype")).eval()
    kwargs = dict(device="cpu", progress=False, strategy="stream") | kwargs
    model = ws.from_pretrained(folder, gpu_memory=int(weight_bytes(reference) * fraction), **kwargs)
    return model, reference


def same_weights(model, reference) -> bool:
    want = reference.state_dict()
    got = model.state_dict()  # the true weights, wherever they live
    return got.keys() == want.keys() and all(torch.equal(v, want[k]) for k, v in got.items())


@pytest.mark.parametrize("name", MOE)
def test_moe_checkpoint_saved_by_transformers_loads_exact(tmp_path, name):
    folder = saved(name, tmp_path)
    model, reference = load(folder)
    stats = ws.handle_of(model).stats
    assert stats.streamed_bytes > 0
    assert same_weights(model, reference)
    with torch.no_grad():
        assert torch.equal(model(ids_for()).logits, reference(ids_for()).logits)
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids_for(1, 1), **kwargs), reference.generate(ids_for(1, 1), **kwargs))


def test_transformers_saves_experts_one_by_one(tmp_path):
    """What the loader must convert: save_pretrained writes Mixtral's per-expert layout and names."""
    folder = saved("mixtral", tmp_path, shard="10MB")
    names = set(load_file(folder / "model.safetensors"))
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in names
    assert not any("gate_up_proj" in n for n in names)


@pytest.mark.parametrize("strategy", ["uva", "auto"])
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_every_strategy_reads_converted_experts_exact(tmp_path, name, strategy):
    model, reference = load(saved(name, tmp_path), fraction=0.5, strategy=strategy)
    with torch.no_grad():
        assert torch.equal(model(ids_for()).logits, reference(ids_for()).logits)


def test_fused_layout_loads_as_stored(tmp_path):
    """A checkpoint in the model's own fused layout (one 3-D tensor per expert projection)."""
    model, _ = ZOO["qwen3_moe"]()
    model.config.save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"
               or not model.config.tie_word_embeddings}, tmp_path / "model.safetensors", {"format": "pt"})
    assert any(k.endswith("experts.gate_up_proj") for k in load_file(tmp_path / "model.safetensors"))
    loaded, reference = load(tmp_path)
    assert same_weights(loaded, reference) and same_weights(loaded, model.eval())


def test_dtype_change_while_fusing(tmp_path):
    model, reference = load(saved("qwen2_moe", tmp_path), dtype=torch.bfloat16)
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(model(ids_for()).logits, reference(ids_for()).logits)


def test_disk_tier_reads_each_expert_into_its_place(tmp_path):
    folder = saved("mixtral", tmp_path)
    probe, _ = load(folder)
    group = ws.handle_of(probe).placement.slot_bytes
    ws.handle_of(probe).restore()
    model, reference = load(folder, cpu_memory=3 * group + group // 2)
    stats = ws.handle_of(model).stats
    assert 0 < stats.disk_bytes < stats.streamed_bytes
    with torch.no_grad():
        for seed in range(2):
            assert torch.equal(model(ids_for(seed)).logits, reference(ids_for(seed)).logits)
    assert same_weights(model, reference)


def test_compressed_load_fuses_before_coding(tmp_path):
    model, reference = load(saved("qwen3_moe", tmp_path, dtype=torch.bfloat16), fraction=0.75, compress=True,
                            dtype=torch.bfloat16, profile=ws.REFERENCE_PROFILE)
    assert ws.handle_of(model).placement.compressed
    with torch.no_grad():
        assert torch.equal(model(ids_for()).logits, reference(ids_for()).logits)
    assert same_weights(model, reference)


def test_conversion_that_is_not_a_placement_runs_transformers_convert(tmp_path):
    """HRM's checkpoints store one gate+q+k+v projection that transformers chunks on load."""
    import transformers

    if not hasattr(transformers, "HrmTextConfig"):
        pytest.skip("this transformers has no HRM text model")
    config = transformers.HrmTextConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                                        num_hidden_layers=4, num_attention_heads=4, head_dim=16, H_cycles=1,
                                        L_cycles=1, num_layers_per_stack=2, max_position_embeddings=64)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path, max_shard_size="40KB")
    stored = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert any("gqkv_proj" in name for name in stored)
    model, reference = load(tmp_path, fraction=0.6)
    assert same_weights(model, reference)
    with torch.no_grad():
        assert torch.equal(model(ids_for()).logits, reference(ids_for()).logits)


def test_a_missing_expert_names_the_fused_tensor(tmp_path):
    folder = saved("qwen3_moe", tmp_path, shard="10MB")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors", {"format": "pt"})
    want = r"layers\.2\.mlp\.experts\.gate_up_proj have shapes \[\[4, 32, 64\], \[3, 32, 64\]\]: an expert"
    with pytest.raises(ws.CheckpointError, match=want):
        ws.from_pretrained(folder, gpu_memory="1GB", device="cpu", progress=False)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(experts=st.integers(1, 12), top=st.integers(1, 4), layers=st.integers(1, 3),
       shard=st.sampled_from(["8KB", "20KB", "100KB", "10MB"]), fraction=st.floats(0.2, 0.9))
def test_any_expert_count_and_shard_split_loads_exact(tmp_path_factory, experts, top, layers, shard,
                                                      fraction):
    from transformers import Qwen3MoeConfig

    folder = tmp_path_factory.mktemp("moe")
    config = Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                            moe_intermediate_size=16, num_experts=experts,
                            num_experts_per_tok=min(top, experts), max_position_embeddings=64)
    torch.manual_seed(experts * 10 + layers)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder, max_shard_size=shard)
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    load = dict(device="cpu", progress=False, strategy="stream")
    try:
        model = ws.from_pretrained(folder, gpu_memory=int(weight_bytes(reference) * fraction), **load)
    except ws.BudgetError as err:  # below what must stay on the device: the least that holds it
        model = ws.from_pretrained(folder, gpu_memory=err.minimum_bytes, **load)
    assert same_weights(model, reference)
    with torch.no_grad():
        assert torch.equal(model(ids_for(experts)).logits, reference(ids_for(experts)).logits)


@pytest.mark.parametrize("options", [[], ["--expert-copies", "--compress", "true"]],
                         ids=["in-place", "coded-copies"])
def test_weightstream_generate_on_a_moe_checkpoint_gives_transformers_tokens(checkpoint, capsys, options):
    """`weightstream generate`, at its defaults and with the routed experts copied and held compressed
    (coded from the files: the summary says so), gives transformers' tokens."""
    from weightstream.cli import main

    folder, tokenizer = checkpoint
    for old in list(folder.glob("model*.safetensors*")) + [folder / "config.json"]:
        old.unlink()
    saved("qwen3_moe", folder, dtype=torch.bfloat16)
    prompt = "w5 w9 w33 w17"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    out = reference.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones_like(ids))
    want = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
    budget = f"{weight_bytes(reference) // 2}B"
    code = main(["generate", str(folder), "--prompt", prompt, "--gpu-memory", budget,
                 "--max-new-tokens", "8", "--device", "cpu", *options])
    printed = capsys.readouterr().out
    assert code == 0 and want and want in printed
    coded = "routed experts of 1 block copied each step, held compressed"
    assert (coded in printed) == bool(options) and "placement " in printed, printed


def test_experts_are_read_into_place_without_building_a_fused_tensor(tmp_path):
    """Host memory beyond the final placement stays below one fused expert tensor: each expert's stored
    tensor is read straight into its region (the CPU backend's "device" is host memory too)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=1000, hidden_size=512, intermediate_size=2048, num_hidden_layers=3,
                           num_attention_heads=8, num_key_value_heads=2, num_local_experts=8,
                           num_experts_per_tok=2)
    big = MixtralForCausalLM(config).to(torch.bfloat16).eval()
    big.save_pretrained(tmp_path, max_shard_size="40MB")
    fused = big.model.layers[0].mlp.experts.gate_up_proj.nbytes  # 32 MiB
    total = weight_bytes(big)
    del big
    model, before, peak, final = rss_while(lambda: ws.from_pretrained(
        tmp_path, gpu_memory=total // 2, device="cpu", progress=False, strategy="stream"))
    stats = ws.handle_of(model).stats
    assert stats.groups >= 2
    assert final - before <= total + stats.staging_bytes + 16 * 2**20
    assert peak - final < fused // 2, (peak - final) / 2**20


@pytest.mark.gpu
@pytest.mark.parametrize("strategy, compress", [("auto", "auto"), ("stream", True), ("uva", False)])
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "deepseek_v2", "gpt_oss"])
def test_gpu_moe_checkpoint_loads_exact(tmp_path, name, strategy, compress):
    folder = saved(name, tmp_path, dtype=torch.bfloat16)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    model = ws.from_pretrained(folder, gpu_memory=int(weight_bytes(reference) * 0.5), device="cuda",
                               progress=False, strategy=strategy, compress=compress)
    stats = ws.handle_of(model).stats
    assert stats.streamed_bytes + stats.uva_bytes > 0
    ids = ids_for().cuda()
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(ids).logits, reference(ids).logits)
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    prompt = ids_for(1, 1).cuda()
    assert torch.equal(model.generate(prompt, **kwargs), reference.generate(prompt, **kwargs))
