"""Compressed groups on the wire: encoded once at offload, decoded on the GPU every forward.

The host arena holds each compressed group's blob (`codec.py`). On CUDA a group's blob is copied into
its slot's landing buffer on the copy stream, then decoded into the slot on a separate decode stream,
so decoding group i overlaps the copy of group i+1; the slot's ready event is recorded after the
decode, so compute (and the next copy into the same landing buffer) waits for it on the GPU. No host
synchronization anywhere: CUDA-graph capture sees a copy, a kernel and events. Groups that did not
compress (None) are copied raw straight into the slot as before. On the CPU backend the reference
decoder fills the slot. A compressed group of the disk tier (`disk.py`, `diskcache.py`) takes the same
path, its blob coming from the disk reader's pinned bounce buffer instead of the arena.
"""

from __future__ import annotations

import dataclasses

import torch

from . import codec
from .disk import DiskTier
from .host import HostArena
from .transfer import CudaTransfer, SyncTransfer


def sized(enc: codec.EncodedGroup) -> codec.EncodedGroup:
    """`enc` with its blob dropped: a meta tensor of the blob's size (the arena is allocated from it
    before the blob is written where it goes)."""
    return dataclasses.replace(enc, blob=torch.empty(enc.wire_bytes, dtype=torch.uint8, device="meta"))


def place(arena: HostArena, group: int, enc: codec.EncodedGroup,
          again: codec.EncodedGroup | None) -> codec.EncodedGroup:
    """Write `again` (group `group` coded a second time) into its arena region; `enc` (from the first
    coding, which sized the region) pointing at the region. The codec is deterministic: a different
    size is a bug, raised."""
    if again is None or again.wire_bytes != enc.wire_bytes:
        raise RuntimeError(f"weightstream: group {group} encoded to a different size the second time")
    region = arena.region(group)
    region.copy_(again.blob)
    return dataclasses.replace(enc, blob=region)


def encode_groups(groups, group_bytes: list[int], landing_bytes: int, device: torch.device,
                  progress: bool | None = None,
                  only: list[bool] | None = None) -> list[codec.EncodedGroup | None]:
    """Encode each streamed group (a list of (entry, slice)) for the wire, on `device` when it is a GPU
    (fast), else on the CPU, to learn its size; the blobs are not kept (each `blob` is a meta tensor
    of the blob's size) so the arena can be allocated exactly before `fill_arena` writes them. A
    group that does not shrink, or whose blob would not fit a landing buffer of `landing_bytes`, is
    None (it streams raw), as is every group `only` marks False (tensor subclasses). Shows a progress
    bar over groups (tqdm; `progress` None: on a terminal)."""
    from tqdm import tqdm

    where = device if device.type == "cuda" else None
    encoded = []
    bar = tqdm(list(zip(groups, group_bytes, strict=True)), desc="weightstream: compressing groups",
               unit="group", disable=False if progress else None if progress is None else True)
    for g, (group, nbytes) in enumerate(bar):
        if only is not None and not only[g]:
            encoded.append(None)
            continue
        enc = codec.encode_group([(entry.tensor, sl.offset) for entry, sl in group], nbytes, where)
        if enc is not None and enc.wire_bytes <= landing_bytes:
            encoded.append(sized(enc))
        else:
            encoded.append(None)
    return encoded


def fill_arena(arena: HostArena, wire: list[codec.EncodedGroup | None], groups,
               device: torch.device) -> list[codec.EncodedGroup | None]:
    """Encode each compressed group again (same bytes: the codec is deterministic) straight into its
    arena region (one copy from the GPU into pinned memory per group); returns the encodings pointing
    at the arena."""
    where = device if device.type == "cuda" else None
    placed = []
    for g, enc in enumerate(wire):
        if enc is not None:
            again = codec.encode_group([(entry.tensor, sl.offset) for entry, sl in groups[g]],
                                       enc.raw_bytes, where)
            enc = place(arena, g, enc, again)
        placed.append(enc)
    return placed


class CodedSyncTransfer(SyncTransfer):
    """The CPU backend with compressed groups: the reference decoder fills the slot."""

    def __init__(self, arena: HostArena, slots: list[torch.Tensor], wire: list[codec.EncodedGroup | None],
                 disk: DiskTier | None = None) -> None:
        super().__init__(arena, slots, disk)
        self.wire = wire
        self.bounce: torch.Tensor | None = None  # compressed disk groups' blobs are read into it

    def _copy(self, slot: int, group: int) -> None:
        if self.wire[group] is None:
            super()._copy(slot, group)
        elif self.on_disk(group):
            if self.bounce is None:
                self.bounce = torch.empty(self.disk.max_read_bytes, dtype=torch.uint8)
            codec.decode_group(self.disk.read(group, self.bounce), self.slots[slot])
        else:
            codec.decode_group(self.arena.region(group), self.slots[slot])

    def raw_group(self, group: int) -> torch.Tensor:
        """`group`'s bytes in its layout (decoded; a disk group's read raw from its checkpoint)."""
        enc = self.wire[group]
        if enc is None or self.on_disk(group):
            return super().raw_group(group)
        return codec.decode_group(enc.blob, torch.zeros(enc.raw_bytes, dtype=torch.uint8))


class CodedCudaTransfer(CudaTransfer):
    """CUDA copies of compressed groups into landing buffers, decoded into the slots on a decode stream."""

    def __init__(self, arena: HostArena, slots: list[torch.Tensor], device: torch.device,
                 wire: list[codec.EncodedGroup | None], landing_bytes: int, disk: DiskTier | None = None,
                 pin: bool = True) -> None:
        from . import codec_triton

        super().__init__(arena, slots, device, disk, pin)
        self.wire = wire
        self.decoder = codec_triton
        self.decode_stream = torch.cuda.Stream(device)
        self.landing = [torch.empty(landing_bytes, dtype=torch.uint8, device=device) for _ in slots]
        self._warm_up()

    def _warm_up(self) -> None:
        """Compile and load the kernel now, not inside a forward (or a CUDA graph capture)."""
        for g, enc in enumerate(self.wire):
            if enc is not None and self.slots:
                blob = self.disk.read(g, torch.empty(enc.wire_bytes, dtype=torch.uint8)) \
                    if self.on_disk(g) else enc.blob
                self.landing[0][: enc.wire_bytes].copy_(blob)
                self.decoder.decode(self.landing[0], self.slots[0], enc.chunks)
                torch.cuda.synchronize(self.device)
                return

    def start_copy(self, slot: int, group: int) -> None:
        """Copy `group`'s blob into `slot`'s landing buffer once compute has released the slot and the
        landing buffer's last decode has finished; decode it into the slot on the decode stream."""
        enc = self.wire[group]
        if enc is None:
            super().start_copy(slot, group)
            return
        capturing = torch.cuda.is_current_stream_capturing()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        if self.ready_in_capture[slot] == capturing:
            self.stream.wait_event(self.ready[slot])  # the landing buffer's last decode has finished
        landing = self.landing[slot]
        with torch.cuda.stream(self.stream):
            self._land(slot, group)
        self.decode_stream.wait_stream(self.stream)
        with torch.cuda.stream(self.decode_stream):
            self.decoder.decode(landing, self.slots[slot], enc.chunks)
        self.ready[slot].record(self.decode_stream)
        self.ready_in_capture[slot] = capturing

    def _land(self, slot: int, group: int) -> None:
        """Enqueue the copy of `group`'s blob into `slot`'s landing buffer on the current stream: from
        the arena, or from the disk reader's bounce buffer (refilled once the copy is done)."""
        enc = self.wire[group]
        if not self.on_disk(group):
            self.landing[slot][: enc.wire_bytes].copy_(enc.blob, non_blocking=True)
            return
        src, index = self.disk_source(group)
        self.landing[slot][: enc.wire_bytes].copy_(src, non_blocking=index is not None)
        self.disk_copied(index)

    def close(self) -> None:
        """Stop the disk reader, if any, and free the landing buffers (restore no longer needs them)."""
        super().close()
        self.synchronize()
        self.landing.clear()

    def join(self) -> None:
        """Make the compute stream wait for every copy and decode started so far."""
        super().join()
        torch.cuda.current_stream(self.device).wait_stream(self.decode_stream)

    def synchronize(self) -> None:
        """Block the host until every copy and decode has finished."""
        super().synchronize()
        self.decode_stream.synchronize()

    def raw_group(self, group: int) -> torch.Tensor:
        """`group`'s bytes in its layout, decoded on the GPU into a new GPU tensor."""
        enc = self.wire[group]
        if enc is None or self.on_disk(group):
            return super().raw_group(group)
        out = torch.zeros(enc.raw_bytes, dtype=torch.uint8, device=self.device)
        blob = enc.blob.to(self.device)
        self.decoder.decode(blob, out, enc.chunks)
        return out


def make_transfer(arena: HostArena, slots: list[torch.Tensor], device: torch.device,
                  disk: DiskTier | None, pin: bool, wire: list[codec.EncodedGroup | None] | None,
                  landing_bytes: int) -> SyncTransfer:
    """The transfer for an offload: compressed when any group is (`wire`), CUDA or synchronous."""
    coded = wire is not None and any(enc is not None for enc in wire)
    if device.type == "cuda":
        if coded:
            return CodedCudaTransfer(arena, slots, device, wire, landing_bytes, disk, pin)
        return CudaTransfer(arena, slots, device, disk, pin)
    return CodedSyncTransfer(arena, slots, wire, disk) if coded else SyncTransfer(arena, slots, disk)
