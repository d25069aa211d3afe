"""Tiny models beyond decoder-only LLMs, built from configs with random weights (no downloads), each
with the inputs of one forward: diffusers' transformers, UNet and VAE; transformers' CLIP, the T5
encoder (T5 and Whisper encoder-decoders in SEQ2SEQ) and Jamba; a root-level nn.Sequential.
`ZOO[name]()` returns (model, inputs as kwargs)."""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch import nn


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def flux(seed: int = 0):
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=2, num_single_layers=3,
                                   attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                   pooled_projection_dim=8, axes_dims_rope=(2, 2, 4))
    g = _gen(seed)
    inputs = dict(hidden_states=torch.randn(1, 16, 4, generator=g),
                  encoder_hidden_states=torch.randn(1, 8, 16, generator=g),
                  pooled_projections=torch.randn(1, 8, generator=g), timestep=torch.tensor([0.5]),
                  img_ids=torch.randn(16, 3, generator=g), txt_ids=torch.randn(8, 3, generator=g),
                  return_dict=False)
    return model, inputs


def sd3(seed: int = 0):
    from diffusers import SD3Transformer2DModel

    model = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=3,
                                  attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                  caption_projection_dim=16, pooled_projection_dim=8, out_channels=4,
                                  pos_embed_max_size=16)
    g = _gen(seed)
    inputs = dict(hidden_states=torch.randn(1, 4, 8, 8, generator=g),
                  encoder_hidden_states=torch.randn(1, 6, 16, generator=g),
                  pooled_projections=torch.randn(1, 8, generator=g), timestep=torch.tensor([3]),
                  return_dict=False)
    return model, inputs


def wan(seed: int = 0):
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8,
                                  in_channels=4, out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32,
                                  num_layers=3, rope_max_seq_len=32)
    g = _gen(seed)
    inputs = dict(hidden_states=torch.randn(1, 4, 2, 8, 8, generator=g), timestep=torch.tensor([3]),
                  encoder_hidden_states=torch.randn(1, 6, 16, generator=g), return_dict=False)
    return model, inputs


def unet(seed: int = 0):
    from diffusers import UNet2DConditionModel

    model = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                 block_out_channels=(16, 32), norm_num_groups=8, cross_attention_dim=16,
                                 attention_head_dim=4,
                                 down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    g = _gen(seed)
    inputs = dict(sample=torch.randn(1, 4, 8, 8, generator=g), timestep=torch.tensor([3]),
                  encoder_hidden_states=torch.randn(1, 6, 16, generator=g), return_dict=False)
    return model, inputs


def vae(seed: int = 0):
    from diffusers import AutoencoderKL

    model = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16),
                          down_block_types=("DownEncoderBlock2D",) * 2,
                          up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=4, layers_per_block=1)
    g = _gen(seed)
    return model, dict(sample=torch.randn(1, 3, 16, 16, generator=g), return_dict=False)


def clip(seed: int = 0):
    from transformers import CLIPConfig, CLIPModel

    text = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=2, max_position_embeddings=16)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
                  image_size=8, patch_size=4)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8))
    g = _gen(seed)
    inputs = dict(input_ids=torch.randint(0, 64, (2, 6), generator=g),
                  pixel_values=torch.randn(2, 3, 8, 8, generator=g), return_dict=False)
    return model, inputs


def jamba(seed: int = 0):
    from transformers import JambaConfig, JambaForCausalLM

    config = JambaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, num_experts=2,
                         num_experts_per_tok=1, attn_layer_period=2, attn_layer_offset=1,
                         expert_layer_period=2, expert_layer_offset=1, mamba_d_state=4,
                         mamba_d_conv=2, mamba_expand=2, use_mamba_kernels=False)
    model = JambaForCausalLM(config)
    return model, dict(input_ids=torch.randint(0, 64, (1, 6), generator=_gen(seed)), use_cache=False)


def sequential(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)))
    return model, dict(input=torch.randn(3, 16, generator=_gen(seed)))


def t5_encoder(seed: int = 0):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=3, num_heads=2,
                      feed_forward_proj="gated-gelu")
    torch.manual_seed(seed)
    return T5EncoderModel(config), dict(input_ids=torch.randint(2, 64, (1, 7), generator=_gen(seed)),
                                        return_dict=False)


class Fresh:
    """An input made anew for every call (`call` builds it): a cache the forward fills in place."""

    def __init__(self, make) -> None:
        self.make = make


_DECODER = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def _decoder(config, seed: int, **extra):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    return model, dict(input_ids=torch.randint(0, 128, (1, 8), generator=_gen(seed)), **extra)


def qwen3(seed: int = 0):
    from transformers import Qwen3Config

    return _decoder(Qwen3Config(**_DECODER, head_dim=16), seed, use_cache=False)


def qwen3_moe(seed: int = 0):
    from transformers import Qwen3MoeConfig

    return _decoder(Qwen3MoeConfig(**_DECODER, head_dim=16, moe_intermediate_size=32, num_experts=4,
                                   num_experts_per_tok=2), seed, use_cache=False)


def mixtral(seed: int = 0):
    from transformers import MixtralConfig

    config = MixtralConfig(**_DECODER, num_local_experts=4, num_experts_per_tok=2)
    return _decoder(config, seed, use_cache=False)


def qwen2_moe(seed: int = 0):
    from transformers import Qwen2MoeConfig

    return _decoder(Qwen2MoeConfig(**_DECODER, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                   num_experts=4, num_experts_per_tok=2), seed, use_cache=False)


def olmoe(seed: int = 0):
    from transformers import OlmoeConfig

    config = OlmoeConfig(**_DECODER, num_experts=6, num_experts_per_tok=2, eos_token_id=None)
    return _decoder(config, seed, use_cache=False)


def deepseek_v2(seed: int = 0):
    """DeepSeek-V2-Lite's structure: MLA attention (no query LoRA), a dense first layer, routed experts
    beside shared ones."""
    from transformers import DeepseekV2Config

    config = DeepseekV2Config(**_DECODER, moe_intermediate_size=32, n_routed_experts=6, num_experts_per_tok=2,
                              n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
                              qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return _decoder(config, seed, use_cache=False)


def gpt_oss(seed: int = 0):
    """GPT-OSS's structure in the model's own dtype (no MXFP4): fused experts with biases, attention
    sinks, sliding and full attention layers."""
    from transformers import GptOssConfig

    rope = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4,
            "rope_theta": 150000.0, "beta_fast": 32.0, "beta_slow": 1.0}
    config = GptOssConfig(**_DECODER, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                          sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2,
                          rope_parameters=rope)
    return _decoder(config, seed, use_cache=False)


def gemma3_text(seed: int = 0):
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(**_DECODER, head_dim=16, query_pre_attn_scalar=16, sliding_window=4)
    return _decoder(config, seed, use_cache=False)


def falcon_h1(seed: int = 0):
    from transformers import FalconH1Config

    config = FalconH1Config(**_DECODER, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                            mamba_d_state=16, mamba_chunk_size=8, mamba_expand=1)
    return _decoder(config, seed, use_cache=False)


def llama_static_cache(seed: int = 0):
    """A Llama forward that fills a transformers StaticCache (a new one per call)."""
    from transformers import LlamaConfig, StaticCache

    config = LlamaConfig(**_DECODER)
    return _decoder(config, seed, use_cache=True,
                    past_key_values=Fresh(lambda: StaticCache(config=config, max_cache_len=32)))


ZOO = {"flux": flux, "sd3": sd3, "wan": wan, "unet": unet, "vae": vae, "clip": clip, "t5_encoder": t5_encoder,
       "jamba": jamba, "sequential": sequential, "qwen3": qwen3, "qwen3_moe": qwen3_moe,
       "gemma3_text": gemma3_text, "falcon_h1": falcon_h1, "llama_static_cache": llama_static_cache,
       "mixtral": mixtral, "qwen2_moe": qwen2_moe, "olmoe": olmoe, "deepseek_v2": deepseek_v2,
       "gpt_oss": gpt_oss}

# the mixtures of experts above, whose checkpoints transformers saves per expert (gpt_oss: fused)
MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "gpt_oss", "jamba"]


def t5(seed: int = 0):
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=3, num_decoder_layers=3,
                      num_heads=2, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    return T5ForConditionalGeneration(config), torch.randint(2, 64, (1, 7), generator=_gen(seed))


def whisper(seed: int = 0):
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=3,
                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                           decoder_ffn_dim=32, num_mel_bins=8, max_source_positions=16,
                           max_target_positions=32, decoder_start_token_id=1, pad_token_id=0,
                           eos_token_id=2, bos_token_id=1, suppress_tokens=None, begin_suppress_tokens=None)
    torch.manual_seed(seed)
    return WhisperForConditionalGeneration(config), torch.randn(1, 8, 32, generator=_gen(seed))


SEQ2SEQ = {"t5": t5, "whisper": whisper}


def call(model, inputs):
    """The model's output on `inputs` (a dict of keyword arguments), without autograd."""
    inputs = {k: v.make() if isinstance(v, Fresh) else v for k, v in inputs.items()}
    with torch.no_grad():
        return model(**inputs)


def same(a, b) -> bool:
    """True when every tensor in output `a` is bit-identical to its counterpart in `b` (and there is one)."""
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    tensors = [(x, y) for x, y in zip(la, lb, strict=True) if isinstance(x, torch.Tensor)]
    return bool(tensors) and all(torch.equal(x, y) for x, y in tensors)
