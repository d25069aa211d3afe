"""from_pretrained: tiny checkpoints saved to a temp folder, loaded back under small budgets."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import make_model, rss_while, weight_bytes
from transformers import AutoModelForCausalLM

import weightstream as ws

LOADABLE = ["llama", "qwen2", "mistral", "gpt2"]


def save(model, folder, shard="60KB"):
    model.save_pretrained(folder, max_shard_size=shard)
    return folder


def ids_for(seed=0, batch=2, length=9):
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("strategy", ["stream", "uva", "auto"])
@pytest.mark.parametrize("fraction", [0.35, 0.7])
@pytest.mark.parametrize("arch", LOADABLE)
def test_loaded_model_equals_transformers_own_load(tmp_path, arch, fraction, strategy):
    folder = save(make_model(arch), tmp_path)
    assert len([f for f in os.listdir(folder) if f.endswith(".safetensors")]) > 1  # sharded
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    budget = int(weight_bytes(reference) * fraction)
    model = ws.from_pretrained(folder, gpu_memory=budget, device="cpu", progress=False, strategy=strategy)
    stats = ws.handle_of(model).stats
    assert stats.streamed_bytes + stats.uva_bytes > 0 and stats.placement_kind != "resident"
    assert (strategy != "stream" or stats.groups >= 1) and (strategy != "uva" or stats.uva_bytes > 0)
    with torch.no_grad():
        assert torch.equal(model(ids_for()).logits, reference(ids_for()).logits)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids_for(1, 1), **kwargs), reference.generate(ids_for(1, 1), **kwargs))



@pytest.mark.parametrize("draft", [None, "prompt-lookup"])
def test_the_generation_config_is_read_as_transformers_reads_it(tmp_path, draft):
    """generation_config.json holds an instruct model's extra stop tokens and its defaults: built from
    config.json alone, the offloaded model generated past them (model.generate and ws.generate)."""
    from transformers import GenerationConfig

    lm = make_model("llama")
    ids = ids_for(2, 1, 5)
    first = lm.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 5:]
    stop = int(first[3])  # a token greedy decoding reaches: generation must end there
    lm.generation_config = GenerationConfig(eos_token_id=[2, stop], pad_token_id=0, repetition_penalty=1.3)
    lm.save_pretrained(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    model = ws.from_pretrained(tmp_path, gpu_memory=int(weight_bytes(reference) * 0.4), device="cpu",
                               progress=False)
    assert model.generation_config.to_dict() == reference.generation_config.to_dict()
    want = reference.generate(ids, max_new_tokens=12)
    assert int(want[0, -1]) in (2, stop) and want.shape[1] < 5 + 12  # it stopped at a stop token
    assert torch.equal(model.generate(ids, max_new_tokens=12), want)
    if draft is not None:  # the stop tokens read; the repetition penalty it cannot apply refused by name
        def speculative(m):
            return ws.generate(m, ids, max_new_tokens=12, draft=draft, progress=False).new_tokens

        with pytest.raises(ws.ArgumentError, match="repetition_penalty=1.3"):
            speculative(model)
        for m in (model, reference):
            m.generation_config.repetition_penalty = 1.0
        got = speculative(model)
        assert torch.equal(got, speculative(reference)) and int(got[-1]) in (2, stop)


def test_dtype_conversion_matches_transformers(tmp_path):
    folder = save(make_model("llama"), tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    model = ws.from_pretrained(folder, gpu_memory="200KB", dtype="bfloat16", device="cpu", progress=False)
    assert next(model.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(model(ids_for()).logits, reference(ids_for()).logits)


def test_load_never_holds_more_than_one_shard_beyond_the_final_placement(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=2)
    big = LlamaForCausalLM(config).eval()
    folder = save(big, tmp_path, shard="20MB")
    shard_bytes = max(os.path.getsize(folder / f) for f in os.listdir(folder) if f.endswith(".safetensors"))
    total = weight_bytes(big)
    del big
    model, before, peak, final = rss_while(lambda: ws.from_pretrained(
        folder, gpu_memory=total // 3, device="cpu", progress=False, strategy="stream"))
    stats = ws.handle_of(model).stats
    assert stats.groups >= 4
    # on the CPU backend "device" memory is host memory too: weights + staging slots, nothing more
    assert final - before <= total + stats.staging_bytes + 32 * 2**20
    assert peak - final <= shard_bytes + 32 * 2**20  # extra over the final footprint: < one shard


# --- errors: each says what to fix --------------------------------------------------------------------

def test_missing_shard(tmp_path):
    folder = save(make_model("llama"), tmp_path)
    os.remove(folder / sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))[1])
    with pytest.raises(ws.CheckpointError, match="missing"):
        ws.from_pretrained(folder, gpu_memory="1GB", device="cpu")


def test_truncated_shard(tmp_path):
    folder = save(make_model("llama"), tmp_path)
    shard = folder / sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-64])
    with pytest.raises(ws.CheckpointError, match="truncated"):
        ws.from_pretrained(folder, gpu_memory="1GB", device="cpu")


def test_shape_that_does_not_match_the_config(tmp_path):
    folder = save(make_model("llama"), tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 80
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ws.CheckpointError, match=r"shape \[96, 64\] in the checkpoint but \[80, 64\]"):
        ws.from_pretrained(folder, gpu_memory="1GB", device="cpu")


def test_unknown_architecture(tmp_path):
    folder = save(make_model("llama"), tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "no-such-architecture"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ws.CheckpointError, match="config.json"):
        ws.from_pretrained(folder, gpu_memory="1GB", device="cpu")


def test_budget_too_small(tmp_path):
    folder = save(make_model("llama"), tmp_path)
    with pytest.raises(ws.BudgetError, match="at least"):
        ws.from_pretrained(folder, gpu_memory="10KB", device="cpu")


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ws.CheckpointError, match="config.json"):
        ws.from_pretrained(tmp_path, gpu_memory="1GB", device="cpu")
    with pytest.raises(ws.CheckpointError, match="not a folder"):
        ws.from_pretrained(tmp_path / "nothing", gpu_memory="1GB", device="cpu")


# --- the disk tier -----------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_disk_tier_is_exact_and_restores(tmp_path, arch):
    folder = save(make_model(arch), tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    budget = int(weight_bytes(reference) * 0.4)
    load = dict(gpu_memory=budget, device="cpu", progress=False, strategy="stream")
    plain = ws.handle_of(ws.from_pretrained(folder, **load)).stats
    group = plain.staging_bytes // plain.slots
    # two bounce buffers plus room for one and a half of the four streamed groups in host memory
    model = ws.from_pretrained(folder, cpu_memory=3 * group + group // 2, **load)
    stats = ws.handle_of(model).stats
    assert 0 < stats.disk_bytes < stats.streamed_bytes  # some groups on disk, some in host memory
    with torch.no_grad():
        for seed in range(2):
            assert torch.equal(model(ids_for(seed)).logits, reference(ids_for(seed)).logits)
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids_for(1, 1), **kwargs), reference.generate(ids_for(1, 1), **kwargs))
    ws.handle_of(model).restore()
    want = reference.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())


def test_disk_tier_needs_room_for_its_bounce_buffers(tmp_path):
    folder = save(make_model("llama"), tmp_path)
    with pytest.raises(ws.BudgetError, match="bounce buffers"):
        ws.from_pretrained(folder, gpu_memory="200KB", cpu_memory="10KB", device="cpu", strategy="stream")


def test_disk_tier_refuses_a_dtype_change(tmp_path):
    folder = save(make_model("llama"), tmp_path)
    with pytest.raises(ws.CheckpointError, match="dtype='float32'"):
        ws.from_pretrained(folder, gpu_memory="200KB", cpu_memory="100KB", dtype="bfloat16", device="cpu",
                           strategy="stream")


def _compressed_disk_load(folder, device="cpu", **extra):
    """A bf16 checkpoint loaded compressed with cpu_memory for one streamed group (besides the two
    bounce buffers): the other groups stay on disk."""
    load = dict(gpu_memory=int(weight_bytes(make_model("llama", dtype=torch.bfloat16)) * 0.75), device=device,
                progress=False, strategy="stream", compress=True, profile=ws.REFERENCE_PROFILE)
    probe = ws.handle_of(ws.from_pretrained(folder, **load))
    group = probe.placement.slot_bytes
    probe.restore()
    return ws.from_pretrained(folder, cpu_memory=3 * group + group // 2, **load, **extra)


@pytest.mark.parametrize("chosen", [False, True])
def test_compressed_disk_tier_reads_its_cache_and_is_exact(tmp_path, chosen):
    folder = save(make_model("llama", dtype=torch.bfloat16), tmp_path / "ckpt")
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    want = reference.state_dict()
    model = _compressed_disk_load(folder, **({"cache_dir": tmp_path / "cache"} if chosen else {}))
    handle = ws.handle_of(model)
    disk, stats = handle.engine.transfer.disk, handle.stats
    assert handle.placement.compressed and 0 < stats.disk_bytes < stats.streamed_bytes
    assert disk.blobs, "some disk groups must shrink"
    cache = disk.cache.path
    assert cache.is_file() and (cache.parent == tmp_path / "cache" or not chosen)
    raw_of_coded = sum(t.nbytes for g in disk.blobs for t, _ in disk.groups[g])
    assert os.path.getsize(cache) == stats.disk_cache_bytes == sum(b.nbytes for b in disk.blobs.values())
    assert stats.disk_cache_bytes < raw_of_coded
    assert stats.disk_wire_bytes < stats.disk_bytes and stats.disk_ratio < 1
    assert stats.wire_bytes < stats.wire_raw_bytes  # the disk groups' blobs count on the wire
    with torch.no_grad():
        for seed in range(3):
            before = disk.bytes_read
            assert torch.equal(model(ids_for(seed)).logits, reference(ids_for(seed)).logits)
            if seed:  # blobs, not the raw tensors: each forward reads its later groups and the next
                # forward's first ones (the first forward also read its own first groups)
                assert disk.bytes_read - before == stats.disk_wire_bytes
    assert handle.engine.transfer.bounce.numel() == disk.max_read_bytes  # sized for what it holds
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())  # guards: true weights
    handle.restore()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    assert not cache.exists()
    assert (tmp_path / "cache").is_dir() if chosen else not cache.parent.exists()  # only its own folder


def test_compressed_disk_tier_cache_folder_that_cannot_be_written_says_which(tmp_path):
    folder = save(make_model("llama", dtype=torch.bfloat16), tmp_path / "ckpt")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ws.ArgumentError, match="a_file.*cache_dir= a folder you can write"):
        _compressed_disk_load(folder, cache_dir=tmp_path / "a_file" / "cache")


# --- the model classes users load ----------------------------------------------------------------------

def _seq2seq_and_encoders():
    import transformers as tf

    small = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                 num_attention_heads=4)
    return {
        "t5": lambda: tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=96,
                                                                num_layers=3, num_heads=4)),
        "bert": lambda: tf.BertModel(tf.BertConfig(**small)),
        "bert-mlm": lambda: tf.BertForMaskedLM(tf.BertConfig(**small)),
    }


@pytest.mark.parametrize("arch", ["t5", "bert", "bert-mlm"])
def test_seq2seq_and_encoder_checkpoints_load_as_the_class_they_were_saved_from(tmp_path, arch):
    torch.manual_seed(0)
    saved = _seq2seq_and_encoders()[arch]().eval()
    save(saved, tmp_path)
    reference = type(saved).from_pretrained(tmp_path).eval()
    model = ws.from_pretrained(tmp_path, gpu_memory=int(weight_bytes(reference) * 0.7), device="cpu",
                               progress=False, strategy="stream")
    assert type(model) is type(saved) and ws.handle_of(model).stats.groups >= 1
    ids = ids_for()
    with torch.no_grad():
        if arch == "t5":
            got, want = (m(input_ids=ids, decoder_input_ids=ids[:, :4]).logits for m in (model, reference))
        else:
            got, want = (m(ids)[0] for m in (model, reference))
    assert torch.equal(got, want)


def test_a_config_naming_a_class_transformers_lacks_says_what_loads(tmp_path):
    folder = save(make_model("llama"), tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"architectures": ["LlamaForTelepathy"]}))
    with pytest.raises(ws.CheckpointError, match="LlamaForTelepathy.*T5ForConditionalGeneration"):
        ws.from_pretrained(folder, gpu_memory="1GB", device="cpu")


# --- auto and the host budget; plan predicts the load ---------------------------------------------------

def test_auto_keeps_to_cpu_memory_where_it_would_read_blocks_in_place(tmp_path):
    """The reported case at a tiny scale: a budget where auto reads blocks in place (zero copy), with
    cpu_memory too small for those blocks: auto streams instead, part of it from disk, exactly."""
    folder = save(make_model("llama"), tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    total = weight_bytes(reference)
    load = dict(gpu_memory=total // 2, device="cpu", progress=False)
    assert ws.handle_of(ws.from_pretrained(folder, **load)).stats.placement_kind == "uva"  # no host limit
    cpu_memory = int(total * 0.4)  # less than the zero-copy blocks; enough for the disk tier
    with pytest.raises(ws.BudgetError, match="cpu_memory"):  # zero copy alone cannot keep to it
        ws.from_pretrained(folder, cpu_memory=cpu_memory, strategy="uva", **load)
    model = ws.from_pretrained(folder, cpu_memory=cpu_memory, **load)
    stats = ws.handle_of(model).stats
    assert stats.requested_strategy == "auto" and stats.placement_kind == "stream"
    assert stats.disk_bytes > 0
    with torch.no_grad():
        assert torch.equal(model(ids_for()).logits, reference(ids_for()).logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cpu_fraction", [None, 0.4])
def test_plan_predicts_the_placement_the_load_gets(tmp_path, dtype, cpu_fraction):
    from weightstream.planview import plan_report

    folder = save(make_model("llama", dtype=dtype), tmp_path)
    total = weight_bytes(make_model("llama", dtype=dtype))
    budget, cpu_memory = total // 2, cpu_fraction and int(total * cpu_fraction)
    report = plan_report(str(folder), budget, cpu_memory=cpu_memory)
    assert report["dtype"] == str(dtype).removeprefix("torch.")
    model = ws.from_pretrained(folder, gpu_memory=budget, cpu_memory=cpu_memory, device="cpu", progress=False)
    handle = ws.handle_of(model)
    p = handle.placement
    assert report["streamed"]["blocks"] == list(p.streamed) and report["zero_copy"]["blocks"] == list(p.uva)
    assert report["streamed"]["slots"] == p.n_slots and report["gpu_bytes"] == p.gpu_bytes
    assert report["placement_kind"] == handle.stats.placement_kind
    assert report["disk"]["bytes"] == handle.stats.disk_bytes
    assert (cpu_memory is None) == (not report["disk"]["bytes"])


def test_a_read_failing_mid_load_raises_it_and_leaves_no_engine_behind(tmp_path, monkeypatch):
    """The read that fails (a disk gone mid-load) is what the caller sees; nothing stays registered,
    and the process-wide hooks are off again (the GPU twin checks that no memory stays allocated)."""
    import gc

    from weightstream.engine import engine, ops
    from weightstream.formats import convert

    folder = save(make_model("llama"), tmp_path)
    calls = []
    original = convert.read_into  # every tensor of a load is read there

    def failing_read(stored, dst):
        calls.append(1)
        if len(calls) == 5:
            raise OSError("disk gone")
        return original(stored, dst)

    monkeypatch.setattr(convert, "read_into", failing_read)
    gc.collect()  # earlier tests' dropped models, whose engines would otherwise go mid-test
    engines = len(ops.engines())
    with pytest.raises(OSError, match="disk gone"):
        ws.from_pretrained(folder, gpu_memory=300_000, device="cpu", strategy="stream", progress=False)
    gc.collect()
    assert len(calls) == 5 and len(ops.engines()) == engines
    if not engines:
        assert not engine.process_hooks_installed()


# --- checkpoints transformers loads otherwise than the config alone says ----------------------------------

def test_tied_weights_stored_with_different_values_are_refused_saying_how_to_untie_them(tmp_path):
    """config.json ties lm_head to the embeddings, the checkpoint stores both with different values:
    transformers loads them untied; loading the first into the one tied tensor gave wrong embeddings."""
    from safetensors.torch import load_file, save_file

    model = make_model("llama")
    model.config.tie_word_embeddings = True
    model.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["lm_head.weight"] = torch.randn_like(state["model.embed_tokens.weight"])
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ws.CheckpointError, match='"tie_word_embeddings": false'):
        ws.from_pretrained(tmp_path, gpu_memory="1GiB", device="cpu", progress=False)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()  # stored twice, equal: loads
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    reference = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    loaded = ws.from_pretrained(tmp_path, gpu_memory=int(weight_bytes(reference) * 0.5), device="cpu",
                                progress=False)
    with torch.no_grad():
        assert torch.equal(loaded(ids_for()).logits, reference(ids_for()).logits)


def test_t5_in_fp16_keeps_the_tensors_transformers_keeps_in_fp32(tmp_path):
    saved = _seq2seq_and_encoders()["t5"]().eval()
    save(saved, tmp_path)
    reference = type(saved).from_pretrained(tmp_path, dtype=torch.float16).eval()
    model = ws.from_pretrained(tmp_path, gpu_memory=int(weight_bytes(reference) * 0.7), device="cpu",
                               progress=False, strategy="stream", dtype="float16")
    want = reference.state_dict()
    assert any(v.dtype == torch.float32 for v in want.values())  # the feed-forward outputs (`wo`)
    assert all(v.dtype == want[k].dtype and torch.equal(v, want[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("dtype", [None, "auto"])
def test_a_config_without_a_dtype_loads_in_the_stored_dtype_as_transformers_does(tmp_path, dtype):
    model = make_model("llama", dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    reference = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reference.dtype == torch.bfloat16
    loaded = ws.from_pretrained(tmp_path, gpu_memory=int(weight_bytes(reference) * 0.5), device="cpu",
                                progress=False, dtype=dtype)
    assert loaded.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(loaded(ids_for()).logits, reference(ids_for()).logits)


def test_a_header_giving_a_tensor_other_bytes_than_its_shape_needs_is_refused(tmp_path):
    import struct

    folder = save(make_model("llama"), tmp_path)
    shard = sorted(folder.glob("*.safetensors"))[-1]
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin, end - 4]
    text = json.dumps(header, separators=(",", ":")).encode()
    shard.write_bytes(raw[:8] + text + b" " * (n - len(text)) + raw[8 + n :])
    with pytest.raises(ws.CheckpointError, match="its header gives it"):
        ws.from_pretrained(folder, gpu_memory="1GiB", device="cpu", progress=False)


def test_a_disk_tier_shard_saved_again_after_the_load_is_refused_at_the_next_read(tmp_path):
    """The disk tier reads each forward from the offsets found at load: a shard saved again (another
    header length moves every offset) gave garbage silently."""
    folder = save(make_model("llama"), tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    load = dict(gpu_memory=int(weight_bytes(reference) * 0.4), device="cpu", progress=False,
                strategy="stream")
    plain = ws.handle_of(ws.from_pretrained(folder, **load)).stats
    group = plain.staging_bytes // plain.slots
    model = ws.from_pretrained(folder, cpu_memory=3 * group + group // 2, **load)
    assert ws.handle_of(model).stats.disk_bytes > 0
    with torch.no_grad():
        assert torch.equal(model(ids_for()).logits, reference(ids_for()).logits)
    reference.save_pretrained(folder, max_shard_size="60KB")  # the same tensors, written anew
    with pytest.raises(ws.CheckpointError, match="changed after the model was loaded"), torch.no_grad():
        model(ids_for())
