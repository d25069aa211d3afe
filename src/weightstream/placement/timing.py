"""Timing and CUDA-graph capture shared by the probe, the benchmark suite and the benchmark scripts.

Every GPU time is taken with CUDA events: by default between consecutive calls of a loop (an offloaded
model prefetches the next call's first groups), for microbenchmarks around one call started from an
idle device. On a CPU the host clock stands in so the same code runs in the CPU tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], torch.Tensor], reps: int, device: torch.device, back_to_back: bool = True):
    """Call fn() `reps` times; each call's ms (CUDA events on CUDA, perf_counter on CPU) and the last
    output.

    back_to_back (the default): the calls follow each other with no synchronization between them, after
    one untimed call, and each call's time is the span from the event recorded after the call before it
    to its own: the steady state of a loop of calls. An offloaded model's last blocks start copying the
    next call's first groups; a call timed from an idle device would find them already copied and
    look faster than a loop of calls can run. False: each call starts from an idle device (kernel and
    copy microbenchmarks, where nothing carries over between calls)."""
    if device.type != "cuda":
        times, out = [], None
        for _ in range(reps):
            t0 = time.perf_counter()
            out = fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return times, out
    if back_to_back:
        sync(device)
        fn()  # untimed: the first timed call starts where a call of a loop starts
        events = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
        events[0].record()
        out = None
        for i in range(reps):
            out = fn()
            events[i + 1].record()
        events[-1].synchronize()
        return [events[i].elapsed_time(events[i + 1]) for i in range(reps)], out
    times, out = [], None
    for _ in range(reps):
        sync(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times, out


def capture_graph(fn: Callable[[torch.Tensor], torch.Tensor],
                  ids: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Capture fn(static copy of ids) in a CUDA graph (after a side-stream warm-up, as
    torch.cuda.graph asks); return a function that replays it and returns the static output."""
    static_in, side = ids.clone(), torch.cuda.Stream(ids.device)
    side.wait_stream(torch.cuda.current_stream(ids.device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(static_in)
    torch.cuda.current_stream(ids.device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fn(static_in)

    def replay() -> torch.Tensor:
        graph.replay()
        return static_out

    # the graph reads static_in's memory at every replay: keep it alive as long as the replay function,
    # or the caching allocator hands that memory to another tensor and the graph reads its bytes
    replay.static_in = static_in
    return replay
