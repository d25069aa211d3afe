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
from weightstream.placement.plan import Placement, _candidates, landing_options, placement_of
from weightstream.placement.probe import H200

pytest.importorskip("diffusers")


def tiny_flux_pipeline(seed: int = 0, width: int = 16, layers: int = 2):
    """A FluxPipeline of tiny random models; `width` 64 in bf16 gives tensors the codec shrinks; `layers`
    blocks in each text encoder and in each of the transformer's two lists."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    w = width
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=16, hidden_size=w, intermediate_size=4 * w,
                                        num_hidden_layers=layers, num_attention_heads=2,
                                        max_position_embeddings=8, projection_dim=8, eos_token_id=2,
                                        pad_token_id=0, bos_token_id=1))
    t5 = T5EncoderModel(T5Config(vocab_size=16, d_model=w, d_kv=w // 2, d_ff=4 * w, num_layers=layers,
                                 num_heads=2, pad_token_id=0, eos_token_id=2))
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=layers,
                                         num_single_layers=layers, attention_head_dim=w // 2,
                                         num_attention_heads=2, joint_attention_dim=w,
                                         pooled_projection_dim=w, axes_dims_rope=(w // 8, w // 8, w // 4))
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


# --- a pipeline folder loaded straight into place: ws.from_pretrained(folder) ----------------------------


def saved(pipe, folder) -> str:
    pipe.save_pretrained(folder)
    return str(folder)


def diffusers_loaded(folder: str, dtype: torch.dtype):
    """The resident reference: the folder as diffusers loads it in `dtype`."""
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.from_pretrained(folder, dtype=dtype)


def disk_bytes(handle) -> int:
    return sum(s.disk_bytes for s in handle.stats.components.values())


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory):
    """A saved bf16 FluxPipeline folder, its resident image and state dicts as diffusers loads it."""
    folder = saved(tiny_flux_pipeline().to(dtype=torch.bfloat16), tmp_path_factory.mktemp("flux"))
    reference = diffusers_loaded(folder, torch.bfloat16)
    return folder, generate(reference), state(reference), total_bytes(reference)


def test_a_pipeline_folder_loads_into_place_and_generates_the_resident_image(bf16_folder):
    folder, image, before, total = bf16_folder
    handle = ws.from_pretrained(folder, gpu_memory=total // 2, device="cpu", strategy="stream",
                                progress=False)
    assert isinstance(handle, PipelineHandle)
    pipe = handle.pipe
    assert type(pipe).__name__ == "FluxPipeline" and pipe.tokenizer is not None and pipe.scheduler is not None
    assert set(handle.placements) == {"vae", "text_encoder", "text_encoder_2", "transformer"}
    assert handle.stats.gpu_bytes <= total // 2
    assert all(s.groups > 0 for s in handle.stats.components.values())  # every component streams
    assert disk_bytes(handle) == 0  # no cpu_memory limit: every group in host memory
    for _ in range(2):
        assert torch.equal(generate(pipe), image)
    with pytest.raises(OffloadStateError):
        ws.offload(pipe, gpu_memory=total // 2, device="cpu")  # already offloaded
    handle.restore()
    after = state(pipe)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert all(after[k].dtype == before[k].dtype for k in before)


def test_it_equals_the_pipeline_diffusers_loads_offloaded(bf16_folder):
    folder, image, _, total = bf16_folder
    offloaded = diffusers_loaded(folder, torch.bfloat16)
    h = ws.offload(offloaded, gpu_memory=total // 2, device="cpu", strategy="stream")
    loaded = ws.from_pretrained(folder, gpu_memory=total // 2, device="cpu", strategy="stream",
                                progress=False)
    assert torch.equal(generate(offloaded), generate(loaded.pipe))
    assert torch.equal(generate(loaded.pipe, output_type="latent"), generate(offloaded, output_type="latent"))
    assert loaded.placements == h.placements  # planned from sizes alone, as offload plans from the models
    h.restore()
    loaded.restore()


def test_a_cpu_memory_below_the_streamed_groups_keeps_groups_on_disk_exactly(bf16_folder):
    folder, image, before, total = bf16_folder
    kwargs = dict(gpu_memory=total // 2, device="cpu", strategy="stream", progress=False)
    with pytest.raises(BudgetError) as err:
        ws.from_pretrained(folder, cpu_memory=1000, **kwargs)
    message = str(err.value)
    assert "cpu_memory=1000 B cannot hold" in message and "give at least" in message
    least = err.value.minimum_bytes
    handle = ws.from_pretrained(folder, cpu_memory=least, **kwargs)  # the least that fits: mostly on disk
    # every group of a component on disk but two bounce buffers' worth (a component of two groups keeps
    # them in host memory instead: its buffers would take as much)
    for name, s in handle.stats.components.items():
        assert (s.disk_bytes > 0) == (s.groups > 2), name
    assert handle.stats.components["transformer"].disk_bytes > 0
    assert torch.equal(generate(handle.pipe), image)
    assert torch.equal(generate(handle.pipe), image)
    handle.restore()
    after = state(handle.pipe)
    assert all(torch.equal(after[k], before[k]) for k in before)
    # more host memory keeps more groups off the disk, the denoiser's (called every step) first
    some = ws.from_pretrained(folder, cpu_memory=least + 40_000, **kwargs)
    stats = some.stats.components
    assert 0 < disk_bytes(some) < disk_bytes(handle)
    assert stats["transformer"].disk_bytes < handle.stats.components["transformer"].disk_bytes
    assert torch.equal(generate(some.pipe), image)
    some.restore()


def test_plan_with_cpu_memory_shows_each_components_host_share_and_disk_bytes_as_the_load_gets_them(
        bf16_folder, capsys):
    import json
    import re

    from weightstream.cli import main

    folder, _, _, total = bf16_folder
    plan = ["plan", folder, "--gpu-memory", str(total // 2)]
    assert main([*plan, "--cpu-memory", "1000"]) == 2  # too small: the load's BudgetError, one line
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cpu_memory=1000 B cannot hold" in err and "Traceback" not in err, err
    least = int(re.search(r"give at least .*?\((\d+) bytes\)", err)[1])
    for cpu_memory in (least, least + 40_000, None):
        assert main([*plan, "--json"] + (["--cpu-memory", str(cpu_memory)] if cpu_memory else [])) == 0
        report = json.loads(capsys.readouterr().out)
        handle = ws.from_pretrained(folder, gpu_memory=total // 2, cpu_memory=cpu_memory, device="cpu",
                                    progress=False)
        for name, c in report["components"].items():
            s, p = handle.stats.components[name], handle.placements[name]
            assert (c["gpu_bytes"], c["streamed_blocks"]) == (p.gpu_bytes, len(p.streamed)), name
            assert c["disk_bytes"] == s.disk_bytes, (name, cpu_memory)
        assert report["disk_bytes"] == disk_bytes(handle) and report["cpu_memory_bytes"] == cpu_memory
        assert (report["disk_bytes"] > 0) == (cpu_memory is not None)
        if cpu_memory is not None:
            assert report["host_bytes"] <= cpu_memory
        handle.restore()
    assert main([*plan, "--cpu-memory", str(least)]) == 0
    text = capsys.readouterr().out
    assert "on disk" in text.splitlines()[1] and "stay on disk" in text, text


@settings(max_examples=200, deadline=None)
@given(groups=st.lists(st.tuples(st.integers(0, 30), st.lists(st.integers(1, 40), max_size=5),
                                 st.integers(0, 30)), min_size=1, max_size=4),
       slack=st.integers(0, 300))
def test_host_memory_goes_to_the_most_called_components_and_each_gets_what_it_cannot_do_without(groups,
                                                                                             slack):
    from weightstream.pipeline import host_shares

    needs = {f"c{i}": (uva, sizes) for i, (uva, sizes, _) in enumerate(groups)}
    calls = {f"c{i}": c for i, (_, _, c) in enumerate(groups)}
    least = {n: uva + min(sum(g), 2 * max(g, default=0)) for n, (uva, g) in needs.items()}
    full = {n: uva + sum(g) for n, (uva, g) in needs.items()}
    assert host_shares(needs, calls, None) == dict.fromkeys(needs)
    cpu = sum(least.values()) + slack
    shares = host_shares(needs, calls, cpu)
    assert sum(shares.values()) <= cpu
    assert all(least[n] <= shares[n] <= full[n] for n in needs)
    assert sum(shares.values()) == min(cpu, sum(full.values()))  # nothing left unused that could help
    for a in needs:  # a component short of all its groups has none called less often above its least
        if shares[a] < full[a]:
            assert all(shares[b] == least[b] for b in needs if calls[b] < calls[a])
    if sum(least.values()) > 0:
        with pytest.raises(BudgetError) as err:
            host_shares(needs, calls, sum(least.values()) - 1)
        assert err.value.minimum_bytes == sum(least.values())


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_each_component_gets_the_dtypes_diffusers_gives_it(tmp_path, dtype):
    # fp16: transformers keeps T5's `wo` in float32 (its _keep_in_fp32_modules); float32: stored fp32
    # weights load in fp32 by default (each component in the dtype its weights are stored in)
    folder = saved(tiny_flux_pipeline().to(dtype=dtype), tmp_path)
    reference = diffusers_loaded(folder, dtype)
    expected = {k: v.dtype for k, v in state(reference).items()}
    assert dtype == torch.float32 or torch.float32 in expected.values()  # T5's wo at fp16
    handle = ws.from_pretrained(folder, gpu_memory=total_bytes(reference) // 2, device="cpu",
                                strategy="stream", progress=False)
    assert torch.equal(generate(handle.pipe), generate(reference))
    handle.restore()
    assert {k: v.dtype for k, v in state(handle.pipe).items()} == expected


def test_dtype_converts_every_component_as_diffusers_dtype_does(tmp_path):
    folder = saved(tiny_flux_pipeline(), tmp_path)  # stored in float32
    reference = diffusers_loaded(folder, torch.bfloat16)
    handle = ws.from_pretrained(folder, gpu_memory=total_bytes(reference) // 2, dtype="bf16", device="cpu",
                                strategy="stream", progress=False)
    assert torch.equal(generate(handle.pipe), generate(reference))
    handle.restore()
    assert {v.dtype for v in state(handle.pipe).values() if v.is_floating_point()} == {torch.bfloat16}


def test_a_wan_pipeline_keeps_what_diffusers_keeps_in_float32(tmp_path):
    # WanTransformer3DModel keeps its time embedder and norms in float32 (diffusers'
    # _keep_in_fp32_modules) when loaded in bfloat16
    folder = saved(tiny_wan_pipeline().to(dtype=torch.bfloat16), tmp_path)
    reference = diffusers_loaded(folder, torch.bfloat16)
    kept = [k for k, v in reference.transformer.state_dict().items() if v.dtype == torch.float32]
    assert kept
    total = total_bytes(reference)
    handle = ws.from_pretrained(folder, gpu_memory=total * 6 // 10, device="cpu", strategy="stream",
                                progress=False)
    assert torch.equal(generate_kind(handle.pipe), generate_kind(reference))
    handle.restore()
    assert [k for k, v in handle.pipe.transformer.state_dict().items() if v.dtype == torch.float32] == kept


def test_a_folder_that_is_neither_a_checkpoint_nor_a_pipeline_is_refused(tmp_path):
    from weightstream.errors import CheckpointError

    with pytest.raises(CheckpointError, match="no config.json .a model's. nor model_index.json"):
        ws.from_pretrained(tmp_path, gpu_memory="1GiB", device="cpu")


def test_a_missing_or_unbuildable_component_is_named(tmp_path):
    import json
    import shutil

    from weightstream.errors import CheckpointError

    folder = tmp_path / "flux"
    saved(tiny_flux_pipeline(), folder)
    index = json.loads((folder / "model_index.json").read_text())
    kwargs = dict(gpu_memory="1GiB", device="cpu", progress=False)

    def index_with(**entries):
        (folder / "model_index.json").write_text(json.dumps({**index, **entries}))

    index_with(transformer=["diffusers", "FluxTransformer9DModel"])
    with pytest.raises(CheckpointError, match=r"names the component transformer as "
                                              r"diffusers.FluxTransformer9DModel, which this diffusers"):
        ws.from_pretrained(folder, **kwargs)
    index_with(transformer=["no_such_library", "FluxTransformer2DModel"])
    with pytest.raises(CheckpointError, match="cannot be imported: install"):
        ws.from_pretrained(folder, **kwargs)
    index_with()
    config = json.loads((folder / "vae" / "config.json").read_text())
    (folder / "vae" / "config.json").write_text(json.dumps({**config, "block_out_channels": "wide"}))
    with pytest.raises(CheckpointError, match=r"vae: diffusers cannot build AutoencoderKL from its config"):
        ws.from_pretrained(folder, **kwargs)
    shutil.rmtree(folder / "vae")
    with pytest.raises(CheckpointError, match=r"names the component vae \(AutoencoderKL\), but .* is "
                                              r"missing"):
        ws.from_pretrained(folder, **kwargs)
    with pytest.raises(CheckpointError, match=r"names the component vae"):
        ws.pipeline.plan_pipeline(str(folder), "1GiB")  # `weightstream plan` says the same


def test_missing_weights_and_one_models_arguments_are_refused(tmp_path):
    from weightstream.errors import CheckpointError

    folder = tmp_path / "flux"
    saved(tiny_flux_pipeline(), folder)
    with pytest.raises(ArgumentError, match="tokens: a pipeline is planned per component"):
        ws.from_pretrained(folder, gpu_memory="1GiB", device="cpu", tokens=64, progress=False)
    (folder / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="transformer has no model.safetensors"):
        ws.from_pretrained(folder, gpu_memory="1GiB", device="cpu", progress=False)


def test_the_load_shows_progress(bf16_folder, capsys):
    folder, image, _, total = bf16_folder
    handle = ws.from_pretrained(folder, gpu_memory=total // 2, device="cpu", strategy="stream")
    err = capsys.readouterr().err
    assert "loading pipeline" in err and "loading" in err.replace("loading pipeline", "")
    handle.restore()


@pytest.mark.gpu
@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("on_disk", [False, True])
def test_a_pipeline_folder_loaded_onto_the_gpu_is_exact_and_its_weights_leave_the_gpu(tmp_path, compress,
                                                                                      on_disk):
    # bf16 at width 64: groups the codec shrinks; on_disk: the least cpu_memory, so most groups stream
    # from their files (compressed: from the blob cache)
    folder = saved(tiny_flux_pipeline(width=64, layers=4).to(dtype=torch.bfloat16), tmp_path / "flux")
    reference = diffusers_loaded(folder, torch.bfloat16).to("cuda")
    image, latents = generate(reference), generate(reference, output_type="latent")
    total = total_bytes(reference)
    n_tensors = sum(len(m.state_dict()) for m in modules_of(reference).values())
    del reference
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    kwargs = dict(device="cuda", strategy="stream", compress=compress, profile=ws.REFERENCE_PROFILE,
                  progress=False)
    budget = total // 2
    cpu_memory = None
    if on_disk:
        with pytest.raises(BudgetError) as err:
            ws.from_pretrained(folder, gpu_memory=budget, cpu_memory=1, **kwargs)
        cpu_memory = err.value.minimum_bytes
    handle = ws.from_pretrained(folder, gpu_memory=budget, cpu_memory=cpu_memory, **kwargs)
    stats = handle.stats
    held = torch.cuda.memory_allocated() - before
    assert held <= budget + 512 * n_tensors  # the streamed bytes never came to the GPU to stay
    assert held < total * 0.75
    assert stats.components["transformer"].groups > 0
    assert (stats.components["transformer"].disk_bytes > 0) == on_disk
    assert not compress or any(s.wire_ratio < 1 for s in stats.components.values())
    for _ in range(2):
        assert torch.equal(generate(handle.pipe), image)
    assert torch.equal(generate(handle.pipe, output_type="latent"), latents)
    handle.restore()


RSS_CHILD = r"""
import json, sys
import torch
import diffusers
import weightstream as ws
from weightstream.pipeline import meta_components

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

folder, gpu, cpu, how = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
# imports and the lazily imported modules (the pipeline's, the tokenizers', the models') first, so the
# peak below counts what a load holds
diffusers.DiffusionPipeline.from_pretrained(folder, **meta_components(folder))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak resident set (VmHWM) starts again from the current one
base = status("VmRSS:")
if how == "weightstream":
    kept = ws.from_pretrained(folder, gpu_memory=gpu, cpu_memory=cpu, device="cpu", strategy="stream",
                              progress=False)
else:  # the control: the model's bytes held at once
    kept = torch.ones(int(how), dtype=torch.uint8)
print(json.dumps({"peak_growth": status("VmHWM:") - base}))
"""


@pytest.mark.slow
def test_loading_a_pipeline_folder_never_holds_the_whole_model_in_host_memory(tmp_path):
    """Peak host memory of a load, in a fresh process: it grows by what the budgets hold (on the CPU
    backend the resident weights are in host memory too) plus a bounce buffer, far below the model;
    holding the model's bytes at once, measured the same way, grows by all of them."""
    import json
    import os
    import subprocess
    import sys

    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs /proc/self/clear_refs to reset the peak resident set")
    folder = saved(tiny_flux_pipeline(width=256, layers=8).to(dtype=torch.bfloat16), tmp_path / "flux")
    total = sum(f.stat().st_size for f in (tmp_path / "flux").rglob("*.safetensors"))
    assert total > 50e6  # tens of MB of weights
    kwargs = dict(device="cpu", strategy="stream", progress=False)
    with pytest.raises(BudgetError) as gpu:
        ws.from_pretrained(folder, gpu_memory=1, **kwargs)
    with pytest.raises(BudgetError) as cpu:
        ws.from_pretrained(folder, gpu_memory=gpu.value.minimum_bytes, cpu_memory=1, **kwargs)
    budgets = gpu.value.minimum_bytes + cpu.value.minimum_bytes
    assert budgets < total * 0.4

    def peak(how: str) -> int:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        out = subprocess.run([sys.executable, "-c", RSS_CHILD, folder, str(gpu.value.minimum_bytes),
                              str(cpu.value.minimum_bytes), how], capture_output=True, text=True, env=env,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])["peak_growth"]

    ours, control = peak("weightstream"), peak(str(total))
    assert control >= total  # the measure sees bytes held at once
    assert ours < total * 0.5, (ours, budgets, total)


def test_the_load_plans_for_the_steps_it_is_given_as_plan_does(bf16_folder, capsys, tmp_path):
    """from_pretrained(folder, steps=N) splits the budget as `weightstream plan --steps N` shows it; steps
    on a model checkpoint, or below 1, is refused."""
    import json

    from conftest import make_model

    from weightstream.cli import main

    folder, _, _, total = bf16_folder
    for steps in (1, 50):
        assert main(["plan", folder, "--gpu-memory", str(total // 2), "--steps", str(steps), "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        handle = ws.from_pretrained(folder, gpu_memory=total // 2, device="cpu", progress=False, steps=steps)
        for name, c in report["components"].items():
            p = handle.placements[name]
            assert (c["gpu_bytes"], c["streamed_blocks"], c["calls"]) == (
                p.gpu_bytes, len(p.streamed), handle.plans[name].calls), (name, steps)
        handle.restore()
    with pytest.raises(ws.ArgumentError, match="at least 1 denoising step"):
        ws.from_pretrained(folder, gpu_memory=total // 2, device="cpu", steps=0)
    make_model("llama").save_pretrained(tmp_path / "llm")
    with pytest.raises(ws.ArgumentError, match="is for a diffusers pipeline folder"):
        ws.from_pretrained(tmp_path / "llm", gpu_memory="1GB", device="cpu", steps=4)


@pytest.mark.parametrize("method", ["enable_sequential_cpu_offload", "enable_model_cpu_offload",
                                    "enable_group_offload"])
def test_diffusers_own_offloading_on_an_offloaded_pipeline_is_refused_until_restore(method):
    """accelerate's offloading after weightstream's moved the streamed weights to the meta device: the
    next generation failed inside accelerate and restore() could not copy them back."""
    ref, pipe = tiny_flux_pipeline(), tiny_flux_pipeline()
    handle = ws.offload(pipe, gpu_memory=total_bytes(pipe) // 2, device="cpu", strategy="stream")
    with pytest.raises(ws.OffloadStateError, match=f"pipe.{method}.. on a pipeline weightstream offloaded"):
        getattr(pipe, method)(device="cpu")
    assert torch.equal(generate(pipe), generate(ref))
    handle.restore()
    assert method not in pipe.__dict__  # the pipeline's own method again


def test_an_error_inside_a_pipeline_edit_leaves_it_restored_and_offloadable_again():
    ref, pipe = tiny_flux_pipeline(), tiny_flux_pipeline()
    handle = ws.offload(pipe, gpu_memory=total_bytes(pipe) // 2, device="cpu", strategy="stream")
    with pytest.raises(KeyError), handle.edit():
        raise KeyError("the user's own error")
    assert handle.restored and all(h.restored for h in handle.handles.values())
    assert torch.equal(generate(pipe), generate(ref))  # restored, on the CPU
    again = ws.offload(pipe, gpu_memory=total_bytes(pipe) // 2, device="cpu", strategy="stream")
    assert torch.equal(generate(pipe), generate(ref))
    again.restore()


PER_MODEL = {"tokens": 8, "blocks": ["transformer_blocks"], "placement": Placement((), 0, 0, 0, 0),
             "keep_resident": ["pos_embed.freqs"], "expert_copies": True, "routing_skew": 1.0}


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flux")
    saved(tiny_flux_pipeline(), folder)
    return folder


@pytest.mark.parametrize("name", PER_MODEL)
def test_every_entry_point_refuses_what_a_pipelines_split_cannot_apply(flux_folder, name):
    """One model's fields (and the expert options, which the split never plans) in a pipeline's config:
    refused by offload(pipe), offload_pipeline, from_pretrained(folder) and plan_pipeline alike, naming
    the field, where any of them would drop it."""
    config = ws.OffloadConfig("1GiB", device="cpu", **{name: PER_MODEL[name]})
    pipe = tiny_flux_pipeline()
    calls = {"offload(pipe)": lambda: ws.offload(pipe, config),
             "offload_pipeline": lambda: ws.pipeline.offload_pipeline(pipe, config),
             "from_pretrained": lambda: ws.from_pretrained(flux_folder, config, progress=False),
             "plan_pipeline": lambda: ws.pipeline.plan_pipeline(str(flux_folder), config)}
    for what, call in calls.items():
        with pytest.raises(ArgumentError, match=name) as err:
            call()
        assert "per component" in str(err.value) or "plans every component" in str(err.value), what
    for m in modules_of(pipe).values():  # nothing stays offloaded
        with pytest.raises(OffloadStateError, match="not offloaded"):
            ws.handle_of(m)
