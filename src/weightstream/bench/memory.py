"""Bytes of tensors and modules, GPU memory in use, and the check that an undone method left every
tensor at home: the bookkeeping every method adapter and the runner share."""

from __future__ import annotations

import gc
from collections.abc import Iterable

import torch
from torch import nn

from ..placement.blocks import module_bytes  # noqa: F401  (the bench's methods import it from here)


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct tensors given (meta tensors count their size)."""
    unique = {id(t): t for t in tensors}
    return sum(t.numel() * t.element_size() for t in unique.values())


def allocated(device: torch.device) -> int | None:
    """Bytes PyTorch has allocated on the GPU (None on CPU)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def release_memory(device: torch.device) -> None:
    """Drop compiled code, garbage and cached GPU blocks between measurements."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def home_device(model: nn.Module) -> torch.device:
    """Where the model's first parameter lives."""
    return next(model.parameters()).device


def check_home(model: nn.Module, home: torch.device) -> None:
    """Raise if a parameter or buffer is not back on `home` after a method was undone."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.device != home:
            raise RuntimeError(f"after undo, {name} is on {t.device}, not {home}: the method did not undo")
