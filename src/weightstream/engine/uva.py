"""Zero-copy (UVA) views: CUDA tensors that alias pinned host memory, so kernels read it in place.

Under unified virtual addressing a page-locked host allocation is addressable from the GPU. PyTorch has
no public call for such a view, but `torch.as_tensor` accepts any object exposing
`__cuda_array_interface__` and wraps its pointer without copying; we present the pinned bytes that way.
"""

from __future__ import annotations

import torch

from ..errors import WeightstreamError


class _PinnedBytes:
    """Pinned host bytes presented as a CUDA byte array; keeps the host tensor alive."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        self.__cuda_array_interface__ = {
            "shape": (host.numel(),), "typestr": "|u1", "data": (host.data_ptr(), False),
            "strides": None, "version": 3,
        }


def uva_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A uint8 CUDA tensor on `device` aliasing `host`, a contiguous uint8 tensor in pinned memory."""
    if not host.is_pinned():
        raise WeightstreamError("zero-copy (uva) needs pinned host memory: offload with pin_memory=True")
    view = torch.as_tensor(_PinnedBytes(host), device=device)
    if view.data_ptr() != host.data_ptr():
        raise WeightstreamError(
            "this machine does not let the GPU use host pointers of pinned memory (no UVA): use "
            "strategy='stream'"
        )
    return view
