"""`resident`: every weight on the GPU; the reference outputs of every phase and mode."""

from __future__ import annotations

import torch
from torch import nn

from ..memory import allocated
from ..schema import MODES
from .base import Method


def prepare_resident(model: nn.Module, budget: int | None, tokens: int, device: torch.device):
    """Nothing to do: every weight is on the device already."""
    return {"allocated_bytes": allocated(device), "link_bytes": 0}, lambda: None


METHODS = (
    Method("resident", prepare_resident, MODES, "every weight on the GPU (the reference)",
           uses_budget=False, gives_reference=True),
)
