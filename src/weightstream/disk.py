"""The disk tier: streamed groups that stay in their safetensors files and are read every forward.

Reads go through a single reader thread into a ring of pinned bounce buffers, one group per buffer,
running ahead of the GPU in forward order; a buffer is refilled only after its host->GPU copy has
finished (a CUDA event the reader waits on). A group asked for out of that order is read
synchronously instead, and the ring restarts after it.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .checkpoint import StoredTensor, read_into
from .layout import Slice


class DiskTier:
    """Which groups live on disk, and where each of their tensors lies in its shard."""

    def __init__(self, groups: dict[int, list[tuple[StoredTensor, Slice]]], group_bytes: dict[int, int]):
        self.groups = groups
        self.group_bytes = group_bytes
        self.order = sorted(groups)
        self.nbytes = sum(t.nbytes for g in groups.values() for t, _ in g)

    def holds(self, group: int) -> bool:
        """True when `group` is read from disk."""
        return group in self.groups

    def read_group(self, group: int, dst: torch.Tensor) -> None:
        """Read every tensor of `group` into `dst` (uint8, the group's layout) at its offset."""
        for stored, sl in self.groups[group]:
            read_into(stored, dst[sl.offset : sl.offset + sl.nbytes])

    def load(self, group: int) -> torch.Tensor:
        """`group`'s bytes read into a new (pageable) uint8 tensor."""
        dst = torch.empty(self.group_bytes[group], dtype=torch.uint8)
        self.read_group(group, dst)
        return dst


class DiskPrefetcher:
    """Reads disk groups ahead, in forward order, into pinned bounce buffers."""

    def __init__(self, tier: DiskTier, n_buffers: int, nbytes: int, pin: bool) -> None:
        self.tier = tier
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(n_buffers)]
        self.freed: list[torch.cuda.Event | None] = [None] * n_buffers
        self.pending: deque[tuple[int, int, Future]] = deque()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="weightstream-disk")
        self.next_pos = 0
        self._fill_ring()

    @property
    def pinned_bytes(self) -> int:
        return sum(b.numel() for b in self.buffers) if self.buffers and self.buffers[0].is_pinned() else 0

    def _read(self, group: int, index: int, freed: torch.cuda.Event | None) -> None:
        if freed is not None:
            freed.synchronize()  # the previous copy out of this buffer has finished
        self.tier.read_group(group, self.buffers[index])

    def _submit(self) -> None:
        group = self.tier.order[self.next_pos % len(self.tier.order)]
        index = self.next_pos % len(self.buffers)
        self.next_pos += 1
        self.pending.append((group, index, self.pool.submit(self._read, group, index, self.freed[index])))

    def _fill_ring(self) -> None:
        while len(self.pending) < len(self.buffers):
            self._submit()

    def take(self, group: int) -> tuple[torch.Tensor, int] | None:
        """The bounce buffer holding `group` (waiting for its read) and its index, or None when the
        reader is not at `group` (out of order): then the ring restarts just after it."""
        if self.pending and self.pending[0][0] == group:
            _, index, future = self.pending.popleft()
            future.result()
            return self.buffers[index][: self.tier.group_bytes[group]], index
        self.drain()
        self.next_pos = self.tier.order.index(group) + 1
        self._fill_ring()
        return None

    def give_back(self, index: int, copied: torch.cuda.Event) -> None:
        """The copy out of buffer `index` was enqueued; `copied` fires when it is done. Refill."""
        self.freed[index] = copied
        self._fill_ring()

    def drain(self) -> None:
        """Wait for every read in flight and forget them."""
        while self.pending:
            self.pending.popleft()[2].result()

    def close(self) -> None:
        self.drain()
        self.pool.shutdown()
