"""A whole diffusers pipeline offloaded under one budget (`weightstream/pipeline.py`): a tiny FluxPipeline
(CLIP and T5 text encoders with word-level tokenizers built in memory, a Flux transformer, a VAE) gives
the resident pipeline's image bit for bit, and restore() puts every weight back. The budget split is
checked against brute force over every combination of placements."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import weightstream as ws
from weightstream.cost import ModelCost
from weightstream.errors import BudgetError, OffloadStateError
from weightstream.pipeline import PipelineHandle, front, modules_of, split_budget
from weightstream.plan import _candidates, placement_of
from weightstream.probe import H200

pytest.importorskip("diffusers")


def tokenizer(max_len: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "a photo of cat dog red blue".split()
    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   eos_token="[EOS]", model_max_length=max_len)


def tiny_flux_pipeline(seed: int = 0):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=16, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=8,
                                        projection_dim=8, eos_token_id=2, pad_token_id=0, bos_token_id=1))
    t5 = T5EncoderModel(T5Config(vocab_size=16, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=2,
                                 pad_token_id=0, eos_token_id=2))
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                                         attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                         pooled_projection_dim=16, axes_dims_rope=(2, 2, 4))
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16),
                        down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2,
                        norm_num_groups=4, layers_per_block=1, shift_factor=0.0, scaling_factor=1.0)
    for m in (clip, t5, transformer, vae):
        m.eval().requires_grad_(False)
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=clip,
                        tokenizer=tokenizer(8), text_encoder_2=t5, tokenizer_2=tokenizer(8),
                        transformer=transformer)


def generate(pipe, seed: int = 0, output_type: str = "pt") -> torch.Tensor:
    out = pipe("a photo of a red cat", height=16, width=16, num_inference_steps=2, guidance_scale=3.5,
               max_sequence_length=8, generator=torch.Generator().manual_seed(seed), output_type=output_type)
    return out.images


def state(pipe) -> dict[str, torch.Tensor]:
    return {f"{n}.{k}": v.clone() for n, m in modules_of(pipe).items() for k, v in m.state_dict().items()}


def total_bytes(pipe) -> int:
    tensors = [t for m in modules_of(pipe).values() for t in m.state_dict().values()]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.fixture(scope="module")
def reference():
    pipe = tiny_flux_pipeline()
    return generate(pipe), generate(pipe, output_type="latent"), state(pipe)


@pytest.mark.parametrize("strategy", ["stream", "auto"])
def test_whole_pipeline_offloaded_is_exact_and_restores(reference, strategy):
    image, latents, before = reference
    pipe = tiny_flux_pipeline()
    budget = total_bytes(pipe) // 2
    handle = ws.offload(pipe, gpu_memory=budget, device="cpu", strategy=strategy)
    assert isinstance(handle, PipelineHandle)
    stats = handle.stats
    assert set(stats.components) == set(handle.placements) == {"vae", "text_encoder", "text_encoder_2",
                                                                "transformer"}
    assert stats.gpu_bytes <= budget
    off = sum(s.streamed_bytes + s.uva_bytes for s in stats.components.values())
    assert off >= total_bytes(pipe) - budget  # what does not fit the budget really left the device
    if strategy == "stream":
        assert all(s.groups > 0 for s in stats.components.values())  # every component streams
    assert stats.calls["transformer"] == 28 and stats.calls["vae"] == 1
    assert "transformer (x28 per generation)" in str(stats)
    for _ in range(2):
        assert torch.equal(generate(pipe), image)
    assert torch.equal(generate(pipe, output_type="latent"), latents)
    copies = handle.stats.components["transformer"].copies
    assert strategy != "stream" or copies > 0 or handle.placements["transformer"].n_slots == 1
    with pytest.raises(OffloadStateError):
        ws.offload(pipe, gpu_memory=budget, device="cpu")
    handle.restore()
    after = state(pipe)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert torch.equal(generate(pipe), image)
    with pytest.raises(OffloadStateError):
        handle.restore()
    ws.offload(pipe, gpu_memory=budget, device="cpu").restore()  # offloadable again once restored


def test_a_budget_below_the_minimum_says_what_would_fit():
    pipe = tiny_flux_pipeline()
    with pytest.raises(BudgetError) as err:
        ws.offload(pipe, gpu_memory=1000, device="cpu", strategy="stream")
    assert "give at least" in str(err.value) and err.value.minimum_bytes > 1000
    ws.offload(pipe, gpu_memory=err.value.minimum_bytes, device="cpu", strategy="stream").restore()


def test_a_component_in_training_mode_is_refused():
    pipe = tiny_flux_pipeline()
    pipe.vae.train()
    with pytest.raises(OffloadStateError, match="pipe.vae.eval()"):
        ws.offload(pipe, gpu_memory="1GiB", device="cpu")


def block_cost(n: int, size: int, fixed: int) -> ModelCost:
    return ModelCost(fixed, fixed // 2, (size,) * n, width=0, tensor_bytes=((size // 2, size // 2),) * n)


def test_the_component_called_every_step_gets_the_resident_bytes():
    # Two identical models; one runs 28 times per generation, the other once: the bytes the budget
    # can keep resident beyond the minimum go to the one called every step.
    costs = {"transformer": block_cost(6, 1 << 20, 1 << 16), "text_encoder": block_cost(6, 1 << 20, 1 << 16)}
    minimum = sum(front(c, 4096, H200, "stream")[0].gpu_bytes for c in costs.values())
    plans = split_budget(costs, minimum + 3 * (1 << 20), {"transformer": 28, "text_encoder": 1},
                         {"transformer": 4096, "text_encoder": 4096}, H200, "stream")
    assert plans["transformer"].placement.resident_bytes > plans["text_encoder"].placement.resident_bytes


@settings(max_examples=25, deadline=None)
@given(blocks=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 64), st.integers(0, 40)), min_size=1,
                       max_size=3),
       calls=st.lists(st.integers(1, 30), min_size=3, max_size=3),
       tokens=st.sampled_from([1, 256, 4096]), share=st.floats(0.0, 1.0))
def test_the_split_is_the_fastest_combination_that_fits(blocks, calls, tokens, share):
    costs = {f"c{i}": block_cost(n, size << 16, fixed << 12) for i, (n, size, fixed) in enumerate(blocks)}
    call = {name: calls[i] for i, name in enumerate(costs)}
    tok = dict.fromkeys(costs, tokens)
    everything = {name: [placement_of(c, s, k, u, p, tokens, H200)
                         for s, u, k, p in _candidates(len(c.block_bytes), "auto", 2, 2)]
                  for name, c in costs.items()}
    lo = sum(min(p.gpu_bytes for p in ps) for ps in everything.values())
    hi = sum(max(p.gpu_bytes for p in ps) for ps in everything.values())
    budget = int(lo + share * (hi - lo))
    plans = split_budget(costs, budget, call, tok, H200)
    assert sum(p.placement.gpu_bytes for p in plans.values()) <= budget
    got = sum(p.generation_ms for p in plans.values())
    best = min(sum(call[n] * p.prediction.ms for n, p in zip(costs, combo, strict=True))
               for combo in itertools.product(*everything.values())
               if sum(p.gpu_bytes for p in combo) <= budget)
    assert got == pytest.approx(best, rel=1e-12)


def test_plan_shows_the_per_component_placement_of_a_pipeline_folder(tmp_path, capsys):
    import json

    from weightstream.cli import main

    pipe = tiny_flux_pipeline().to(dtype=torch.bfloat16)  # plan builds a folder's components in bf16
    pipe.save_pretrained(tmp_path)
    budget = total_bytes(pipe) // 2
    assert main(["plan", str(tmp_path), "--gpu-memory", str(budget), "--strategy", "stream", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["components"]) == {"vae", "text_encoder", "text_encoder_2", "transformer"}
    assert report["gpu_bytes"] <= budget and report["components"]["transformer"]["calls"] == 28
    handle = ws.offload(pipe, gpu_memory=budget, device="cpu", strategy="stream")  # the same split
    for name, c in report["components"].items():
        p = handle.placements[name]
        assert (c["gpu_bytes"], c["streamed_blocks"]) == (p.gpu_bytes, len(p.streamed)), name
    handle.restore()
    assert main(["plan", str(tmp_path), "--gpu-memory", str(budget)]) == 0
    assert "transformer" in capsys.readouterr().out
