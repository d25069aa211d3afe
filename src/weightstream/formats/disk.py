"""The disk tier: streamed groups that stay in their safetensors files and are read every forward.

Reads go through a single reader thread into a ring of pinned bounce buffers, one group per buffer,
running ahead of the GPU in forward order; a buffer is refilled only after its host->GPU copy has
finished (a CUDA event the reader waits on). A group asked for out of that order is read
synchronously instead, and the ring restarts after it.

A group that was compressed at load (`diskcache.py`) is read as its blob from the cache file instead
of its raw tensors: `read` moves what crosses the wire (blob or raw layout), `read_group` always the
raw layout from the checkpoint (restore, state_dict).
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..errors import CheckpointError
from ..placement.layout import Slice
from .checkpoint import StoredTensor, read_into
from .diskcache import DiskCache


class DiskTier:
    """Which groups live on disk, and where each of their tensors lies in its shard; `blobs` holds
    where each compressed group's blob lies in `cache` (the others are read raw). Sizes in bytes:
    `nbytes` the groups' raw tensors, `wire_bytes` what a forward reads from the files (blobs and raw
    tensors), `bytes_read` a counter of every byte `read` has read from them."""

    def __init__(self, groups: dict[int, list[tuple[StoredTensor, Slice]]], group_bytes: dict[int, int],
                 blobs: dict[int, StoredTensor] | None = None, cache: DiskCache | None = None):
        self.groups = groups
        self.group_bytes = group_bytes
        self.blobs = blobs or {}
        self.cache = cache
        self.order = sorted(groups)
        self.nbytes = sum(t.nbytes for g in groups.values() for t, _ in g)
        self.wire_bytes = sum(self.file_bytes(g) for g in self.order)
        self.bytes_read = 0
        # each group's shard files, and each file's size and modification time now: the offsets found at
        # load hold only while the file is the one they were found in
        self.paths = {g: sorted({t.path for t, _ in tensors}) for g, tensors in groups.items()}
        self.stamps = {path: _stamp(path) for paths in self.paths.values() for path in paths}

    def holds(self, group: int) -> bool:
        """True when `group` is read from disk."""
        return group in self.groups

    def read_bytes(self, group: int) -> int:
        """Bytes `read` moves for `group`: its blob's when compressed, else its layout's."""
        blob = self.blobs.get(group)
        return blob.nbytes if blob is not None else self.group_bytes[group]

    def file_bytes(self, group: int) -> int:
        """Bytes `read` reads from the files for `group`: its blob, or its raw tensors."""
        blob = self.blobs.get(group)
        return blob.nbytes if blob is not None else sum(t.nbytes for t, _ in self.groups[group])

    @property
    def max_read_bytes(self) -> int:
        """The largest read: what a bounce buffer must hold."""
        return max((self.read_bytes(g) for g in self.order), default=0)

    def read(self, group: int, dst: torch.Tensor) -> torch.Tensor:
        """Read what crosses the wire for `group` (its blob, or its raw layout) into the start of `dst`
        (uint8); returns that part of `dst`."""
        blob = self.blobs.get(group)
        if blob is None:
            self.read_group(group, dst)
        else:
            read_into(blob, dst[: blob.nbytes])
        self.bytes_read += self.file_bytes(group)
        return dst[: self.read_bytes(group)]

    def close(self) -> None:
        """Delete the compressed cache, if any (reads of raw groups still work)."""
        if self.cache is not None:
            self.cache.close()

    def read_group(self, group: int, dst: torch.Tensor, within: tuple[int, int] | None = None) -> None:
        """Read every tensor of `group` into `dst` (uint8, the group's layout) at its offset, or with
        `within` (offset, bytes) only the tensors in that part of the layout, into `dst` of that size; a
        CheckpointError where one of its shard files changed or went since the load."""
        self.check_unchanged(group)
        start, size = within if within is not None else (0, dst.numel())
        for stored, sl in self.groups[group]:
            if start <= sl.offset < start + size:
                read_into(stored, dst[sl.offset - start : sl.offset - start + sl.nbytes])

    def check_unchanged(self, group: int) -> None:
        """CheckpointError where a shard file of `group` changed or went since the load."""
        for path in self.paths[group]:
            if _stamp(path) != self.stamps[path]:
                raise CheckpointError(
                    f"{path} changed after the model was loaded (its size or modification time; or it is "
                    "gone): weightstream reads this shard's tensors every forward from the offsets it found "
                    "at load, which no longer hold. Load the checkpoint again (weightstream.from_pretrained),"
                    " or give cpu_memory room for every streamed group so none is read from the files")

    def load(self, group: int) -> torch.Tensor:
        """`group`'s bytes read into a new (pageable) uint8 tensor."""
        dst = torch.empty(self.group_bytes[group], dtype=torch.uint8)
        self.read_group(group, dst)
        return dst


def _stamp(path) -> tuple[int, int] | None:
    """A file's size and modification time (ns), or None where it is gone."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None
    return info.st_size, info.st_mtime_ns


class DiskPrefetcher:
    """Reads disk groups ahead, in forward order, into pinned bounce buffers of `nbytes` each (the
    tier's largest read: a blob for a compressed group)."""

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
        self.tier.read(group, self.buffers[index])

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
            return self.buffers[index][: self.tier.read_bytes(group)], index
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
