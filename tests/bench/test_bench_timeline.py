"""Profiler timelines: GPU activities split into copy, decode and compute rows, and their summary."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightstream.bench.shapes import build_model
from weightstream.bench.timeline import idle_causes, kernel_gaps, record_timeline, summary, timeline_events


def test_timeline_events_put_host_copies_on_the_copy_row():
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, device, start_us, end_us):
        span = SimpleNamespace(start=start_us, end=end_us)
        return SimpleNamespace(name=name, device_type=device, time_range=span)

    events = [event("aten::mm", cpu, 0, 50), event("sm90_gemm", cuda, 1500, 2500),
              event("Memcpy HtoD (Pinned -> Device)", cuda, 1000, 3000),
              event("Memset (Device)", cuda, 3000, 3010)]
    assert timeline_events(events) == [
        ("copy", "Memcpy HtoD (Pinned -> Device)", 0.0, 2.0), ("compute", "sm90_gemm", 0.5, 1.5),
        ("compute", "Memset (Device)", 2.0, 2.01)]
    assert timeline_events([event("aten::mm", cpu, 0, 50)]) == []


def test_record_timeline_is_empty_on_the_cpu():
    model = build_model("tiny", torch.device("cpu"))
    assert record_timeline(model, lambda: pytest.fail("must not run a forward on the CPU")) == []


def test_decode_kernels_get_their_own_row_and_the_summary_counts_overlaps_once():
    cuda = torch.autograd.DeviceType.CUDA

    def event(name, start_us, end_us):
        span = SimpleNamespace(start=start_us, end=end_us)
        return SimpleNamespace(name=name, device_type=cuda, time_range=span)

    events = timeline_events([event("Memcpy HtoD (Pinned -> Device)", 0, 4000),
                              event("_decode_kernel", 4000, 5000), event("gemm", 1000, 3000),
                              event("gemm", 2000, 3500), event("gemm", 5000, 6000)])
    assert [e[0] for e in events] == ["copy", "compute", "compute", "decode", "compute"]
    assert summary(events) == {"span_ms": 6.0, "copy_ms": 4.0, "decode_ms": 1.0, "compute_ms": 3.5,
                               "compute_idle_ms": 2.5, "compute_idle_decoding_ms": 1.0,
                               "compute_idle_copying_ms": 1.5, "compute_idle_other_ms": 0.0}
    assert summary([]) == {}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["copy", "decode", "compute"]), st.integers(0, 30),
                          st.integers(1, 8)), min_size=1, max_size=12))
def test_idle_causes_split_the_compute_idle_time_as_a_millisecond_grid_does(spans):
    # integer spans: each millisecond cell of the span is idle or not, and decoding / copying / neither
    events = [(row, "k", float(a), float(a + n)) for row, a, n in spans]
    lo, hi = min(a for _, a, _ in spans), max(a + n for _, a, n in spans)
    grid = {"compute_idle_decoding_ms": 0.0, "compute_idle_copying_ms": 0.0, "compute_idle_other_ms": 0.0}
    for t in range(lo, hi):
        active = {row for row, a, n in spans if a <= t < a + n}
        if "compute" in active:
            continue
        key = "decoding" if "decode" in active else "copying" if "copy" in active else "other"
        grid[f"compute_idle_{key}_ms"] += 1.0
    assert idle_causes(events) == pytest.approx(grid)
    assert sum(grid.values()) == pytest.approx(summary(events)["compute_idle_ms"])


def test_short_idle_spans_are_launch_gaps_whatever_else_runs():
    # a 0.02 ms gap during a copy is the host between two launches, not a wait for the copy
    events = [("copy", "c", 0.0, 2.0), ("compute", "k", 0.0, 1.0), ("compute", "k", 1.02, 1.5),
              ("compute", "k", 2.5, 3.0)]
    assert idle_causes(events) == pytest.approx(
        {"compute_idle_decoding_ms": 0.0, "compute_idle_copying_ms": 0.5, "compute_idle_other_ms": 0.52})


def test_kernel_gaps_split_by_whether_a_copy_spans_them():
    """Gaps up to 50 us between compute activities: a copy from end to end, or not (the link idle, or
    a copy ending inside the gap); longer waits, overlaps and gaps where a decode runs are left out."""
    events = [("copy", "Memcpy HtoD", 0.0, 10.0), ("compute", "a", 0.0, 1.0), ("compute", "b", 1.004, 2.0),
              ("compute", "c", 2.010, 9.998), ("compute", "d", 10.001, 11.0), ("compute", "e", 11.002, 12.0),
              ("compute", "f", 11.5, 12.5), ("decode", "_decode_kernel", 12.5, 12.52),
              ("compute", "g", 12.51, 13.0), ("compute", "h", 13.2, 14.0)]
    during, idle = kernel_gaps(events)
    assert during == pytest.approx([4.0, 10.0])
    assert idle == pytest.approx([3.0, 2.0])  # d starts after the copy ended; e with the link idle
