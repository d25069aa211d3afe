"""`--lora RANK`: an unfused LoRA adapter on the attention projections of the bench's model, so a run
measures what an adapter that is loaded but not fused costs (its small matmuls on every projection,
and its bytes, which stream with their block or stay resident as the planner places them).

The adapter's weights are random (both matrices, so its output is not zero) in the model's dtype, as
a LoRA file loaded into a bf16 pipeline is. It is added before any method runs: the resident
reference and every offloaded method carry the same adapter.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ArgumentError

# attention projections as diffusers (Flux, Wan) and transformers (Llama, Qwen) name them: the layers
# LoRA files for these models target
TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
           "q_proj", "k_proj", "v_proj", "o_proj")


def add_lora(model: nn.Module, rank: int, seed: int = 0) -> dict:
    """Inject one unfused LoRA adapter of `rank` (alpha = rank) into `model`'s attention projections,
    in place; return what the result document records: rank, targets found, adapter bytes.
    Raises ArgumentError for a rank below 1, a model without such projections, or peft missing."""
    if rank < 1:
        raise ArgumentError(f"--lora {rank}: give the adapter's rank, at least 1 (e.g. --lora 16)")
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as err:
        raise ArgumentError("--lora needs peft: pip install peft") from err
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    # as peft matches target_modules: the module's name, or its last dotted parts
    targets = [t for t in TARGETS if any(n == t or n.endswith("." + t) for n in linears)]
    if not targets:
        raise ArgumentError(f"--lora: {type(model).__name__} has none of the attention projections a LoRA "
                            f"targets ({', '.join(TARGETS)})")
    dtype = next(model.parameters()).dtype
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # init_lora_weights=False draws both matrices, so the adapter changes the output
        inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=targets,
                                           init_lora_weights=False), model)
    adapter = [p for n, p in model.named_parameters() if "lora_" in n]
    for p in adapter:
        p.data = p.data.to(dtype)
    nbytes = sum(p.numel() * p.element_size() for p in adapter)
    return {"rank": rank, "targets": targets, "adapter_bytes": nbytes}
