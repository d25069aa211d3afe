"""Placement: which blocks stay on the GPU and which stream through staging slots. Pure logic, no CUDA.

The rule for now: keep as many blocks resident as fit under the budget (the staging slots counted),
stream the rest, spread evenly through the model so each streamed copy can hide behind the resident
blocks computed while it is in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import BudgetError
from .sizes import format_size


@dataclass(frozen=True)
class Placement:
    """A placement of a model's weights on the GPU. All sizes are in bytes.

    `streamed` lists the indices of the streamed blocks in forward order; each streamed block is one
    group, and group i (its position in `streamed`) is staged in slot i % n_slots.
    """

    streamed: tuple[int, ...]
    n_slots: int
    slot_bytes: int
    resident_bytes: int
    streamed_bytes: int

    @property
    def staging_bytes(self) -> int:
        """GPU bytes taken by the staging slots."""
        return self.n_slots * self.slot_bytes

    @property
    def gpu_bytes(self) -> int:
        """GPU bytes of weights: resident tensors plus staging slots."""
        return self.resident_bytes + self.staging_bytes


def spread(n: int, k: int) -> tuple[int, ...]:
    """Return k of the indices 0..n-1, evenly spread (k=n gives all of them)."""
    return tuple(sorted({(2 * i + 1) * n // (2 * k) for i in range(k)}))


def plan_placement(fixed_bytes: int, block_bytes: list[int], budget: int, max_slots: int = 2) -> Placement:
    """Choose the fewest streamed blocks that make the weights fit in `budget` bytes of GPU memory.

    `fixed_bytes` must stay resident whatever happens (everything outside the blocks); `block_bytes`
    is each block's streamable size (its staging footprint, alignment included). Two slots let one
    group compute while the next one copies, so they come first; one slot, which serializes copy and
    compute, is the last resort for budgets too small for two.
    """
    n = len(block_bytes)
    total = fixed_bytes + sum(block_bytes)
    for slots_wanted in (max_slots, 1):
        for k in range(n + 1):
            streamed = spread(n, k)
            resident = fixed_bytes + sum(b for i, b in enumerate(block_bytes) if i not in streamed)
            slot = max((block_bytes[i] for i in streamed), default=0)
            n_slots = min(slots_wanted, k)
            if resident + n_slots * slot <= budget:
                return Placement(streamed, n_slots, slot, resident, total - resident)
    minimum = fixed_bytes + (max(block_bytes) if block_bytes else 0)
    raise BudgetError(
        f"gpu_memory={format_size(budget)} cannot hold the weights that must stay on the GPU "
        f"({format_size(fixed_bytes)} outside the repeated blocks) plus one staging slot "
        f"({format_size(max(block_bytes, default=0))}): give at least {format_size(minimum)} "
        f"({minimum} bytes); two slots, which overlap copies with compute, need "
        f"{fixed_bytes + 2 * max(block_bytes, default=0)} bytes",
        minimum,
    )
