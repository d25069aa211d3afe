"""Byte layout of a group: where each tensor sits in its group's contiguous region. Pure logic.

The same layout is used in host memory and in the GPU slot, so one copy moves a whole group and each
streamed tensor is a fixed view at a fixed offset.
"""

from __future__ import annotations

from dataclasses import dataclass

ALIGN = 256  # bytes; cuBLAS and vectorised kernels want aligned weight pointers


def align_up(nbytes: int, align: int = ALIGN) -> int:
    """Round nbytes up to a multiple of align."""
    return -(-nbytes // align) * align


@dataclass(frozen=True)
class Slice:
    """One tensor inside a group region: byte offset and size."""

    offset: int
    nbytes: int


def pack(sizes: list[int]) -> tuple[list[Slice], int]:
    """Place tensors of the given byte sizes one after another, each aligned; return slices and the
    region's total size in bytes."""
    slices, cursor = [], 0
    for nbytes in sizes:
        slices.append(Slice(cursor, nbytes))
        cursor = align_up(cursor + nbytes)
    return slices, cursor
