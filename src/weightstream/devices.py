"""The one place a device is chosen: what `device=None` means and how a user's device is checked."""

from __future__ import annotations

import torch

from .errors import ArgumentError, WeightstreamError


def resolve_device(device: str | torch.device | None, index: bool = True) -> torch.device:
    """`device` as a `torch.device` (with `index`, a CUDA device gets the current one's index where it
    names none): None means cuda where available, else cpu."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ArgumentError(f"device={device!r}: give 'cuda', 'cuda:N' or 'cpu'") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise WeightstreamError(
                f"device={device} asked for, but CUDA is not available here: use device='cpu'")
        if device.index is None and index:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise ArgumentError(f"device={device}: weightstream supports 'cuda' and 'cpu'")
    return device
