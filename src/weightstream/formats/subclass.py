"""Wrapper-subclass weights (torchao's quantized tensors), streamed as their inner tensors' bytes.

A traceable wrapper subclass (one with `__tensor_flatten__` / `__tensor_unflatten__`, as torchao's
Int8Tensor, Float8Tensor and Int4 tensors are) has no storage of its own: its bytes are its inner
tensors'. We flatten it, recursively, into plain leaf tensors, lay the leaves out one after another
(each aligned) as the entry's bytes, and rebuild the subclass with `__tensor_unflatten__` over views
of those bytes, wherever they are: the host arena, a GPU slot, the device. torch.compile flattens a
subclass into the same inner tensors, so it (and a CUDA graph) sees fixed views of slot memory exactly
as for a plain streamed weight. Which tensors take this path, and which are refused, is `kinds.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..errors import UnsupportedTensorError
from ..placement.layout import pack

_PLAIN = (torch.Tensor, nn.Parameter)


@dataclass(frozen=True)
class Leaf:
    """One plain inner tensor of a flattened subclass: where its bytes sit in the entry's bytes."""

    offset: int  # bytes from the start of the entry's bytes (aligned)
    nbytes: int  # bytes of its storage span
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    def view_of(self, raw: torch.Tensor) -> torch.Tensor:
        """This leaf as a view of `raw`, the entry's bytes (uint8)."""
        flat = raw[self.offset : self.offset + self.nbytes].view(self.dtype)
        return flat.as_strided(self.shape, self.stride)


@dataclass(frozen=True)
class Opaque:
    """An inner value of a subclass that is no tensor (a DTensor's DeviceMesh): kept as it is."""

    value: object


@dataclass(frozen=True)
class Node:
    """A subclass in the flattened tree: its class, flatten context, outer size and stride, and each
    inner tensor by name (a Node for a nested subclass, else the index of its Leaf)."""

    cls: type
    ctx: object
    size: tuple[int, ...]
    stride: tuple[int, ...]
    inner: tuple[tuple[str, Node | Opaque | int], ...]


@dataclass(frozen=True)
class Flattened:
    """A wrapper subclass laid out as bytes: its tree, its leaves and the bytes they span."""

    root: Node
    leaves: tuple[Leaf, ...]
    nbytes: int

    def view_of(self, raw: torch.Tensor) -> torch.Tensor:
        """The subclass rebuilt over `raw` (uint8, at least `nbytes` long): its leaves are views of it."""
        return _build(self.root, [leaf.view_of(raw) for leaf in self.leaves])

    def empty(self, device: torch.device) -> torch.Tensor:
        """A new subclass of this layout over fresh uninitialized bytes on `device`."""
        return self.view_of(torch.empty(self.nbytes, dtype=torch.uint8, device=device))

    def copy_of(self, raw: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The subclass rebuilt over a copy of `raw` on `device` (owns its bytes)."""
        return self.view_of(raw[: self.nbytes].to(device, copy=True))


def _build(node: Node, leaves: list[torch.Tensor]) -> torch.Tensor:
    inner = {name: _build(child, leaves) if isinstance(child, Node)
             else child.value if isinstance(child, Opaque) else leaves[child]
             for name, child in node.inner}
    return node.cls.__tensor_unflatten__(inner, node.ctx, node.size, node.stride)


def leaves_of(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain inner tensors of a wrapper subclass, depth first in flatten order (the Leaf order)."""
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    inner = [getattr(tensor, name) for name in names]
    return [leaf for t in inner if isinstance(t, torch.Tensor) for leaf in leaves_of(t)]


def _dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """True when a tensor of `shape` and `stride` covers exactly numel elements once each: a
    permutation of a contiguous layout."""
    expected = 1
    dims = sorted(((sz, st) for sz, st in zip(shape, stride, strict=True) if sz != 1), key=lambda d: d[1])
    for size, st in dims:
        if st != expected:
            return False
        expected *= size
    return True


def _storage_layout(t: torch.Tensor) -> tuple[tuple[int, ...], int]:
    """(stride, elements spanned) a leaf keeps in the entry's bytes: its own strides when it is dense
    and non-overlapping (a transposed weight stays transposed, so kernels see what they saw), else
    contiguous."""
    if t.numel() and _dense(tuple(t.shape), tuple(t.stride())):
        return tuple(t.stride()), t.numel()
    return tuple(torch.empty(t.shape, device="meta").stride()), t.numel()


def flatten(tensor: torch.Tensor, name: str) -> Flattened:
    """Lay out wrapper subclass `tensor` (named `name` in messages) as aligned leaf bytes."""
    specs: list[tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int]] = []

    def walk(t: torch.Tensor, path: str) -> Node | Opaque | int:
        if not isinstance(t, torch.Tensor):
            return Opaque(t)  # e.g. a DTensor's device mesh: no bytes to stream
        if not is_traceable_wrapper_subclass(t):
            if type(t) not in _PLAIN:
                raise UnsupportedTensorError(
                    f"{path} is a {type_name(t)} inside a tensor subclass: weightstream streams plain "
                    "inner tensors only; keep this weight resident (blocks=...) or quantize it with a "
                    "torchao weight-only config"
                )
            stride, span = _storage_layout(t)
            specs.append((t.dtype, tuple(t.shape), stride, span * t.element_size()))
            return len(specs) - 1
        names, ctx = t.__tensor_flatten__()
        inner = tuple((n, walk(getattr(t, n), f"{path}.{n}")) for n in names)
        return Node(type(t), ctx, tuple(t.size()), tuple(t.stride()), inner)

    root = walk(tensor, name)
    slices, _ = pack([nbytes for *_, nbytes in specs])
    leaves = tuple(Leaf(sl.offset, nbytes, dtype, shape, stride)
                   for sl, (dtype, shape, stride, nbytes) in zip(slices, specs, strict=True))
    end = max((leaf.offset + leaf.nbytes for leaf in leaves), default=0)  # `total` also pads the last
    return Flattened(root, leaves, end)


def copy_leaves(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy every inner tensor of subclass `src` into the matching one of `dst` (same layout)."""
    for d, s in zip(leaves_of(dst), leaves_of(src), strict=True):
        d.copy_(s.detach())


def type_name(t: torch.Tensor) -> str:
    """`module.QualifiedName` of the tensor's class, for messages."""
    cls = type(t)
    return f"{cls.__module__}.{cls.__qualname__}"
