"""`diffusers-group`: diffusers' block-level group offloading with a stream, as a bench method."""

from __future__ import annotations

import torch
from torch import nn

from ...blocks import find_blocks
from ..memory import allocated, home_device, module_bytes, release_memory
from .base import EAGER_ONLY, Method

_DIFFUSERS_HOOKS = ("group_offloading", "layer_execution_tracker", "lazy_prefetch_group_offloading")


def prepare_diffusers_group(model: nn.Module, budget: int | None, tokens: int, device: torch.device):
    """diffusers apply_group_offloading(block_level, 1 block per group, use_stream=True) on the module
    that holds the block list (a causal LM's inner `model`): its weights in pinned host memory, one
    block prefetched ahead on a side stream; the rest (the LM head) stays on the device. Applied to the
    whole LM instead, diffusers 0.42 registers its execution tracker twice when it recurses with a
    stream ("Hook with name layer_execution_tracker already exists")."""
    from diffusers.hooks import HookRegistry, apply_group_offloading

    home, before = home_device(model), allocated(device)
    block_list = find_blocks(model)[0].name.rsplit(".", 1)[0]  # "model.layers.0" -> "model.layers"
    holder_name = block_list.rsplit(".", 1)[0] if "." in block_list else ""
    holder = model.get_submodule(holder_name)
    inside = {id(t) for t in [*holder.parameters(), *holder.buffers()]}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in inside:
            t.data = t.data.to(device)  # outside the offloaded module: on the device, as a user would
    link = module_bytes(holder)
    apply_group_offloading(holder, onload_device=device, offload_type="block_level", num_blocks_per_group=1,
                           use_stream=True)
    release_memory(device)
    info = {"offloaded_module": holder_name or "(the model)", "allocated_before_bytes": before,
            "allocated_after_bytes": allocated(device), "link_bytes": link}

    def undo() -> None:
        registry = HookRegistry.check_if_exists_or_initialize(holder)
        for name in _DIFFUSERS_HOOKS:
            registry.remove_hook(name, recurse=True)
        model.to(home)

    return info, undo


METHODS = (
    Method("diffusers-group", prepare_diffusers_group, ("eager",),
           f"diffusers block-level group offloading with a stream; {EAGER_ONLY}", requires="diffusers",
           uses_budget=False, cuda_only=True),
)
