"""The routers of a mixture-of-experts model: the modules that choose each token's experts.

transformers 5 gives every mixture of experts it fuses (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3,
GPT-OSS) a router module with `num_experts`, `top_k` and a `weight` of shape [experts, hidden], whose
forward returns (logits, scores, indices): indices [tokens, top_k] are the experts each token reads.

Their experts modules hold the fused expert tensors: parameters of shape [experts, ...] that the
experts' forward, called as `experts(hidden_states, top_k_index, top_k_weights)`, reads row by row for
the experts `top_k_index` names (`is_experts`).
"""

from __future__ import annotations

import functools

import torch
from torch import nn


def is_router(module: nn.Module) -> bool:
    """Whether `module` is a top-k router as transformers 5 builds them (see the module docstring)."""
    experts, top_k = getattr(module, "num_experts", None), getattr(module, "top_k", None)
    weight = getattr(module, "weight", None)
    return (isinstance(experts, int) and isinstance(top_k, int) and 0 < top_k < experts
            and isinstance(weight, nn.Parameter) and weight.dim() == 2 and weight.shape[0] == experts)


def routers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every router in `model`, in module order."""
    return [(name, m) for name, m in model.named_modules() if is_router(m)]


def is_experts(module: nn.Module) -> bool:
    """Whether `module` holds fused routed experts as transformers 5 builds them: an int `num_experts`
    and at least one parameter of its own whose first dimension is that many experts, 3-D ones among
    them (biases are [experts, width])."""
    experts = getattr(module, "num_experts", None)
    own = [p for p in module._parameters.values() if p is not None]
    return (isinstance(experts, int) and experts > 1
            and any(p.dim() == 3 and p.shape[0] == experts for p in own))


@functools.cache
def zipf_popularity(experts: int, top_k: int, s: float, samples: int = 16384) -> tuple[float, ...]:
    """The share of token-expert choices each expert takes, most popular first, when every token draws
    `top_k` of `experts` without replacement in proportion to rank^-s (Gumbel top-k; s = 0: uniform),
    estimated from `samples` seeded draws (the same on every machine). Sums to 1."""
    if s == 0:
        return (1.0 / experts,) * experts
    gen = torch.Generator().manual_seed(0)
    logits = -s * torch.log(torch.arange(1, experts + 1, dtype=torch.float64))
    gumbel = -torch.log(-torch.log(torch.rand(samples, experts, generator=gen, dtype=torch.float64)))
    chosen = torch.topk(logits + gumbel, top_k).indices.flatten()
    counts = torch.bincount(chosen, minlength=experts).double()
    return tuple(sorted((counts / counts.sum()).tolist(), reverse=True))


SKEW_GRID = tuple(i / 20 for i in range(81))  # the Zipf exponents `fit_routing_skew` tries: 0 to 4


def fit_routing_skew(shares: list[list[float]], top_k: int) -> float:
    """The Zipf exponent (of SKEW_GRID) whose popularity (`zipf_popularity`) is closest, in squared
    error, to the mean over layers of `shares` (each layer's share of the token-expert choices per
    expert, any order): what `offload(..., routing_skew=)` plans a GPU expert cache for."""
    experts = len(shares[0])
    ranked = [sorted(layer, reverse=True) for layer in shares]
    mean = [sum(v) / len(shares) for v in zip(*ranked, strict=True)]
    return min(SKEW_GRID, key=lambda s: sum((a - b) ** 2 for a, b in
                                            zip(mean, zipf_popularity(experts, top_k, s, 4096), strict=True)))
