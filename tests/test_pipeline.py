"""A whole diffusers pipeline offloaded under one budget (`weightstream/pipeline.py`): a tiny FluxPipeline
(CLIP and T5 text encoders with word-level tokenizers built in memory, a Flux transformer, a VAE) gives
the resident pipeline's image bit for bit, and restore() puts every weight back. The budget split is
checked against brute force over every combination of placements."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import weightstream as ws
import weightstream.placement.prepare
from weightstream.bench.flux_pipeline import tokenizer  # word-level, in memory
from weightstream.errors import ArgumentError, BudgetError, OffloadStateError
from weightstream.pipeline import PipelineHandle, _merge, front, modules_of, split_budget
from weightstream.placement.cost import ModelCost
from weightstream.placement.plan import _candidates, landing_options, placement_of
from weightstream.placement.probe import H200

pytest.importorskip("diffusers")


def tiny_flux_pipeline(seed: int = 0, width: int = 16):
    """A FluxPipeline of tiny random models; `width` 64 in bf16 gives tensors the codec shrinks."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    w = width
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=16, hidden_size=w, intermediate_size=4 * w,
                                        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=8,
                                        projection_dim=8, eos_token_id=2, pad_token_id=0, bos_token_id=1))
    t5 = T5EncoderModel(T5Config(vocab_size=16, d_model=w, d_kv=w // 2, d_ff=4 * w, num_layers=2, num_heads=2,
                                 pad_token_id=0, eos_token_id=2))
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                                         attention_head_dim=w // 2, num_attention_heads=2,
                                         joint_attention_dim=w, pooled_projection_dim=w,
                                         axes_dims_rope=(w // 8, w // 8, w // 4))
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


@pytest.fixture(scope="module")
def wide_reference():
    pipe = tiny_flux_pipeline(width=64).to(dtype=torch.bfloat16)
    return generate(pipe), state(pipe)


def test_a_compressed_pipeline_is_exact_and_its_groups_cross_the_link_smaller(wide_reference, monkeypatch):
    image, before = wide_reference
    pipe = tiny_flux_pipeline(width=64).to(dtype=torch.bfloat16)
    with pytest.raises(BudgetError) as err:  # slots and landing buffers of every component do not fit
        ws.offload(pipe, gpu_memory=total_bytes(pipe) // 2, device="cpu", strategy="stream", compress=True)
    assert "compress='auto' fits in" in str(err.value)  # what the landing buffers cost
    budget = err.value.minimum_bytes  # one slot and one landing buffer each
    predicted = []  # each tensor's wire size is predicted for the split, not again for its offload
    wire_nbytes = weightstream.placement.prepare._wire_nbytes
    monkeypatch.setattr(weightstream.placement.prepare, "_wire_nbytes",
                        lambda e: predicted.append(id(e.tensor)) or wire_nbytes(e))
    handle = ws.offload(pipe, gpu_memory=budget, device="cpu", strategy="stream", compress=True)
    monkeypatch.undo()
    assert predicted and len(predicted) == len(set(predicted))
    stats = handle.stats
    assert stats.gpu_bytes <= budget  # landing buffers included
    for name, placement in handle.placements.items():
        assert placement.streamed and placement.compressed, name  # every component's groups shrink
        s = stats.components[name]
        assert s.wire_ratio < 1 and s.wire_bytes < s.wire_raw_bytes, name
    assert "ratio" in str(stats)
    for _ in range(2):
        assert torch.equal(generate(pipe), image)
    handle.restore()
    after = state(pipe)
    assert all(torch.equal(after[k], before[k]) for k in before)
    # "auto" on the CPU backend streams raw (no link to save), as offload() of one model does
    handle = ws.offload(pipe, gpu_memory=budget, device="cpu", strategy="stream")
    assert not any(p.compressed for p in handle.placements.values())
    assert torch.equal(generate(pipe), image)
    handle.restore()
    with pytest.raises(ArgumentError, match="compress="):
        ws.offload(pipe, gpu_memory=budget, device="cpu", compress="yes")
    with pytest.raises(ArgumentError, match="tokens: offload.pipeline. plans every component"):
        ws.offload(pipe, gpu_memory=budget, device="cpu", tokens=4096)  # one model's argument


def tiny_sd3_pipeline(seed: int = 0):
    """A StableDiffusion3Pipeline of tiny random models: two CLIP text encoders with projection, a T5
    encoder, an SD3 transformer, a VAE."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    torch.manual_seed(seed)

    def clip():
        return CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=8, projection_dim=8, eos_token_id=2, pad_token_id=0, bos_token_id=1))

    # joint_attention_dim: the T5 width (CLIP's 8 + 8 padded to it); pooled: the two CLIP projections
    parts = dict(
        text_encoder=clip(), text_encoder_2=clip(),
        text_encoder_3=T5EncoderModel(T5Config(vocab_size=16, d_model=16, d_kv=8, d_ff=32, num_layers=2,
                                               num_heads=2, pad_token_id=0, eos_token_id=2)),
        transformer=SD3Transformer2DModel(sample_size=4, patch_size=1, in_channels=4, num_layers=3,
                                          attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                          caption_projection_dim=16, pooled_projection_dim=16, out_channels=4,
                                          pos_embed_max_size=16),
        vae=AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16),
                          down_block_types=("DownEncoderBlock2D",) * 2,
                          up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=4, layers_per_block=1,
                          shift_factor=0.0, scaling_factor=1.0))
    for m in parts.values():
        m.eval().requires_grad_(False)
    return StableDiffusion3Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), tokenizer=tokenizer(8),
                                    tokenizer_2=tokenizer(8), tokenizer_3=tokenizer(8), **parts)


def tiny_wan_pipeline(seed: int = 0):
    """A WanPipeline of tiny random models: a UMT5 encoder, a Wan transformer, Wan's causal video VAE
    (whose blocks update a cache list they are called with)."""
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    parts = dict(
        text_encoder=UMT5EncoderModel(UMT5Config(vocab_size=16, d_model=16, d_kv=8, d_ff=32, num_layers=2,
                                                 num_heads=2, pad_token_id=0, eos_token_id=2)),
        transformer=WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8,
                                          in_channels=4, out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32,
                                          num_layers=3, rope_max_seq_len=32),
        vae=AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1,
                             temperal_downsample=[False], latents_mean=[0.0] * 4, latents_std=[1.0] * 4))
    for m in parts.values():
        m.eval().requires_grad_(False)
    return WanPipeline(tokenizer=tokenizer(8), scheduler=FlowMatchEulerDiscreteScheduler(), **parts)


def generate_kind(pipe) -> torch.Tensor:
    """One 2-step generation of an SD3 image or a 5-frame Wan video, fixed seed, as a tensor."""
    args = dict(num_inference_steps=2, max_sequence_length=8, generator=torch.Generator().manual_seed(0),
                output_type="pt")
    if type(pipe).__name__ == "WanPipeline":
        return pipe("a photo of a red cat", height=16, width=16, num_frames=5, **args).frames
    return pipe("a photo of a red cat", height=8, width=8, **args).images


@pytest.mark.parametrize("build, components", [
    (tiny_sd3_pipeline, {"vae", "text_encoder", "text_encoder_2", "text_encoder_3", "transformer"}),
    (tiny_wan_pipeline, {"vae", "text_encoder", "transformer"}),
])
def test_sd3_and_wan_pipelines_offloaded_whole_are_exact_and_restore(build, components):
    """Beyond Flux: under the smallest budget they fit, every component of an SD3 and a Wan pipeline
    streams and the generation is bit-identical to the resident one's; restore() puts every weight
    back."""
    reference = generate_kind(build())
    pipe = build()
    before = state(pipe)
    with pytest.raises(BudgetError) as err:
        ws.offload(pipe, gpu_memory=1000, device="cpu", strategy="stream")
    handle = ws.offload(pipe, gpu_memory=err.value.minimum_bytes, device="cpu", strategy="stream")
    assert set(handle.stats.components) == components
    assert all(s.groups > 0 for s in handle.stats.components.values())
    assert torch.equal(generate_kind(pipe), reference)
    assert torch.equal(generate_kind(pipe), reference)  # again, with what the first call learned
    handle.restore()
    after = state(pipe)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_each_denoiser_is_planned_for_the_tokens_of_its_pipelines_default_generation():
    from diffusers import UNet2DConditionModel

    from weightstream.pipeline import DEFAULT_TOKENS, _resolve_calls, denoiser_tokens

    pipe = tiny_flux_pipeline()
    calls, tokens = _resolve_calls(modules_of(pipe), 20, None, {"vae": 64})
    assert calls == {"vae": 1, "text_encoder": 1, "text_encoder_2": 1, "transformer": 20}
    assert tokens == {"vae": 64, "text_encoder": 512, "text_encoder_2": 512, "transformer": 4608}
    with torch.device("meta"):
        unet = UNet2DConditionModel(block_out_channels=(8, 16), layers_per_block=1, sample_size=8,
                                    norm_num_groups=4, cross_attention_dim=8, attention_head_dim=2,
                                    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    assert denoiser_tokens(unet) == DEFAULT_TOKENS["denoiser"] == 4096  # no default generation known


def test_a_budget_below_the_minimum_says_what_would_fit():
    pipe = tiny_flux_pipeline()
    with pytest.raises(BudgetError) as err:
        ws.offload(pipe, gpu_memory=1000, device="cpu", strategy="stream")
    assert "give at least" in str(err.value) and err.value.minimum_bytes > 1000
    ws.offload(pipe, gpu_memory=err.value.minimum_bytes, device="cpu", strategy="stream").restore()


def test_a_component_offloaded_on_its_own_is_named():
    pipe = tiny_flux_pipeline()
    handle = ws.offload(pipe.transformer, gpu_memory=total_bytes(pipe), device="cpu")
    with pytest.raises(OffloadStateError, match=r"pipe.transformer: .*already offloaded"):
        ws.offload(pipe, gpu_memory=total_bytes(pipe) // 2, device="cpu")
    handle.restore()
    ws.offload(pipe, gpu_memory=total_bytes(pipe) // 2, device="cpu").restore()


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
    best = min(sum(p.prediction.calls_ms(call[n]) for n, p in zip(costs, combo, strict=True))
               for combo in itertools.product(*everything.values())
               if sum(p.gpu_bytes for p in combo) <= budget)
    assert got == pytest.approx(best, rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(fronts=st.lists(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), min_size=1, max_size=6),
                       min_size=1, max_size=4),
       slack=st.integers(0, 60))
def test_merging_fronts_finds_the_fastest_combination_within_the_budget(fronts, slack):
    # small integers: many ties in bytes and in ms, and float sums that are exact
    fronts = [[(b, float(ms)) for b, ms in f] for f in fronts]
    budget = sum(min(b for b, _ in f) for f in fronts) + slack
    chosen = _merge(fronts, budget)
    assert len(chosen) == len(fronts)
    got = [f[i] for f, i in zip(fronts, chosen, strict=True)]
    assert sum(b for b, _ in got) <= budget
    best = min((sum(ms for _, ms in combo), sum(b for b, _ in combo))
               for combo in itertools.product(*fronts) if sum(b for b, _ in combo) <= budget)
    assert (sum(ms for _, ms in got), sum(b for b, _ in got)) == best


def forms(cost: ModelCost, tokens: int, compress) -> list:
    """Every placement a component may get: each candidate raw and, where compression is considered,
    compressed with each landing-buffer option; True drops a candidate's raw form where it has a
    compressed one."""
    out = []
    for s, u, k, p in _candidates(len(cost.block_bytes), "auto", 2, 2):
        coded = [placement_of(cost, s, k, u, p, tokens, H200, compressed=True, landing_buffers=b)
                 for b in landing_options(k, len(s))] if s and compress is not False else []
        coded = [c for c in coded if c is not None]
        if not coded or compress is not True:
            out.append(placement_of(cost, s, k, u, p, tokens, H200))
        out += coded
    return out


@settings(max_examples=25, deadline=None)
@given(blocks=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 64), st.integers(0, 40),
                                 st.floats(0.3, 1.2)), min_size=1, max_size=2),
       calls=st.lists(st.integers(1, 30), min_size=2, max_size=2),
       tokens=st.sampled_from([1, 256, 4096]), share=st.floats(0.0, 1.0))
def test_a_split_with_compression_is_the_fastest_combination_that_fits(blocks, calls, tokens, share):
    # each block has two tensors whose predicted wire size is `ratio` of their bytes (over 1: they do
    # not shrink, so the component streams raw)
    costs = {f"c{i}": dataclasses.replace(block_cost(n, size << 16, fixed << 12),
                                          tensor_wire=((int((size << 15) * ratio),) * 2,) * n)
             for i, (n, size, fixed, ratio) in enumerate(blocks)}
    call = {name: calls[i] for i, name in enumerate(costs)}
    tok = dict.fromkeys(costs, tokens)
    every = {c: {name: forms(cost, tokens, c) for name, cost in costs.items()} for c in (False, True, "auto")}
    lo = sum(min(p.gpu_bytes for p in ps) for ps in every[True].values())
    hi = sum(max(p.gpu_bytes for p in ps) for ps in every["auto"].values())
    budget = int(lo + share * (hi - lo))
    got = {}
    for compress, everything in every.items():
        try:
            plans = split_budget(costs, budget, call, tok, H200, compress=compress)
        except BudgetError:
            combos = itertools.product(*everything.values())
            assert all(sum(p.gpu_bytes for p in combo) > budget for combo in combos)
            continue
        assert sum(p.placement.gpu_bytes for p in plans.values()) <= budget  # landing buffers included
        for name, plan in plans.items():
            p = plan.placement
            assert p.compressed <= (compress is not False)
            if compress is True and p.streamed:  # compressed wherever this candidate's groups shrink
                coded = placement_of(costs[name], p.streamed, p.n_slots, p.uva, p.part, tokens, H200,
                                     compressed=True)
                assert p.compressed or coded is None
        got[compress] = sum(p.generation_ms for p in plans.values())
        best = min(sum(p.prediction.calls_ms(call[n]) for n, p in zip(costs, combo, strict=True))
                   for combo in itertools.product(*everything.values())
                   if sum(p.gpu_bytes for p in combo) <= budget)
        assert got[compress] == pytest.approx(best, rel=1e-12)
    assert "auto" in got and got["auto"] <= min(got.values()) * (1 + 1e-12)  # auto considers both


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
    assert report["components"]["transformer"]["tokens"] == 4096 + 512  # FluxPipeline's 1024x1024 step
    assert report["components"]["text_encoder_2"]["tokens"] == 512
    handle = ws.offload(pipe, gpu_memory=budget, device="cpu", strategy="stream")  # the same split
    for name, c in report["components"].items():
        p = handle.placements[name]
        assert (c["gpu_bytes"], c["streamed_blocks"]) == (p.gpu_bytes, len(p.streamed)), name
    handle.restore()
    assert main(["plan", str(tmp_path), "--gpu-memory", str(budget)]) == 0
    assert "transformer" in capsys.readouterr().out


def test_plan_of_a_pipeline_folder_shows_compressed_components(tmp_path, capsys):
    import json

    from weightstream.cli import main

    pipe = tiny_flux_pipeline(width=64).to(dtype=torch.bfloat16)
    pipe.save_pretrained(tmp_path)
    budget = total_bytes(pipe) * 3 // 4
    args = ["plan", str(tmp_path), "--gpu-memory", str(budget), "--strategy", "stream"]
    assert main(args + ["--compress", "true", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["gpu_bytes"] <= budget and report["compress"] is True
    streaming = {name: c for name, c in report["components"].items() if c["streamed_blocks"]}
    assert "transformer" in streaming
    for name, c in streaming.items():  # predicted for Hugging Face-initialized weights: they all shrink
        assert c["compressed"] and c["landing_buffers"] >= 1 and c["landing_bytes"] > 0, name
        assert 0 < c["wire_bytes"] < c["wire_raw_bytes"], name
    raw = ["--compress", "false", "--json"]
    assert main(args + raw) == 0
    report = json.loads(capsys.readouterr().out)
    assert not any(c["compressed"] or c["landing_bytes"] for c in report["components"].values())
    assert all(c["wire_bytes"] == c["wire_raw_bytes"] for c in report["components"].values())
    assert main(args + ["--compress", "true"]) == 0
    text = capsys.readouterr().out
    assert "transformer" in text and "compressed (landing buffers" in text and "predicted for Hugging" in text


@pytest.mark.gpu
def test_a_compressed_pipeline_on_the_gpu_is_exact_and_its_weights_leave_the_gpu():
    # the split is forced: the reference profile (not this GPU's) and the least budget that holds every
    # component streaming compressed through one slot and one landing buffer
    pipe = tiny_flux_pipeline(width=64).to(dtype=torch.bfloat16)
    pipe.to("cuda")
    image = generate(pipe)  # the resident pipeline on the GPU
    pipe.to("cpu")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    kwargs = dict(device="cuda", strategy="stream", compress=True, profile=ws.REFERENCE_PROFILE)
    with pytest.raises(BudgetError) as err:
        ws.offload(pipe, gpu_memory=total_bytes(pipe) // 2, **kwargs)
    budget = err.value.minimum_bytes
    handle = ws.offload(pipe, gpu_memory=budget, **kwargs)
    assert all(p.streamed and p.compressed for p in handle.placements.values())
    held = torch.cuda.memory_allocated() - before
    n_tensors = sum(len(m.state_dict()) for m in modules_of(pipe).values())
    assert held <= budget + 512 * n_tensors  # the streamed bytes left the GPU (allocator rounding aside)
    assert held < total_bytes(pipe) * 0.9
    for _ in range(2):
        assert torch.equal(generate(pipe), image)
    assert all(s.wire_ratio < 1 for s in handle.stats.components.values())
    handle.restore()


def test_plan_of_a_pipeline_folder_on_a_gpu_machine_weighs_compression_with_auto(tmp_path, monkeypatch):
    from weightstream.pipeline import plan_pipeline

    pipe = tiny_flux_pipeline(width=64).to(dtype=torch.bfloat16)
    pipe.save_pretrained(tmp_path)
    total = total_bytes(pipe)
    # a slow link and a free decoder: where a compressed placement fits beside what stays resident,
    # "auto" must find it (the folder's components are built on the meta device, so the wire sizes
    # must be predicted even though they are planned "on the CPU")
    slow_link = dataclasses.replace(H200, copy_s_per_byte=1e-6, decode_s_per_byte=1e-15)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as `weightstream plan` on a GPU machine
    coded = 0
    for i in range(12):
        budget = total // 2 + i * total // 24
        auto = plan_pipeline(str(tmp_path), budget, strategy="stream", profile=slow_link)  # compress="auto"
        raw = plan_pipeline(str(tmp_path), budget, strategy="stream", profile=slow_link, compress=False)
        assert auto["compress"] == "auto" and auto["gpu_bytes"] <= budget
        assert auto["predicted_ms_per_generation"] <= raw["predicted_ms_per_generation"]
        assert not any(c["compressed"] for c in raw["components"].values())
        coded += any(c["compressed"] for c in auto["components"].values())
    assert coded  # at some budgets compression won
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # without CUDA "auto" plans raw
    assert plan_pipeline(str(tmp_path), total // 2, strategy="stream", profile=slow_link)["compress"] is False


def test_plan_of_a_diffusers_model_folder_and_from_pretrained_refusing_it(tmp_path, capsys):
    import json

    from weightstream.cli import main
    from weightstream.errors import CheckpointError

    pipe = tiny_flux_pipeline().to(dtype=torch.bfloat16)
    pipe.save_pretrained(tmp_path)
    folder = str(tmp_path / "transformer")
    weights = sum(t.numel() * t.element_size() for t in pipe.transformer.state_dict().values())
    assert main(["plan", folder, "--gpu-memory", str(weights // 2), "--strategy", "stream", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["weight_bytes"] == weights and report["blocks"] == 4  # 2 double + 2 single blocks
    assert report["gpu_bytes"] <= weights // 2 and report["streamed"]["blocks"]
    # a Flux transformer is planned for FluxPipeline's 1024x1024 step: 4096 latent + 512 text tokens
    assert report["optimized_for_tokens"] == 4608 and set(report["predicted"]) == {"forward_4608"}
    assert main(["plan", folder, "--gpu-memory", str(weights // 2), "--tokens", "64"]) == 0
    assert "predicted forward_64:" in capsys.readouterr().out
    with pytest.raises(CheckpointError, match="diffusers FluxTransformer2DModel config"):
        ws.from_pretrained(folder, gpu_memory=weights // 2, device="cpu")


@pytest.mark.parametrize("strategy", ["stream", "uva", "auto"])
def test_every_component_reports_the_strategy_it_was_asked_for(strategy):
    pipe = tiny_flux_pipeline()
    handle = ws.offload(pipe, gpu_memory=total_bytes(pipe) * 6 // 10, device="cpu", strategy=strategy)
    try:
        for name, component in handle.handles.items():
            assert component.stats.requested_strategy == strategy, name
            assert f"(asked for {strategy})" in str(component.stats)
            # the CPU backend copies synchronously into CPU buffers: its stats say so
            assert "synchronous copies" in str(component.stats) and "async" not in str(component.stats)
            assert "slots" not in str(component.stats)
    finally:
        handle.restore()
