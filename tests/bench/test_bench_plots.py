"""Plots of stored results (matplotlib: installed by the `test` extra, so CI runs these)."""

from __future__ import annotations

import os

import pytest

from weightstream.bench import plots
from weightstream.bench.index import page_plots


def test_plot_tokens_per_s_from_stored_results(bench_doc, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    plots.plot_tokens_per_s([bench_doc], str(png))
    assert png.stat().st_size > 0


def test_plot_tokens_per_s_draws_every_mode(bench_doc, tmp_path):
    """Each mode has a line style, graph-eager included (a KeyError here would lose the plot)."""
    pytest.importorskip("matplotlib")
    rows = [{**r, "mode": mode} for r in bench_doc["results"] for mode in ("graph", "graph-eager")]
    png = tmp_path / "modes.png"
    plots.plot_tokens_per_s([{**bench_doc, "results": rows}], str(png))
    assert png.stat().st_size > 0


def test_plot_timeline_from_events(tmp_path):
    pytest.importorskip("matplotlib")
    events = [("copy", "Memcpy HtoD (Pinned -> Device)", 0.0, 4.0), ("compute", "gemm", 0.5, 1.5),
              ("copy", "Memcpy HtoD (Pinned -> Device)", 4.0, 8.0), ("compute", "gemm", 4.2, 5.0)]
    png = tmp_path / "timeline.png"
    plots.plot_timeline(events, str(png))
    assert png.stat().st_size > 0


def test_timelines_of_one_method_and_phase_at_two_budgets_keep_both_plots(bench_doc, tmp_path):
    pytest.importorskip("matplotlib")
    doc = bench_doc
    events = [["copy", "Memcpy HtoD (Pinned -> Device)", 0.0, 4.0], ["compute", "gemm", 0.5, 1.5]]
    budgets = (doc["weight_bytes"] // 4, doc["weight_bytes"] // 2)
    timelines = [{"method": "ws-auto", "phase": "decode-b1", "mode": "eager", "budget_bytes": b,
                  "events": events} for b in budgets]
    paths = page_plots([{**doc, "timelines": timelines}], [str(tmp_path / "suite_tiny.json")], str(tmp_path))
    names = sorted(n for n in map(os.path.basename, paths) if n.startswith("timeline"))
    assert names == ["timeline_tiny_ws-auto_decode-b1_25pct.png", "timeline_tiny_ws-auto_decode-b1_50pct.png"]
    assert all((tmp_path / n).stat().st_size > 0 for n in names)


def test_plot_timeline_with_a_decode_row(tmp_path):
    pytest.importorskip("matplotlib")
    events = [("copy", "Memcpy HtoD (Pinned -> Device)", 0.0, 4.0), ("decode", "_decode_kernel", 4.0, 4.5),
              ("compute", "gemm", 4.5, 6.0)]
    png = tmp_path / "timeline.png"
    plots.plot_timeline(events, str(png))
    assert png.stat().st_size > 0
