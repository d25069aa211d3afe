"""Compressed groups on the wire: encoded once at offload, decoded on the GPU every forward.

The host arena holds each compressed group's blob (`codec.py`). On CUDA a group's blob is copied into
a landing buffer on the copy stream (group i lands in buffer i % n_landing), then decoded into its slot
on a separate decode stream once compute has released the slot; the slot's ready event is recorded
after the decode, so compute waits for it on the GPU. Each landing buffer has two events: `landed`
(its last copy; the decode waits for it) and `decoded` (its last decode; the next copy into it waits
for it). As soon as a group's decode is enqueued, the blob of the group expected next into the same
slot (`Schedule.after`) is copied into its landing buffer once that buffer is free (`copy_ahead`):
with two slots into the buffer just decoded, with one slot and two buffers into the other one. So the
link moves the next blobs while the current groups decode and compute, and only the decode waits for
the slot. `Landings` keeps, on the host, which group each landing buffer holds; whatever changes the
buffers behind the host's back (a CUDA graph replay, a capture's start or end) calls `forget()`. No
host synchronization anywhere: CUDA-graph capture sees copies, kernels and events. Groups that did not
compress (None) are copied raw straight into the slot as before. On the CPU backend the same
bookkeeping runs with host landing buffers and the reference decoder, so the fuzzer checks it. A
compressed group of the disk tier (`disk.py`, `diskcache.py`) takes the same path, its blob coming
from the disk reader's pinned bounce buffer instead of the arena; it is never copied ahead.
"""

from __future__ import annotations

import dataclasses

import torch

from ..engine.host import HostArena
from ..engine.transfer import CudaTransfer, SyncTransfer
from ..formats.disk import DiskTier
from . import codec


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


class Landings:
    """Which group each of `n` landing buffers holds (or is being filled with), on the host, and
    whether that blob still waits for its decode (a buffer copied ahead and not decoded yet)."""

    def __init__(self, n: int, wire: list[codec.EncodedGroup | None], on_disk) -> None:
        self.n = n
        self.wire = wire
        self.on_disk = on_disk
        self.held: list[int | None] = [None] * n
        self.pending: list[bool] = [False] * n

    def forget(self) -> None:
        """The buffers changed behind the host's back: trust none of them."""
        self.held = [None] * self.n
        self.pending = [False] * self.n

    def steps(self, group: int) -> tuple[int, bool]:
        """For compressed `group` about to be decoded into its slot: (its landing buffer, whether its
        bytes must be copied there first). Records that the buffer holds it, decoded."""
        buffer = group % self.n
        land = self.held[buffer] != group or self.on_disk(group)
        self.held[buffer] = None if self.on_disk(group) else group
        self.pending[buffer] = False
        return buffer, land

    def ahead(self, then: int | None) -> int | None:
        """The landing buffer to copy `then`'s blob into now, ahead of its decode, or None: `then` is
        raw, on disk, already there, or its buffer holds a blob still waiting for its decode (a copy
        there would only displace it)."""
        if then is None or self.wire[then] is None or self.on_disk(then):
            return None
        buffer = then % self.n
        if self.held[buffer] == then or self.pending[buffer]:
            return None
        self.held[buffer] = then
        self.pending[buffer] = True
        return buffer


class CodedSyncTransfer(SyncTransfer):
    """The CPU backend with compressed groups: blobs land in host landing buffers (the same
    bookkeeping as on CUDA) and the reference decoder fills the slot."""

    def __init__(self, arena: HostArena, slots: list[torch.Tensor], wire: list[codec.EncodedGroup | None],
                 disk: DiskTier | None = None, n_landing: int = 1, landing_bytes: int = 0) -> None:
        super().__init__(arena, slots, disk)
        self.wire = wire
        self.bounce: torch.Tensor | None = None  # compressed disk groups' blobs are read into it
        self.landings = Landings(n_landing, wire, self.on_disk)
        self.landing = [torch.empty(landing_bytes, dtype=torch.uint8) for _ in range(n_landing)]

    def forget(self) -> None:
        self.landings.forget()

    def start_copy(self, slot: int, group: int) -> None:
        enc = self.wire[group]
        if enc is None:
            super().start_copy(slot, group)
        elif self.on_disk(group):
            if self.bounce is None:
                self.bounce = torch.empty(self.disk.max_read_bytes, dtype=torch.uint8)
            self.landings.steps(group)
            codec.decode_group(self.disk.read(group, self.bounce), self.slots[slot])
        else:
            buffer, land = self.landings.steps(group)
            if land:
                self.landing[buffer][: enc.wire_bytes].copy_(self.arena.region(group))
            codec.decode_group(self.landing[buffer][: enc.wire_bytes], self.slots[slot])

    def copy_ahead(self, then: int | None) -> bool:
        buffer = self.landings.ahead(then)
        if buffer is not None:
            blob = self.arena.region(then)
            self.landing[buffer][: blob.numel()].copy_(blob)
        return buffer is not None

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
                 pin: bool = True, n_landing: int = 1) -> None:
        from . import triton_decoder as codec_triton

        super().__init__(arena, slots, device, disk, pin)
        self.wire = wire
        self.decoder = codec_triton
        # normal priority: a high-priority decode stream was no faster on a Flux step (220.1 against
        # 221.5 ms) and slowed GEMMs beside it more
        # (benchmarks/results/2026-12-04_h200_decoder/diag_decode_overlap.log)
        self.decode_stream = torch.cuda.Stream(device)
        self.landing = [torch.empty(landing_bytes, dtype=torch.uint8, device=device)
                        for _ in range(n_landing)]
        for buffer in self.landing + slots:  # written or read on the side streams (see CudaTransfer)
            buffer.record_stream(self.decode_stream)
        for buffer in self.landing:
            buffer.record_stream(self.stream)
        self.landings = Landings(n_landing, wire, self.on_disk)
        # each landing buffer's last copy (its decode waits for it) and last decode (the next copy into
        # it waits for it), and whether each was recorded inside a capture (see ready_in_capture)
        self.landed = [torch.cuda.Event() for _ in range(n_landing)]
        self.landed_in_capture = [False] * n_landing
        self.decoded = [torch.cuda.Event() for _ in range(n_landing)]
        self.decoded_in_capture = [False] * n_landing
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

    def forget(self) -> None:
        self.landings.forget()

    def start_copy(self, slot: int, group: int) -> None:
        """Decode `group` into `slot` on the decode stream once compute has released the slot and its
        blob has landed (copied now into its landing buffer once that buffer's last decode has
        finished, unless it was copied ahead)."""
        enc = self.wire[group]
        if enc is None:
            super().start_copy(slot, group)
            return
        capturing = torch.cuda.is_current_stream_capturing()
        compute = torch.cuda.current_stream(self.device)
        # the copy stream joins compute here too: inside a capture that forks it into the graph
        self.stream.wait_stream(compute)
        buffer, land = self.landings.steps(group)
        if land:
            self._land(buffer, group, capturing)
        self.decode_stream.wait_stream(compute)  # the slot is free
        self.after_last_write(self.decode_stream, slot)  # a raw copy into it may still run
        if self.landed_in_capture[buffer] == capturing:
            self.decode_stream.wait_event(self.landed[buffer])  # the blob is there (not what follows it)
        with torch.cuda.stream(self.decode_stream):
            self.decoder.decode(self.landing[buffer], self.slots[slot], enc.chunks)
        self.decoded[buffer].record(self.decode_stream)
        self.decoded_in_capture[buffer] = capturing
        self.ready[slot].record(self.decode_stream)
        self.ready_in_capture[slot] = capturing

    def copy_ahead(self, then: int | None) -> bool:
        """Start copying `then`'s blob into its landing buffer (after the buffer's last decode) where
        `Landings.ahead` says so, so it crosses the link before its slot is free; whether it did."""
        buffer = self.landings.ahead(then)
        if buffer is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # forked, inside a capture
            self._land(buffer, then, torch.cuda.is_current_stream_capturing())
        return buffer is not None

    def _land(self, buffer: int, group: int, capturing: bool) -> None:
        """Enqueue the copy of `group`'s blob into landing buffer `buffer` on the copy stream once the
        buffer's last decode has finished, and record the buffer's `landed` event: from the arena, or
        from the disk reader's bounce buffer (refilled once the copy is done)."""
        if self.decoded_in_capture[buffer] == capturing:
            self.stream.wait_event(self.decoded[buffer])
        enc = self.wire[group]
        with torch.cuda.stream(self.stream):
            if not self.on_disk(group):
                self.landing[buffer][: enc.wire_bytes].copy_(enc.blob, non_blocking=True)
            else:
                src, index = self.disk_source(group)
                self.landing[buffer][: enc.wire_bytes].copy_(src, non_blocking=index is not None)
                self.disk_copied(index)
        self.landed[buffer].record(self.stream)
        self.landed_in_capture[buffer] = capturing

    def close(self) -> None:
        """Stop the disk reader, if any, and free the landing buffers (restore no longer needs them)."""
        super().close()
        self.synchronize()
        self.landing.clear()

    def forget_events(self) -> None:
        """As `CudaTransfer.forget_events`, for the landing buffers' events too."""
        super().forget_events()
        self.landed_in_capture = [None] * len(self.landed_in_capture)
        self.decoded_in_capture = [None] * len(self.decoded_in_capture)

    def side_streams(self) -> list[torch.cuda.Stream]:
        """The copy stream and the decode stream."""
        return [self.stream, self.decode_stream]

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
                  landing_bytes: int, n_landing: int) -> SyncTransfer:
    """The transfer for an offload: compressed when any group is (`wire`; `n_landing` landing buffers
    of `landing_bytes`), CUDA or synchronous."""
    coded = wire is not None and any(enc is not None for enc in wire)
    if not coded:
        return CudaTransfer(arena, slots, device, disk, pin) if device.type == "cuda" \
            else SyncTransfer(arena, slots, disk)
    if device.type == "cuda":
        return CodedCudaTransfer(arena, slots, device, wire, landing_bytes, disk, pin, n_landing)
    return CodedSyncTransfer(arena, slots, wire, disk, n_landing, landing_bytes)
