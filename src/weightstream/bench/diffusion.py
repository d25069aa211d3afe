"""The diffusion model kind of the bench: a diffusers denoiser (Flux, Wan) or a text encoder (T5) built
from a published config with random bf16 weights (never downloaded), timed as one denoising step.

A `denoise-bN` phase is one denoiser call on N latents. Its tokens per forward come from the shape
(`resolve`): Flux at 1024x1024 sees 4096 image + 512 text tokens; Wan 2.1 at 480p and 81 frames a
16x21x60x104 latent, 21x30x52 = 32760 video tokens after its (1, 2, 2) patches. The one input tensor
is the latent (CUDA-graph capture copies it); the timestep, the text conditioning and the position ids
are fixed tensors made with it and kept here, by batch size.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..dtypes import default_dtype
from .phases import Phase

# Published configs. Flux.1-dev: transformer/config.json of black-forest-labs/FLUX.1-dev. Wan 2.1 T2V 14B:
# transformer/config.json of Wan-AI/Wan2.1-T2V-14B-Diffusers. T5-XXL: text_encoder_2 of FLUX.1-dev.
FLUX_DEV = dict(model_type="FluxTransformer2DModel", patch_size=1, in_channels=64, num_layers=19,
                num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
                joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56),
                input_image_tokens=4096, input_text_tokens=512)
WAN_14B = dict(model_type="WanTransformer3DModel", patch_size=(1, 2, 2), num_attention_heads=40,
               attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096, freq_dim=256,
               ffn_dim=13824, num_layers=40, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
               rope_max_seq_len=1024, input_latent=(16, 21, 60, 104), input_text_tokens=512)
T5_XXL = dict(model_type="T5EncoderModel", vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24,
              num_heads=64, feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
              input_text_tokens=512)
TINY_FLUX = dict(model_type="FluxTransformer2DModel", patch_size=1, in_channels=16, num_layers=2,
                 num_single_layers=3, attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                 pooled_projection_dim=8, guidance_embeds=True, axes_dims_rope=(2, 2, 4),
                 input_image_tokens=16, input_text_tokens=8)
TINY_WAN = dict(model_type="WanTransformer3DModel", patch_size=(1, 2, 2), num_attention_heads=2,
                attention_head_dim=8, in_channels=4, out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32,
                num_layers=3, rope_max_seq_len=32, input_latent=(4, 2, 8, 8), input_text_tokens=6)
TINY_T5 = dict(model_type="T5EncoderModel", vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=3,
               num_heads=2, feed_forward_proj="gated-gelu", input_text_tokens=8)


def _keep_in_fp32(model: nn.Module) -> None:
    """Put the tensors of a diffusers model's `_keep_in_fp32_modules` (Wan: its norms, time embedder,
    rope) in float32, as diffusers' from_pretrained(torch_dtype=torch.bfloat16) does (transformers keeps
    T5's in bf16 at bf16)."""
    if not type(model).__module__.startswith("diffusers"):
        return
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_floating_point() and any(k in name.split(".") for k in keep):
            t.data = t.data.float()


def _config(fields: dict) -> dict:
    """The constructor's keywords: the fields less `model_type` and the `input_*` geometry."""
    return {k: v for k, v in fields.items() if k != "model_type" and not k.startswith("input_")}


def tokens_per_sample(fields: dict) -> int:
    """Tokens one sample's GEMMs see in one call: image + text tokens (Flux), video tokens after patches
    (Wan), text tokens (T5)."""
    if fields["model_type"] == "FluxTransformer2DModel":
        return fields["input_image_tokens"] + fields["input_text_tokens"]
    if fields["model_type"] == "WanTransformer3DModel":
        _, f, h, w = fields["input_latent"]
        pf, ph, pw = fields["patch_size"]
        return (f // pf) * (h // ph) * (w // pw)
    return fields["input_text_tokens"]


class Diffusion:
    """Build, feed and run a diffusion denoiser or text encoder (see `shapes.ModelKind`); one instance
    per shape, holding its input geometry (the `input_*` fields) and each batch's fixed inputs."""

    name = "diffusion"
    dtype_name = "bfloat16"

    def __init__(self, fields: dict) -> None:
        self.geometry = {k: v for k, v in fields.items() if k.startswith("input_")}
        self.conditioning: dict[int, dict[str, torch.Tensor]] = {}  # batch -> fixed keyword inputs
        self.model_type = fields["model_type"]

    def resolve(self, fields: dict, phase: Phase) -> Phase:
        """The phase with its tokens per sample filled in from the shape (`denoise-bN` has N samples)."""
        return Phase(phase.name, phase.batch, tokens_per_sample(fields)) if phase.kind == "denoise" else phase

    def _make(self, fields: dict) -> nn.Module:
        if fields["model_type"] == "T5EncoderModel":
            from transformers import T5Config, T5EncoderModel

            return T5EncoderModel(T5Config(**_config(fields)))
        import diffusers

        return getattr(diffusers, fields["model_type"])(**_config(fields))

    def build(self, fields: dict, device: torch.device, seed: int) -> nn.Module:
        """Random bf16 weights created on `device` (each layer's default init), eval mode, no grads."""
        torch.manual_seed(seed)
        with torch.device(device), default_dtype(torch.bfloat16):
            model = self._make(fields)
        _keep_in_fp32(model)
        return model.to(device).eval().requires_grad_(False)

    def meta(self, fields: dict) -> nn.Module:
        """The same model on the meta device (no memory): for sizes."""
        with torch.device("meta"), default_dtype(torch.bfloat16):
            model = self._make(fields)
        _keep_in_fp32(model)
        return model

    def inputs(self, model: nn.Module, phases: list[Phase], device: torch.device,
               seed: int) -> dict[str, torch.Tensor]:
        """Per phase the latent of one step (Flux: packed (N, image tokens, in_channels); Wan: (N, C, F, H,
        W); T5: token ids (N, text tokens)); the step's other inputs are kept in `conditioning`."""
        gen = torch.Generator().manual_seed(seed + 1)
        cfg = model.config
        out = {}
        text = self.geometry["input_text_tokens"]
        for p in phases:
            n = p.batch

            def randn(*shape):
                return torch.randn(*shape, generator=gen).to(device, torch.bfloat16)

            if self.model_type == "T5EncoderModel":
                ids = (n, p.seq if p.kind != "denoise" else text)
                out[p.name] = torch.randint(cfg.vocab_size, ids, generator=gen).to(device)
                self.conditioning[n] = {}
            elif self.model_type == "FluxTransformer2DModel":
                image = self.geometry["input_image_tokens"]
                side = math.isqrt(image)
                rows, cols = torch.arange(image) // side, torch.arange(image) % side
                img_ids = torch.stack([torch.zeros(image), rows.float(), cols.float()], dim=1)
                self.conditioning[n] = dict(
                    encoder_hidden_states=randn(n, text, cfg.joint_attention_dim),
                    pooled_projections=randn(n, cfg.pooled_projection_dim),
                    timestep=torch.full((n,), 0.5, device=device, dtype=torch.bfloat16),
                    img_ids=img_ids.to(device, torch.bfloat16),
                    txt_ids=torch.zeros(text, 3, device=device, dtype=torch.bfloat16),
                    **({"guidance": torch.full((n,), 3.5, device=device, dtype=torch.bfloat16)}
                       if cfg.guidance_embeds else {}))
                out[p.name] = randn(n, image, cfg.in_channels)
            else:
                self.conditioning[n] = dict(
                    encoder_hidden_states=randn(n, text, cfg.text_dim),
                    timestep=torch.full((n,), 500, device=device, dtype=torch.long))
                out[p.name] = randn(n, *self.geometry["input_latent"])
        return out

    def forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """One denoiser call (the predicted noise / velocity) or the encoder's last hidden state."""
        if self.model_type == "T5EncoderModel":
            return model(input_ids=x).last_hidden_state
        return model(hidden_states=x, **self.conditioning[x.shape[0]], return_dict=False)[0]


SHAPE_FIELDS = {  # bench shape name -> fields (`shapes.SHAPES` makes a `Diffusion` kind of each)
    "flux-dev-transformer": FLUX_DEV, "wan2.1-14b": WAN_14B, "t5-xxl-encoder": T5_XXL,
                "tiny-flux": TINY_FLUX, "tiny-wan": TINY_WAN, "tiny-t5": TINY_T5}
