"""accelerate's two offloading APIs as bench methods: `accelerate-cpu_offload` (every weight in pageable
host memory, copied per module each forward) and `accelerate-device_map` (`infer_auto_device_map` with
`max_memory` + `dispatch_model`). Both eager only: their hooks are compiler-disabled."""

from __future__ import annotations

import torch
from torch import nn

from ..memory import allocated, home_device, module_bytes, release_memory, tensor_bytes
from .base import EAGER_ONLY, Method


def prepare_accelerate_cpu_offload(model: nn.Module, budget: int | None, tokens: int, device: torch.device):
    """accelerate.cpu_offload: every weight in (pageable) host memory, copied per module each forward."""
    from accelerate import cpu_offload
    from accelerate.hooks import remove_hook_from_module

    home, before, link = home_device(model), allocated(device), tensor_bytes(model.parameters())
    cpu_offload(model, execution_device=device)
    release_memory(device)
    info = {"allocated_before_bytes": before, "allocated_after_bytes": allocated(device), "link_bytes": link}

    def undo() -> None:
        remove_hook_from_module(model, recurse=True)  # puts each weight back where it was
        model.to(home)

    return info, undo


def _cpu_bytes(model: nn.Module, device_map: dict) -> int:
    """Bytes of the modules an accelerate device map sends to the CPU."""
    mods = [model.get_submodule(name) for name, dev in device_map.items() if dev == "cpu"]
    return tensor_bytes([t for m in mods for t in (*m.parameters(), *m.buffers())])


def prepare_accelerate_device_map(model: nn.Module, budget: int | None, tokens: int, device: torch.device):
    """accelerate infer_auto_device_map(max_memory={gpu: budget, "cpu": ...}) + dispatch_model: what fits
    stays on the GPU, the rest is copied from host memory each forward."""
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.hooks import remove_hook_from_module

    home, total = home_device(model), module_bytes(model)
    model.to("cpu")  # dispatch_model keeps "cpu" weights where they are: they must really be on the host
    release_memory(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    device_map = infer_auto_device_map(model, max_memory={index: budget, "cpu": 2 * total},
                                       no_split_module_classes=no_split)
    if "cpu" not in device_map.values() or set(device_map.values()) == {"cpu"}:
        raise RuntimeError(f"device map {sorted(set(map(str, device_map.values())))}: accelerate offloads "
                           "nothing, or everything to the CPU, at this budget")
    link = _cpu_bytes(model, device_map)
    dispatch_model(model, device_map=device_map, main_device=index)
    info = {"device_map_gpu_modules": sum(d != "cpu" for d in device_map.values()),
            "device_map_cpu_modules": sum(d == "cpu" for d in device_map.values()),
            "allocated_after_bytes": allocated(device), "link_bytes": link}

    def undo() -> None:
        remove_hook_from_module(model, recurse=True)
        model.to(home)

    return info, undo


METHODS = (
    Method("accelerate-cpu_offload", prepare_accelerate_cpu_offload, ("eager",),
           f"accelerate.cpu_offload; {EAGER_ONLY}", requires="accelerate", uses_budget=False),
    Method("accelerate-device_map", prepare_accelerate_device_map, ("eager",),
           f"accelerate device_map + max_memory; {EAGER_ONLY}", requires="accelerate", cuda_only=True),
)
