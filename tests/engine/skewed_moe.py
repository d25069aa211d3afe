"""A small mixture of experts whose routers draw from a Zipf law (the bench's synthetic routing), for
tests that need routing of a known skew."""

from __future__ import annotations

import torch


def skewed_qwen3_moe(skew: float, layers: int = 2):
    """A Qwen3-MoE of 32 experts, top 4, in eval mode, its routers drawing each token's experts from
    Zipf(`skew`) (`bench.causal_lm.skew_routing`, seed 0)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from weightstream.bench.causal_lm import skew_routing

    config = Qwen3MoeConfig(vocab_size=512, hidden_size=256, intermediate_size=256, moe_intermediate_size=32,
                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=64, num_experts=32, num_experts_per_tok=4)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)
    skew_routing(model, skew, seed=0)
    return model
