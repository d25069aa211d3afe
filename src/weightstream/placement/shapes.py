"""Built-in model shapes: configs only, built on the meta device for planning; `weightstream bench`
builds the same shapes with random weights (`bench/shapes.py`)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..dtypes import parse_dtype
from ..errors import ArgumentError

SHAPES = {
    "llama-3-8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
    ),
    "llama-3-70b": dict(
        model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
    ),
    "qwen2.5-32b": dict(
        model_type="qwen2", hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
    ),
    "mixtral-8x7b": dict(
        model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, num_local_experts=8,
        num_experts_per_tok=2,
    ),
    # fine-grained mixtures of experts, from the published configs (fields that only change weights' sizes
    # or routing; rotary scaling as the config class's default)
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936, tie_word_embeddings=False,
    ),
    "qwen3-235b-a22b": dict(  # 470 GB of bf16 weights: plan only where host memory cannot hold them
        model_type="qwen3_moe", hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
        num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936, tie_word_embeddings=False,
    ),
    "gpt-oss-20b": dict(  # experts in bf16: the published MXFP4 experts need kernels not used here
        model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
        num_experts_per_tok=4, sliding_window=128, vocab_size=201088, tie_word_embeddings=False,
    ),
    "deepseek-v2-lite": dict(  # MLA attention, one dense layer, 64 routed experts beside 2 shared
        model_type="deepseek_v2", hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64,
        n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512,
        q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, topk_method="greedy",
        n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False, vocab_size=102400,
        tie_word_embeddings=False,
    ),
}


def shape_config(fields: dict, **extra):
    """The transformers config of a shape's fields (`model_type` plus config keywords) and `extra`
    keywords (e.g. `attn_implementation`). Shared by planning and `weightstream bench`."""
    from transformers import AutoConfig

    fields = dict(fields)
    return AutoConfig.for_model(fields.pop("model_type"), **fields, **extra)


def meta_model(name_or_path: str, dtype: torch.dtype | str | None = None) -> nn.Module:
    """A model with every tensor on the meta device, from a built-in shape name (a causal LM, bf16 by
    default), a local checkpoint folder (the class and dtype `from_pretrained` builds: the config's
    dtype by default) or a diffusers model folder (its `_class_name`, bf16 by default). Costs no memory;
    good for planning only."""
    from transformers import AutoModelForCausalLM

    if name_or_path in SHAPES:
        config = shape_config(SHAPES[name_or_path])
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=parse_dtype(dtype or torch.bfloat16))
        return model.eval().requires_grad_(False)
    if (Path(name_or_path) / "config.json").is_file():
        from ..formats.hf import build_model, diffusers_class

        class_name = diffusers_class(Path(name_or_path))
        if class_name is not None:  # a diffusers model folder (a pipeline's transformer/, unet/, vae/)
            from ..pipeline import meta_diffusers_model

            return meta_diffusers_model(name_or_path, class_name, parse_dtype(dtype or torch.bfloat16))
        return build_model(Path(name_or_path), dtype, on_meta=True)  # the class and dtype a load gets
    raise ArgumentError(
        f"{name_or_path!r} is neither a built-in shape ({', '.join(SHAPES)}) nor a folder with "
        "config.json (a transformers checkpoint or a diffusers model)"
    )
