"""Exact-size host storage for the streamed groups.

PyTorch's caching host allocator rounds pinned allocations up to a power of two (vLLM users saw 1.8-1.9x
host RAM). We allocate ordinary host memory of exactly the streamed size and page-lock it ourselves
with cudaHostRegister, one region for all groups, each group a contiguous slice of it.
"""

from __future__ import annotations

import resource
import threading
import weakref

import torch

from ..errors import HostMemoryError, PinnedMemoryError
from ..sizes import format_size

_PAGE = 4096
MEMINFO = "/proc/meminfo"


def available_host_bytes() -> int | None:
    """The host memory available to allocate now (Linux's MemAvailable), or None where it cannot be
    read (then nothing is checked)."""
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def locked_memory_limit() -> int | None:
    """The process's locked-memory limit in bytes (`ulimit -l`, RLIMIT_MEMLOCK), or None where it is
    unlimited or cannot be read. Reported, not enforced beforehand: NVIDIA's driver page-locks past it
    (measured: 1 GiB registered under a 64 KiB limit, as root and as a user without capabilities)."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else int(soft)


def on_wsl() -> bool:
    """Whether this Linux runs under Windows (WSL), where page-locked memory comes from a pool that
    Windows caps below the machine's RAM."""
    try:
        with open("/proc/version") as f:
            return "microsoft" in f.read().lower()
    except OSError:
        return False


def pin_failure_context(nbytes: int) -> str:
    """What the host says about page-locking `nbytes` (bytes): the locked-memory limit, the available
    memory, and WSL's pool, for the error that a failed pin raises."""
    facts = [f"{format_size(nbytes)} asked"]
    limit = locked_memory_limit()
    facts.append("locked-memory limit (ulimit -l) unlimited" if limit is None
                 else f"locked-memory limit (ulimit -l) {format_size(limit)}")
    available = available_host_bytes()
    if available is not None:
        facts.append(f"{format_size(available)} of host memory available")
    if on_wsl():
        facts.append("running under WSL, whose page-locked pool Windows caps below the machine's RAM")
    return "; ".join(facts)


def check_host_memory(nbytes: int, what: str) -> None:
    """Refuse, before allocating, `nbytes` of host memory that is not available; `what` says what
    the bytes are for and how else to place them."""
    available = available_host_bytes()
    if available is not None and nbytes > available:
        raise HostMemoryError(
            f"the offloaded weights need {format_size(nbytes)} of host memory, but {format_size(available)} "
            f"is available: {what}")


class HostArena:
    """Host memory holding every streamed group, pinned (page-locked) when `pin` is true, for copies to
    `device` (a CUDA device; None: the current one).

    `group_bytes[i]` is the size in bytes of group i's region; `region(i)` is a uint8 CPU tensor.
    Call `close()` to unpin; the memory is freed with the last reference to the tensors.
    """

    def __init__(self, group_bytes: list[int], pin: bool, device: torch.device | None = None) -> None:
        self.offsets = [sum(group_bytes[:i]) for i in range(len(group_bytes))]
        self.group_bytes = list(group_bytes)
        self.nbytes = sum(group_bytes)
        check_host_memory(self.nbytes + _PAGE, "give more of the model to the GPU (a larger gpu_memory), "
                          "load it with weightstream.from_pretrained(..., cpu_memory=...) to leave streamed "
                          "groups in their files, or free host memory")
        self._raw = torch.empty(self.nbytes + _PAGE, dtype=torch.uint8)
        start = (-self._raw.data_ptr()) % _PAGE  # groups start page-aligned
        self.buffer = self._raw[start : start + self.nbytes]
        self.pinned_bytes = 0
        if pin and self.nbytes:
            # Register the whole allocation: PyTorch checks pinning at a tensor's storage start,
            # which lies before the aligned region.
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostRegister(self._raw.data_ptr(), self._raw.numel(), 0)
            if int(err) != 0:
                raise PinnedMemoryError(
                    f"could not page-lock {format_size(self.nbytes)} of host memory (CUDA error {int(err)}; "
                    f"{pin_failure_context(self._raw.numel())}). WSL caps page-locked memory below the "
                    "machine's RAM, and pinning needs free RAM: give more of the model to the GPU, load it "
                    "with from_pretrained(..., cpu_memory=...) to leave groups in their files, or pass "
                    "pin_memory=False to stream from pageable memory, which works but copies about 9x "
                    "slower and cannot be captured in CUDA graphs."
                )
            self.pinned_bytes = self._raw.numel()
        # Unpin when closed, or when the arena is dropped without close(); the finalizer holds the
        # allocation, so it is freed only after it is unregistered.
        # the device its copies go to (`device`, else the current one), synchronized before unpinning
        index = None
        if self.pinned_bytes:
            index = device.index if device is not None and device.index is not None else \
                torch.cuda.current_device()
        self._unpin = weakref.finalize(self, _unregister, self._raw, index)

    def region(self, group: int) -> torch.Tensor:
        """Return group `group`'s bytes as a uint8 tensor view."""
        start = self.offsets[group]
        return self.buffer[start : start + self.group_bytes[group]]

    def close(self) -> None:
        """Unpin the memory (the caller must have synchronized every copy that reads it)."""
        self._unpin()
        self.pinned_bytes = 0


_lock = threading.Lock()
_deferred: list[tuple[torch.Tensor, int]] = []  # arenas dropped during a graph capture, still pinned
_captures = 0  # graph captures under way in this process (replay.py counts them)


def _unregister(raw: torch.Tensor, device: int | None) -> None:
    """Unpin `raw` (pinned for copies to `device`; None: never pinned). Copies out of it may still be in
    flight when the arena is dropped without close(): a forward's last releases start the next
    forward's copies, which no later call waits for. So the device is synchronized first, unless a
    graph capture is under way (the garbage collector can run anywhere, in any thread), where neither
    that nor unpinning is allowed: then it waits for `unpin_deferred`, which the capture's end calls."""
    if device is None:
        return
    with _lock:
        if _captures or torch.cuda.is_current_stream_capturing():
            _deferred.append((raw, device))
            return
    torch.cuda.synchronize(device)
    torch.cuda.cudart().cudaHostUnregister(raw.data_ptr())


def capture_began() -> None:
    """A graph capture began (`replay.py`): unpinning waits until it ends."""
    global _captures
    with _lock:
        _captures += 1


def capture_ended() -> None:
    """A graph capture ended (`replay.py`)."""
    global _captures
    with _lock:
        _captures = max(0, _captures - 1)


def unpin_deferred() -> None:
    """Unpin the arenas dropped during a graph capture, once none is under way (`replay.notify`)."""
    with _lock:
        if not _deferred or _captures or torch.cuda.is_current_stream_capturing():
            return
        pending = list(_deferred)
        _deferred.clear()
    for raw, device in pending:
        _unregister(raw, device)
