"""Tell every streaming engine when a CUDA graph is captured or replayed.

Why: the schedule runs on the host and tracks what each staging slot holds. A graph replay runs no
Python, yet it rewrites the slots (its captured copies run again), and a capture records copies
without running them. Without being told, the next eager call would trust a slot a replay overwrote
(the stale-weights bug this module fixes). So `torch.cuda.CUDAGraph.capture_begin`, `capture_end` and
`replay` are wrapped, process-wide, while any engine is open: the first engine installs the wrappers,
the last one closed takes them off (after the last restore, torch is as it was). Before a capture
begins, before and after it ends, and before each replay, every live engine makes the current stream
wait for its copies still in flight (so a replay never races an eager prefetch into the same slot,
and a capture of part of a pass ends with its copy stream joined) and forgets what its slots hold
(so its next wait starts a fresh pass). This covers `torch.cuda.graph`,
`torch.cuda.make_graphed_callables` and torch.compile's cudagraph trees (`mode="reduce-overhead"`),
which all go through `torch.cuda.CUDAGraph`; a replay through the raw `torch._C._CUDAGraph` class is
not seen. The cost is a few microseconds per replay.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from . import host, ops


def notify(capture_begins: bool = False) -> None:
    """Make every live engine join its copies in flight and forget its slots' contents. Called before
    a graph capture begins, before and after it ends and before each replay (tests call it to
    simulate one). Before a capture begins each engine also blocks until its copies are done: an eager
    forward's last releases may have started the next forward's copies, and a capture cannot order
    its own work after eager work still in flight (torch.cuda.graph synchronizes the device first
    anyway; a bare `CUDAGraph.capture_begin` need not). Pinned memory whose unpinning was put off by
    a capture is unpinned here, after it (`host.unpin_deferred`)."""
    for engine in ops.engines():
        engine.on_graph_event(synchronize=capture_begins)
    host.unpin_deferred()


def _wrap(method: Callable, after: bool = False, begins: bool = False) -> Callable:
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        notify(capture_begins=begins)
        if after:  # capture_end
            try:
                result = method(self, *args, **kwargs)
            finally:
                host.capture_ended()
            notify()
            return result
        result = method(self, *args, **kwargs)
        if begins:
            host.capture_began()
        return result

    wrapper._weightstream_wrapped = True
    return wrapper


_ORIGINALS: dict[str, Callable] = {}  # the wrapped methods of torch.cuda.CUDAGraph, while wrapped


def install() -> None:
    """Wrap `torch.cuda.CUDAGraph`'s capture and replay methods, once (a new engine calls it; on a
    machine without CUDA they are wrapped too, and never called)."""
    graph = getattr(torch.cuda, "CUDAGraph", None)
    if graph is None or _ORIGINALS:
        return
    for name, after in (("capture_begin", False), ("capture_end", True), ("replay", False)):
        method = getattr(graph, name)
        if getattr(method, "_weightstream_wrapped", False):
            continue
        _ORIGINALS[name] = method
        setattr(graph, name, _wrap(method, after, begins=name == "capture_begin"))


def uninstall() -> None:
    """Put `torch.cuda.CUDAGraph` back as it was (the last engine closed: `StreamEngine.close`)."""
    graph = getattr(torch.cuda, "CUDAGraph", None)
    for name, method in _ORIGINALS.items():
        setattr(graph, name, method)
    _ORIGINALS.clear()


def installed() -> bool:
    """Whether `torch.cuda.CUDAGraph` is wrapped now."""
    return bool(_ORIGINALS)
