"""How bytes move from the host arena into the GPU slots.

`CudaTransfer` copies on a side stream forked from the compute stream and orders the two with GPU-side
events only, so a forward never synchronizes the host and can be captured in a CUDA graph.
`SyncTransfer` runs the same schedule on machines without CUDA: copies happen at once, in order.
"""

from __future__ import annotations

import torch

from ..errors import WeightstreamError
from ..formats.disk import DiskPrefetcher, DiskTier
from .host import HostArena


class SyncTransfer:
    """Immediate copies for the CPU backend (and any device without streams)."""

    def __init__(self, arena: HostArena, slots: list[torch.Tensor], disk: DiskTier | None = None) -> None:
        self.arena = arena
        self.slots = slots
        self.disk = disk

    def on_disk(self, group: int) -> bool:
        """True when `group` is read from its checkpoint file rather than host memory."""
        return self.disk is not None and self.disk.holds(group)

    def _copy(self, slot: int, group: int) -> None:
        if self.on_disk(group):
            self.disk.read(group, self.slots[slot])
            return
        src = self.arena.region(group)
        self.slots[slot][: src.numel()].copy_(src)

    def raw_group(self, group: int) -> torch.Tensor:
        """`group`'s bytes in its layout (uint8): its arena region, or read from disk."""
        return self.disk.load(group) if self.on_disk(group) else self.arena.region(group)

    def start_copy(self, slot: int, group: int) -> None:
        """Fill `slot` with `group` (here: at once). The engine follows each call with
        `copy_ahead(Schedule.ahead(group))`."""
        self._copy(slot, group)

    def copy_ahead(self, then: int | None) -> bool:
        """Start moving `then`'s bytes (the group expected next into a slot just filled) towards the
        GPU before its slot is free, where the transfer has somewhere to put them (compressed groups: a
        free landing buffer; here: nowhere); whether it did."""
        return False

    def forget(self) -> None:
        """Whatever the transfer staged beyond the slots (landing buffers) changed behind the host's
        back, or may have: a replay, a capture's start or end, a failed wait (here: nothing staged)."""

    def wait(self, slot: int) -> None:
        """Make compute wait for the last copy into `slot` (here: nothing to wait for)."""

    def join(self) -> None:
        """Make compute wait for every copy started so far (here: nothing to wait for)."""

    def join_for_graph(self) -> None:
        """At a graph capture's start or end and before a replay: wait for copies in flight (here:
        none)."""

    def forget_events(self) -> None:
        """After a graph event's join: no event recorded so far is waited on again (here: none)."""

    def synchronize_idle(self) -> None:
        """Before a graph capture: wait on the host for the copies in flight (here: none)."""

    def capturing(self) -> bool:
        """True while a CUDA graph is being captured on the current stream (here: never)."""
        return False

    def synchronize(self) -> None:
        """Block the host until every copy has finished (here: nothing to wait for)."""

    def close(self) -> None:
        """Stop background work (the disk reader) and delete the disk tier's compressed cache."""
        if self.disk is not None:
            self.disk.close()

    def check_capture(self) -> None:
        """Raise when a CUDA graph is being captured and this transfer cannot be captured."""

    @property
    def extra_pinned_bytes(self) -> int:
        """Pinned bytes beyond the arena (disk bounce buffers)."""
        return 0


def _is_capturing(stream: torch.cuda.Stream) -> bool:
    """Whether `stream` is part of a CUDA graph capture under way (forked into it)."""
    with torch.cuda.stream(stream):
        return torch.cuda.is_current_stream_capturing()


class CudaTransfer(SyncTransfer):
    """Asynchronous host->GPU copies on a dedicated copy stream, ordered with CUDA events."""

    def __init__(
        self,
        arena: HostArena,
        slots: list[torch.Tensor],
        device: torch.device,
        disk: DiskTier | None = None,
        pin: bool = True,
    ) -> None:
        super().__init__(arena, slots, disk)
        self.prefetcher = None
        if disk is not None and disk.order:
            self.prefetcher = DiskPrefetcher(disk, 2, disk.max_read_bytes, pin=pin)
        self.device = device
        self.stream = torch.cuda.Stream(device)
        # Copies into the slots may outlive the forward that started them (its last releases start the
        # next forward's): should the slots be freed meanwhile (the model dropped without restore()),
        # the caching allocator must not hand their memory out before those copies are done.
        for slot in slots:
            slot.record_stream(self.stream)
        self.ready = [torch.cuda.Event() for _ in slots]
        # Whether each event was last recorded inside a CUDA graph capture. Such an event cannot be
        # waited on outside that capture (nor an eager one inside it); neither wait is needed: a capture
        # starts after a device synchronize, and a captured forward joins its copies before it ends.
        self.ready_in_capture = [False for _ in slots]

    def capturing(self) -> bool:
        """True while a CUDA graph is being captured on the current stream."""
        return torch.cuda.is_current_stream_capturing()

    def check_capture(self) -> None:
        """Raise when a CUDA graph is being captured and this transfer cannot be captured: groups on
        disk, or pageable host memory. Called before any GPU work of a forward is enqueued."""
        if not torch.cuda.is_current_stream_capturing():
            return
        if self.disk is not None and self.disk.order:
            raise WeightstreamError(
                "groups read from disk cannot be captured in a CUDA graph: give cpu_memory enough for "
                "every streamed group, or run without CUDA graphs"
            )
        if self.arena.nbytes and not self.arena.pinned_bytes:
            raise WeightstreamError(
                "CUDA graph capture needs pinned host memory: offload with pin_memory=True (the default)"
            )

    def after_last_write(self, stream: torch.cuda.Stream, slot: int) -> None:
        """Make `stream` wait for the last write into `slot` (the event `ready[slot]`, where it was
        recorded in the same capture state). Writes into one slot come from two streams where a model
        streams some groups raw (copies) and some compressed (decodes): nothing else orders such a
        copy after a decode into the same slot, or a decode after a copy, when no compute waited for
        the slot in between (a new pass started while the last forward's copies were in flight)."""
        if self.ready_in_capture[slot] == torch.cuda.is_current_stream_capturing():
            stream.wait_event(self.ready[slot])

    def start_copy(self, slot: int, group: int) -> None:
        """Start copying `group` into `slot` on the copy stream once compute has released the slot and
        the slot's last write is done."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.after_last_write(self.stream, slot)
        with torch.cuda.stream(self.stream):
            self._copy_async(slot, group)
        self.ready[slot].record(self.stream)
        self.ready_in_capture[slot] = torch.cuda.is_current_stream_capturing()

    def _copy_async(self, slot: int, group: int) -> None:
        """Enqueue the copy of `group` into `slot` on the current stream."""
        dst = self.slots[slot]
        if not self.on_disk(group):
            src = self.arena.region(group)
            dst[: src.numel()].copy_(src, non_blocking=True)
            return
        src, index = self.disk_source(group)
        dst[: src.numel()].copy_(src, non_blocking=index is not None)
        self.disk_copied(index)

    def disk_source(self, group: int) -> tuple[torch.Tensor, int | None]:
        """What crosses the wire for disk group `group` (its blob or raw layout) in host memory: the
        reader's pinned bounce buffer and its index, or (out of the reader's order) a pageable tensor
        read now and None. Enqueue its copy, then call `disk_copied`."""
        got = self.prefetcher.take(group)
        if got is not None:
            return got
        return self.disk.read(group, torch.empty(self.disk.read_bytes(group), dtype=torch.uint8)), None

    def disk_copied(self, index: int | None) -> None:
        """The copy out of bounce buffer `index` is enqueued on the current stream: refill it once the
        copy has finished (None: a pageable read, copied synchronously)."""
        if index is None:
            return
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(self.device))
        self.prefetcher.give_back(index, copied)

    def wait(self, slot: int) -> None:
        """Make the compute stream wait (on the GPU) for the copy into `slot`."""
        if self.ready_in_capture[slot] == torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream(self.device).wait_event(self.ready[slot])

    def side_streams(self) -> list[torch.cuda.Stream]:
        """The streams this transfer enqueues work on besides the compute stream."""
        return [self.stream]

    def join(self) -> None:
        """Make the compute stream wait for every copy started so far (keeps CUDA graph capture joined).
        Inside a capture, each side stream that the capture forked is joined, and only those: torch
        hands out streams from a pool of 32 per device, so another engine's stream may be one of
        these, forked by that engine's capture while this engine's other stream was not (waiting on
        an unforked stream breaks the capture)."""
        current = torch.cuda.current_stream(self.device)
        capturing = torch.cuda.is_current_stream_capturing()
        for stream in self.side_streams():
            if capturing and not _is_capturing(stream):
                continue
            current.wait_stream(stream)

    def join_for_graph(self) -> None:
        """At a capture's start or end and before a replay: make the current stream wait for the copies
        still in flight. Eagerly, so a graph's copies into the same slots never race them; inside a
        capture about to end (a partial pass captured), so the side streams are joined back into it."""
        self.join()

    def forget_events(self) -> None:
        """After a graph event's join (and, before a capture, a host wait for the copies): no slot
        event recorded so far is waited on again. A later capture must not wait on an event of an
        earlier one (CUDA forbids merging two captures), and an eager call not on a captured one;
        nothing needs those waits any more, because the join ordered the current stream after every
        copy, and each later copy waits for the current stream."""
        self.ready_in_capture = [None] * len(self.ready_in_capture)

    def synchronize_idle(self) -> None:
        """Block the host until every copy has finished, on each side stream not being captured (a
        host wait on a capturing stream is illegal)."""
        for stream in self.side_streams():
            if not _is_capturing(stream):
                stream.synchronize()

    def synchronize(self) -> None:
        """Block the host until every copy has finished."""
        self.stream.synchronize()

    def close(self) -> None:
        """Stop the disk reader, if any, and delete the disk tier's compressed cache."""
        if self.prefetcher is not None:
            self.prefetcher.close()
        super().close()

    @property
    def extra_pinned_bytes(self) -> int:
        """Pinned bytes of the disk bounce buffers."""
        return self.prefetcher.pinned_bytes if self.prefetcher is not None else 0
