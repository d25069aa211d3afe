"""The benchmark suite harness on the CPU: registry, a real tiny run, schema, tables and plots.

Timings are never asserted (the CPU runs the synchronous backend); exactness and the schema are.
"""

from __future__ import annotations

import copy
import glob
import importlib.util
import json
import os
import time
from types import SimpleNamespace

import pytest
import torch

from weightstream import suite

WS = ["ws-stream", "ws-uva", "ws-auto"]
PHASES = ["decode-b1", "prefill-8"]


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> str:
    """Path of the JSON written by one tiny CPU run (eager only; optional methods included so a missing
    import is recorded)."""
    path = str(tmp_path_factory.mktemp("suite") / "suite_tiny.json")
    methods = ["resident", *WS, "accelerate-cpu_offload", "diffusers-group"]
    suite.run_suite("tiny", [0.5, "0.8"], PHASES, methods, ["eager"], 2, "cpu", path, command="test")
    return path


@pytest.fixture
def doc(stored) -> dict:
    with open(stored) as f:
        return json.load(f)


def test_registry_lists_the_methods_and_skips_missing_imports_with_a_reason():
    names = [m.name for m in suite.METHODS]
    assert names == ["resident", *WS, "accelerate-cpu_offload", "accelerate-device_map", "diffusers-group"]
    registered, missing = suite.registry(), suite.unavailable()
    assert {"resident", *WS} <= set(registered)
    assert set(registered) | set(missing) == set(names) and not set(registered) & set(missing)
    for name, module in [("accelerate-cpu_offload", "accelerate"), ("accelerate-device_map", "accelerate"),
                         ("diffusers-group", "diffusers")]:
        if importlib.util.find_spec(module) is None:
            assert f"pip install {module}" in missing[name]
        else:
            assert registered[name].modes == ("eager",)
    assert all(suite.registry()[n].modes == suite.MODES for n in ["resident", *WS])


def test_tiny_run_is_valid_and_every_weightstream_method_is_exact(doc):
    assert suite.validate(doc) is doc
    assert doc["command"] == "test" and doc["h2d_bandwidth_GBps"] is None and doc["reference"] == "resident"
    for name, reason in suite.unavailable().items():
        if name != "accelerate-device_map":  # not asked for
            assert doc["skipped_methods"][name] == reason
    assert "CUDA" in doc["skipped_methods"]["diffusers-group"] or "diffusers" in doc["skipped_methods"][
        "diffusers-group"]
    rows = doc["results"]
    resident = [r for r in rows if r["method"] == "resident"]
    assert [r["phase"] for r in resident] == PHASES and all(r["reference"] == "self" for r in resident)
    assert all(r["budget_bytes"] is None for r in resident)
    ws_rows = [r for r in rows if r["method"] in WS]
    assert len(ws_rows) == len(WS) * 2 * len(PHASES)
    for r in ws_rows:
        assert r["error"] is None and r["skipped"] is None, r
        assert r["exact"] is True and r["reference"] == "resident eager", r
        assert r["budget_bytes"] in doc["budgets"] and r["setup"]["link_bytes"] > 0
        assert r["tokens_per_s"] > 0 and r["tokens"] == (1 if r["phase"] == "decode-b1" else 8)
    assert doc["budgets"] == [int(0.5 * doc["weight_bytes"]), int(0.8 * doc["weight_bytes"])]


def test_markdown_table_has_one_row_per_result(doc):
    table = suite.markdown_table([doc])
    lines = table.splitlines()
    assert lines[0].startswith("| shape | phase | budget | method | mode | tokens/s")
    assert len(lines) == 2 + len(doc["results"])
    assert any("| resident | eager |" in line and line.endswith("| ref |") for line in lines)
    assert any("| ws-stream | eager |" in line and line.endswith("| True |") for line in lines)


def test_errors_and_skips_show_in_the_table(doc):
    broken = copy.deepcopy(doc)
    broken["results"][0].update(median_ms=None, tokens_per_s=None, error="Unsupported: compiler.disable")
    broken["results"][1].update(median_ms=None, tokens_per_s=None, skipped="CUDA graphs need a CUDA device")
    table = suite.markdown_table([suite.validate(broken)])
    assert "error: Unsupported: compiler.disable" in table and "skipped: CUDA graphs" in table


def test_benchmarks_md_from_stored_results(stored, tmp_path):
    md = tmp_path / "docs" / "benchmarks.md"
    text = suite.write_benchmarks_md([stored], str(md), images=[str(tmp_path / "docs" / "bench_tiny.png")])
    assert md.read_text() == text
    assert text.startswith("# Benchmarks") and "link bound" in text and "command: `test`" in text
    assert "![bench_tiny.png](bench_tiny.png)" in text and "| tiny | decode-b1 |" in text


def test_plot_tokens_per_s_from_stored_results(doc, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    suite.plot_tokens_per_s([doc], str(png))
    assert png.stat().st_size > 0


def test_plot_timeline_from_events(tmp_path):
    pytest.importorskip("matplotlib")
    events = [("copy", "Memcpy HtoD (Pinned -> Device)", 0.0, 4.0), ("compute", "gemm", 0.5, 1.5),
              ("copy", "Memcpy HtoD (Pinned -> Device)", 4.0, 8.0), ("compute", "gemm", 4.2, 5.0)]
    png = tmp_path / "timeline.png"
    suite.plot_timeline(events, str(png))
    assert png.stat().st_size > 0


def test_timelines_of_one_method_and_phase_at_two_budgets_keep_both_plots(doc, tmp_path):
    pytest.importorskip("matplotlib")
    events = [["copy", "Memcpy HtoD (Pinned -> Device)", 0.0, 4.0], ["compute", "gemm", 0.5, 1.5]]
    budgets = (doc["weight_bytes"] // 4, doc["weight_bytes"] // 2)
    timelines = [{"method": "ws-auto", "phase": "decode-b1", "mode": "eager", "budget_bytes": b,
                  "events": events} for b in budgets]
    paths = suite.write_plots([{**doc, "timelines": timelines}], str(tmp_path))
    names = sorted(n for n in map(os.path.basename, paths) if n.startswith("timeline"))
    assert names == ["timeline_tiny_ws-auto_decode-b1_25pct.png", "timeline_tiny_ws-auto_decode-b1_50pct.png"]
    assert all((tmp_path / n).stat().st_size > 0 for n in names)


def test_report_mode_writes_the_page_and_plots(stored, tmp_path):
    pytest.importorskip("matplotlib")
    md = tmp_path / "benchmarks.md"
    assert suite.main(["--report", stored, "--md", str(md), "--png-dir", str(tmp_path / "png")]) == 0
    assert (tmp_path / "png" / "bench_tiny.png").stat().st_size > 0
    assert "](png/bench_tiny.png)" in md.read_text()


def test_timeline_events_put_host_copies_on_the_copy_row():
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, device, start_us, end_us):
        span = SimpleNamespace(start=start_us, end=end_us)
        return SimpleNamespace(name=name, device_type=device, time_range=span)

    events = [event("aten::mm", cpu, 0, 50), event("sm90_gemm", cuda, 1500, 2500),
              event("Memcpy HtoD (Pinned -> Device)", cuda, 1000, 3000),
              event("Memset (Device)", cuda, 3000, 3010)]
    assert suite.timeline_events(events) == [
        ("copy", "Memcpy HtoD (Pinned -> Device)", 0.0, 2.0), ("compute", "sm90_gemm", 0.5, 1.5),
        ("compute", "Memset (Device)", 2.0, 2.01)]
    assert suite.timeline_events([event("aten::mm", cpu, 0, 50)]) == []


def test_record_timeline_is_empty_on_the_cpu():
    model = suite.build_model("tiny", torch.device("cpu"))
    assert suite.record_timeline(model, lambda: pytest.fail("must not run a forward on the CPU")) == []


@pytest.mark.parametrize(
    "breakage, field",
    [
        (lambda d: d.pop("gpu"), "gpu"),
        (lambda d: d.update(weight_bytes="16GB"), "weight_bytes"),
        (lambda d: d["results"][0].update(exact="yes"), "results[0].exact"),
        (lambda d: d["results"][1].update(mode="fast"), "results[1].mode"),
        (lambda d: d["results"][2].pop("budget_bytes"), "results[2].budget_bytes"),
        (lambda d: d["results"][0].update(error="boom"), "results[0].median_ms"),
        (lambda d: d["results"][0].update(reps=True), "results[0].reps"),
    ],
)
def test_validate_names_the_bad_field(doc, breakage, field):
    breakage(doc)
    with pytest.raises(ValueError) as err:
        suite.validate(doc)
    assert str(err.value).startswith(field + ":") or str(err.value).startswith(field + " ")


def test_phases_and_budgets_parse():
    assert suite.parse_phase("decode-b64") == suite.Phase("decode-b64", 64, 1)
    assert suite.parse_phase("prefill-2048").tokens == 2048
    with pytest.raises(ValueError, match="decode-bN"):
        suite.parse_phase("decode")
    assert suite.resolve_budget("0.25", 1000) == 250 and suite.resolve_budget(0.5, 1000) == 500
    assert suite.resolve_budget("8GiB", 1000) == 8 * 2**30 and suite.resolve_budget(4096, 1000) == 4096
    with pytest.raises(ValueError, match="fraction"):
        suite.resolve_budget(1.5, 1000)


def test_bench_refuses_a_large_shape_without_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without CUDA")
    assert suite.main(["--shape", "llama-3-8b", "--out", "/nonexistent/never.json"]) == 1
    assert "--shape tiny" in capsys.readouterr().err


def test_recorded_h200_results_are_valid_and_render():
    """The committed H200 result files pass the schema and go into the page (notes included)."""
    results = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results")
    paths = sorted(glob.glob(os.path.join(results, "suite_*.json")))
    assert paths, "no recorded suite results"
    text = suite.markdown_table(suite.load_results(paths))
    assert "ws-auto" in text and "accelerate-cpu_offload" in text
    for path in paths:
        section = suite._run_section(suite.load_results([path])[0], path)
        with open(path) as f:
            note = json.load(f).get("note")
        assert note is None or note in section


def test_bar_lines_compare_auto_with_the_peers(doc):
    def row(method, phase, ms, ratio=None, budget=500):
        return {**doc["results"][0], "method": method, "phase": phase, "mode": "eager", "median_ms": ms,
                "ratio": ratio, "link_bound_ms": 100.0, "error": None, "skipped": None,
                "budget_bytes": budget}

    rows = [row("ws-auto", "decode-b1", 100.0, 1.04),
            row("accelerate-cpu_offload", "decode-b1", 900.0, None, None),  # takes no budget: counts at any
            row("accelerate-device_map", "decode-b1", 450.0), row("ws-auto", "prefill-8", 100.0),
            row("ws-uva", "prefill-8", 150.0),
            # at a larger budget: never compared with the rows above, and the missing peer is said
            row("ws-auto", "decode-b1", 50.0, 1.10, 1000),
            row("accelerate-device_map", "decode-b1", 60.0, None, 1000),
            row("ws-auto", "prefill-8", 40.0, None, 1000),
            row("accelerate-device_map", "decode-b64", 60.0)]  # a phase without ws-auto is said
    fake = {**doc, "results": rows, "weight_bytes": 2000}
    lines = suite.bar_lines([fake])
    assert any("decode-b1 at 500 B (25%)" in x and "4.5x" in x and "NOT met" in x and "device_map" in x
               for x in lines)
    assert any("at 500 B (25%)" in x and "1.040x the link bound" in x and "(met" in x for x in lines)
    assert any("prefill-8 at 500 B (25%)" in x and "1.5x" in x and "NOT met: >= 2x" in x for x in lines)
    assert any("decode-b1 at 1000 B (50%)" in x and "1.2x" in x for x in lines)
    assert any("at 1000 B (50%)" in x and "1.100x the link bound" in x and "NOT met" in x for x in lines)
    assert any("prefill-8 at 1000 B (50%)" in x and "ws-uva not measured at this budget" in x for x in lines)
    assert "- tiny decode-b64: cannot be checked: ws-auto not measured" in lines
    assert len(lines) == 7


def test_max_seconds_records_what_was_not_run_and_ends_cleanly(tmp_path):
    path = str(tmp_path / "cut.json")
    doc = suite.run_suite("tiny", [0.5], ["decode-b1", "prefill-8"], ["resident", "ws-stream"], ["eager"], 1,
                          "cpu", path, command="test", max_seconds=1e-9)
    assert suite.validate(doc) is doc and doc["max_seconds"] == 1e-9 and not doc.get("aborted")
    assert len(doc["results"]) == 4  # every method x phase x mode has a row, none measured
    assert all(r["skipped"].startswith("not run: the run's --max-seconds") for r in doc["results"])
    with pytest.raises(ValueError, match="max_seconds"):
        suite.run_suite("tiny", [0.5], ["decode-b1"], ["resident"], ["eager"], 1, "cpu", path, max_seconds=0)


def test_a_moe_shape_runs_through_the_harness_exactly(tmp_path):
    doc = suite.run_suite("tiny-moe", [0.5], ["decode-b1"], ["resident", "ws-stream"], ["eager"], 1, "cpu",
                          str(tmp_path / "moe.json"), command="test")
    (row,) = [r for r in doc["results"] if r["method"] == "ws-stream"]
    assert row["exact"] is True and row["reference"] == "resident eager" and row["setup"]["link_bytes"] > 0


def test_method_seconds_stops_a_slow_method_and_the_run_goes_on(tmp_path, monkeypatch):
    """A method that overruns --method-seconds, in its preparation or in a mode, is recorded with that
    error, undone, and the next method still runs and is exact; its modes not started are skipped."""
    def slow_prepare(model, budget, tokens, device):
        time.sleep(30)

    def slow_forward(model, budget, tokens, device):
        hook = model.register_forward_pre_hook(lambda *args: time.sleep(30))
        return {"link_bytes": 0}, hook.remove

    extra = [suite.Method("slow-prepare", slow_prepare, suite.MODES, "sleeps preparing", uses_budget=False),
             suite.Method("slow-forward", slow_forward, suite.MODES, "sleeps in forward", uses_budget=False)]
    monkeypatch.setattr(suite, "METHODS", [*suite.METHODS[:1], *extra, *suite.METHODS[1:]])

    def run(methods, modes):
        return suite.run_suite("tiny", [0.5], ["decode-b1"], methods, modes, 1, "cpu",
                               str(tmp_path / "s.json"), command="test", method_seconds=2)

    start = time.monotonic()
    doc = run(["resident", "slow-prepare", "slow-forward", "ws-stream"], ["eager"])
    assert suite.validate(doc) is doc and doc["method_seconds"] == 2 and not doc.get("aborted")
    rows = {r["method"]: r for r in doc["results"]}
    over = "did not finish within the method's --method-seconds (2 s)"
    assert rows["slow-prepare"]["error"] == f"prepare: TimeLimitExceeded: {over}"
    assert rows["slow-forward"]["error"] == f"TimeLimitExceeded: {over}"
    assert rows["ws-stream"]["exact"] is True  # undone cleanly, the run went on
    doc = run(["slow-forward"], ["eager", "compiled"])
    assert [r["skipped"] for r in doc["results"]] == [None, f"not run: {over}"]
    assert time.monotonic() - start < 25  # no sleep ran to its end
    with pytest.raises(ValueError, match="method_seconds"):
        suite.run_suite("tiny", [0.5], ["decode-b1"], ["resident"], ["eager"], 1, "cpu",
                        str(tmp_path / "x.json"), method_seconds=0)
