"""How bytes move from the host arena into the GPU slots.

`CudaTransfer` copies on a side stream forked from the compute stream and orders the two with GPU-side
events only, so a forward never synchronizes the host and can be captured in a CUDA graph.
`SyncTransfer` runs the same schedule on machines without CUDA: copies happen at once, in order.
"""

from __future__ import annotations

import torch

from .errors import WeightstreamError
from .host import HostArena


class SyncTransfer:
    """Immediate copies for the CPU backend (and any device without streams)."""

    def __init__(self, arena: HostArena, slots: list[torch.Tensor]) -> None:
        self.arena = arena
        self.slots = slots

    def _copy(self, slot: int, group: int) -> None:
        src = self.arena.region(group)
        self.slots[slot][: src.numel()].copy_(src)

    def start_copy(self, slot: int, group: int) -> None:
        """Fill `slot` with `group` (here: at once)."""
        self._copy(slot, group)

    def wait(self, slot: int) -> None:
        """Make compute wait for the last copy into `slot` (here: nothing to wait for)."""

    def fetch_now(self, slot: int, group: int) -> None:
        """Fill `slot` with `group` in compute order (a miss)."""
        self._copy(slot, group)

    def join(self) -> None:
        """Make compute wait for every copy started so far (here: nothing to wait for)."""

    def synchronize(self) -> None:
        """Block the host until every copy has finished (here: nothing to wait for)."""


class CudaTransfer(SyncTransfer):
    """Asynchronous host->GPU copies on a dedicated copy stream, ordered with CUDA events."""

    def __init__(self, arena: HostArena, slots: list[torch.Tensor], device: torch.device) -> None:
        super().__init__(arena, slots)
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.ready = [torch.cuda.Event() for _ in slots]
        # Whether each event was last recorded inside a CUDA graph capture. Such an event cannot be
        # waited on outside that capture (nor an eager one inside it); neither wait is needed: a capture
        # starts after a device synchronize, and a captured forward joins its copies before it ends.
        self.ready_in_capture = [False for _ in slots]

    def _check_capturable(self) -> None:
        if not self.arena.pinned_bytes and torch.cuda.is_current_stream_capturing():
            raise WeightstreamError(
                "CUDA graph capture needs pinned host memory: offload with pin_memory=True (the default)"
            )

    def start_copy(self, slot: int, group: int) -> None:
        """Start copying `group` into `slot` on the copy stream once compute has released the slot."""
        self._check_capturable()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self._copy_async(slot, group)
        self.ready[slot].record(self.stream)
        self.ready_in_capture[slot] = torch.cuda.is_current_stream_capturing()

    def _copy_async(self, slot: int, group: int) -> None:
        src = self.arena.region(group)
        self.slots[slot][: src.numel()].copy_(src, non_blocking=True)

    def wait(self, slot: int) -> None:
        """Make the compute stream wait (on the GPU) for the copy into `slot`."""
        if self.ready_in_capture[slot] == torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream(self.device).wait_event(self.ready[slot])

    def fetch_now(self, slot: int, group: int) -> None:
        """Copy `group` into `slot` on the compute stream, after any copy still in flight into it."""
        self._check_capturable()
        self.wait(slot)
        self._copy_async(slot, group)

    def join(self) -> None:
        """Make the compute stream wait for every copy started so far (keeps CUDA graph capture joined)."""
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def synchronize(self) -> None:
        """Block the host until every copy has finished."""
        self.stream.synchronize()
