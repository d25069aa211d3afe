"""diffusers' offloading as bench methods: `diffusers-group` (block-level group offloading with a
stream), `diffusers-leaf` (leaf-level, with a stream), and on a lone model what its pipeline methods do
to each component: `diffusers-model_cpu_offload` (`enable_model_cpu_offload`: accelerate's
`cpu_offload_with_hook`, the whole model moved to the device when called) and
`diffusers-sequential_cpu_offload` (`enable_sequential_cpu_offload`: accelerate's `cpu_offload(model,
device, offload_buffers=...)`, every leaf copied from pageable memory each call)."""

from __future__ import annotations

import torch
from torch import nn

from ...placement.blocks import find_blocks
from ..memory import allocated, home_device, module_bytes, release_memory
from .base import EAGER_ONLY, Method

_DIFFUSERS_HOOKS = ("group_offloading", "layer_execution_tracker", "lazy_prefetch_group_offloading")


def group_prepare(offload_type: str):
    """A prepare that applies diffusers apply_group_offloading(offload_type, use_stream=True; block level:
    1 block per group) to the module that holds the block list (a causal LM's inner `model`, a
    diffusion transformer itself): its weights in pinned host memory, prefetched on a side stream; the
    rest stays on the device. Applied to a whole LM instead, diffusers 0.42 registers its execution
    tracker twice when it recurses with a stream ("Hook with name layer_execution_tracker already
    exists")."""

    def prepare(model: nn.Module, budget: int | None, tokens: int, device: torch.device):
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
        per_group = {"num_blocks_per_group": 1} if offload_type == "block_level" else {}
        apply_group_offloading(holder, onload_device=device, offload_type=offload_type, use_stream=True,
                               **per_group)
        release_memory(device)
        info = {"offloaded_module": holder_name or "(the model)", "allocated_before_bytes": before,
                "allocated_after_bytes": allocated(device), "link_bytes": link}

        def undo() -> None:
            registry = HookRegistry.check_if_exists_or_initialize(holder)
            for name in _DIFFUSERS_HOOKS:
                registry.remove_hook(name, recurse=True)
            model.to(home)

        return info, undo

    prepare.__doc__ = f"diffusers apply_group_offloading(offload_type={offload_type!r}, use_stream=True)."
    return prepare


def prepare_model_cpu_offload(model: nn.Module, budget: int | None, tokens: int, device: torch.device):
    """What `enable_model_cpu_offload` does to one component: accelerate cpu_offload_with_hook, which
    moves the whole model to the device when it is called (and off only when the next model of the
    pipeline runs). It needs every weight on the device, so it refuses a budget below the model."""
    from accelerate import cpu_offload_with_hook

    total = module_bytes(model)
    if budget is not None and total > budget:
        raise RuntimeError(f"enable_model_cpu_offload keeps the whole model on the GPU while it runs: "
                           f"{total} bytes > the {budget}-byte budget")
    home = home_device(model)
    model.to("cpu")
    release_memory(device)
    _, hook = cpu_offload_with_hook(model, device)
    info = {"link_bytes": 0, "note": "steady state: the model stays on the device between calls; a "
            "generation moves all of it once (pageable copies)", "model_bytes": total}

    def undo() -> None:
        hook.remove()
        model.to(home)

    return info, undo


def prepare_sequential_cpu_offload(model: nn.Module, budget: int | None, tokens: int, device: torch.device):
    """What `enable_sequential_cpu_offload` does to one component: accelerate cpu_offload(model, device,
    offload_buffers=...): every weight in pageable host memory, copied leaf by leaf each call."""
    from accelerate import cpu_offload
    from accelerate.hooks import remove_hook_from_module

    home, before, link = home_device(model), allocated(device), module_bytes(model)
    cpu_offload(model, device, offload_buffers=len(model._parameters) > 0)
    release_memory(device)
    info = {"allocated_before_bytes": before, "allocated_after_bytes": allocated(device), "link_bytes": link}

    def undo() -> None:
        remove_hook_from_module(model, recurse=True)
        model.to(home)

    return info, undo


prepare_diffusers_group = group_prepare("block_level")
METHODS = (
    Method("diffusers-group", prepare_diffusers_group, ("eager",),
           f"diffusers block-level group offloading with a stream; {EAGER_ONLY}", requires="diffusers",
           uses_budget=False, cuda_only=True),
    Method("diffusers-leaf", group_prepare("leaf_level"), ("eager",),
           f"diffusers leaf-level group offloading with a stream; {EAGER_ONLY}", requires="diffusers",
           uses_budget=False, cuda_only=True),
    Method("diffusers-model_cpu_offload", prepare_model_cpu_offload, ("eager",),
           f"enable_model_cpu_offload on one model (accelerate cpu_offload_with_hook); {EAGER_ONLY}",
           requires="accelerate", cuda_only=True),
    Method("diffusers-sequential_cpu_offload", prepare_sequential_cpu_offload, ("eager",),
           f"enable_sequential_cpu_offload on one model (accelerate cpu_offload); {EAGER_ONLY}",
           requires="accelerate", uses_budget=False),
)
