"""The bench's pipeline shapes: a whole FLUX.1-dev `FluxPipeline` (CLIP and T5-XXL text encoders, the 12B
transformer, the VAE) from the published configs with random bf16 weights and in-memory word-level
tokenizers (nothing downloaded; the image is noise), or the same pipeline at tiny sizes. The same
pipeline as `examples/flux_offload.py` builds (the example stays self-contained; keep the two alike).
"""

from __future__ import annotations

import torch

from ..dtypes import default_dtype

PROMPT = "a photo of an astronaut riding a horse on the moon"
# pipeline shape -> (tiny configs?, default image side, default denoising steps)
PIPELINE_SHAPES = {"flux-dev-pipeline": (False, 1024, 28), "tiny-flux-pipeline": (True, 16, 2)}


def tokenizer(max_len: int):
    """A word-level tokenizer built in memory (no files): random weights need no real vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "a photo of an astronaut riding horse on the moon cat dog red blue".split()
    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   eos_token="[EOS]", model_max_length=max_len)


def configs(tiny: bool) -> dict:
    """Constructor keywords of each component: FLUX.1-dev's published configs, or tiny ones."""
    if tiny:
        return dict(
            clip=dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, max_position_embeddings=16, projection_dim=16),
            t5=dict(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=2,
                    feed_forward_proj="gated-gelu"),
            transformer=dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                             attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                             pooled_projection_dim=16, guidance_embeds=True, axes_dims_rope=(2, 2, 4)),
            vae=dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16),
                     down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                     norm_num_groups=4, layers_per_block=1, shift_factor=0.1159, scaling_factor=0.3611),
            clip_tokens=16, t5_tokens=16)
    return dict(
        clip=dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                  num_attention_heads=12, max_position_embeddings=77, projection_dim=768,
                  hidden_act="quick_gelu"),
        t5=dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                feed_forward_proj="gated-gelu"),
        transformer=dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                         attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                         pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56)),
        vae=dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
                 down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                 norm_num_groups=32, layers_per_block=2, shift_factor=0.1159, scaling_factor=0.3611,
                 use_quant_conv=False, use_post_quant_conv=False),
        clip_tokens=77, t5_tokens=512)


def build_pipeline(tiny: bool, seed: int = 0, device: str | torch.device = "cpu"):
    """A FluxPipeline with random bf16 weights (each layer's default init) created on `device` (a GPU
    initializes FLUX.1-dev's 12B weights in seconds, a CPU in minutes; "meta" for sizes and plans), in
    eval mode."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    c = configs(tiny)
    torch.manual_seed(seed)
    with torch.device(device), default_dtype(torch.bfloat16):
        clip = CLIPTextModel(CLIPTextConfig(**c["clip"], eos_token_id=2, pad_token_id=0, bos_token_id=1))
        t5 = T5EncoderModel(T5Config(**c["t5"], pad_token_id=0, eos_token_id=2))
        transformer = FluxTransformer2DModel(**c["transformer"])
        vae = AutoencoderKL(**c["vae"])
    for m in (clip, t5, transformer, vae):
        m.eval().requires_grad_(False)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                                max_shift=1.15, base_image_seq_len=256,
                                                max_image_seq_len=4096)
    return FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=clip,
                        tokenizer=tokenizer(c["clip_tokens"]), text_encoder_2=t5,
                        tokenizer_2=tokenizer(c["t5_tokens"]), transformer=transformer)


def step_tokens(pipe, size: int, tiny: bool) -> int:
    """Tokens the transformer sees per denoising step at `size` x `size`: 2x2-packed latent pixels plus
    the T5 tokens (FLUX.1-dev at 1024: 4096 + 512)."""
    return (size // (2 * pipe.vae_scale_factor)) ** 2 + configs(tiny)["t5_tokens"]
