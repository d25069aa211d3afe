"""The bench runner on the CPU: a real tiny run, exactness, time limits, a MoE shape, budgets.

Timings are never asserted (the CPU runs the synchronous backend); exactness and the schema are.
"""

from __future__ import annotations

import time

import pytest
from conftest import BENCH_PHASES as PHASES
from conftest import BENCH_WS as WS

from weightstream.bench import methods, runner
from weightstream.bench.methods import Method
from weightstream.bench.schema import MODES, validate


def test_tiny_run_is_valid_and_every_weightstream_method_is_exact(bench_doc):
    doc = bench_doc
    assert validate(doc) is doc
    assert doc["command"] == "test" and doc["h2d_bandwidth_GBps"] is None and doc["reference"] == "resident"
    for name, reason in methods.unavailable().items():
        if name in ("accelerate-cpu_offload", "diffusers-group"):  # the optional methods asked for
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


def test_weightstream_rows_record_the_placement_and_the_planners_prediction(bench_doc):
    ws_rows = [r for r in bench_doc["results"] if r["method"] in WS]
    for r in ws_rows:
        strategy = r["method"].removeprefix("ws-")
        assert r["setup"]["placement"].split(":")[0] in {strategy, "stream", "uva", "resident", "mixed"}, r
        pred = r["setup"]["prediction"]
        assert pred is None or (pred["ms"] > 0 and pred["bound"]), r


def test_graph_modes_are_skipped_without_cuda(tmp_path):
    doc = runner.run_suite("tiny", [0.5], ["decode-b1"], ["ws-stream"], ["eager", "graph", "graph-eager"], 1,
                           "cpu", str(tmp_path / "g.json"), command="test")
    rows = {r["mode"]: r for r in doc["results"]}
    # no resident run: ws-stream gives the reference
    assert rows["eager"]["exact"] is None and rows["eager"]["reference"] == "self"
    assert rows["graph"]["skipped"] == rows["graph-eager"]["skipped"] == "CUDA graphs need a CUDA device"


def test_resolve_budget_parses_fractions_and_sizes():
    assert runner.resolve_budget("0.25", 1000) == 250 and runner.resolve_budget(0.5, 1000) == 500
    assert runner.resolve_budget("8GiB", 1000) == 8 * 2**30 and runner.resolve_budget(4096, 1000) == 4096
    with pytest.raises(ValueError, match="fraction"):
        runner.resolve_budget(1.5, 1000)


def test_max_seconds_records_what_was_not_run_and_ends_cleanly(tmp_path):
    path = str(tmp_path / "cut.json")
    doc = runner.run_suite("tiny", [0.5], ["decode-b1", "prefill-8"], ["resident", "ws-stream"], ["eager"], 1,
                           "cpu", path, command="test", max_seconds=1e-9)
    assert validate(doc) is doc and doc["max_seconds"] == 1e-9 and not doc.get("aborted")
    assert len(doc["results"]) == 4  # every method x phase x mode has a row, none measured
    assert all(r["skipped"].startswith("not run: the run's --max-seconds") for r in doc["results"])
    with pytest.raises(ValueError, match="max_seconds"):
        runner.run_suite("tiny", [0.5], ["decode-b1"], ["resident"], ["eager"], 1, "cpu", path, max_seconds=0)


def test_a_moe_shape_runs_through_the_harness_exactly(tmp_path):
    doc = runner.run_suite("tiny-moe", [0.5], ["decode-b1"], ["resident", "ws-stream"], ["eager"], 1, "cpu",
                           str(tmp_path / "moe.json"), command="test")
    (row,) = [r for r in doc["results"] if r["method"] == "ws-stream"]
    assert row["exact"] is True and row["reference"] == "resident eager" and row["setup"]["link_bytes"] > 0


@pytest.mark.slow
def test_method_seconds_stops_a_slow_method_and_the_run_goes_on(tmp_path, monkeypatch):
    """A method that overruns --method-seconds, in its preparation or in a mode, is recorded with that
    error, undone, and the next method still runs and is exact; its modes not started are skipped."""
    def slow_prepare(model, budget, tokens, device):
        time.sleep(30)

    def slow_forward(model, budget, tokens, device):
        hook = model.register_forward_pre_hook(lambda *args: time.sleep(30))
        return {"link_bytes": 0}, hook.remove

    extra = [Method("slow-prepare", slow_prepare, MODES, "sleeps preparing", uses_budget=False),
             Method("slow-forward", slow_forward, MODES, "sleeps in forward", uses_budget=False)]
    monkeypatch.setattr(methods, "METHODS", (*methods.METHODS[:1], *extra, *methods.METHODS[1:]))

    def run(names, modes):
        return runner.run_suite("tiny", [0.5], ["decode-b1"], names, modes, 1, "cpu",
                                str(tmp_path / "s.json"), command="test", method_seconds=2)

    start = time.monotonic()
    doc = run(["resident", "slow-prepare", "slow-forward", "ws-stream"], ["eager"])
    assert validate(doc) is doc and doc["method_seconds"] == 2 and not doc.get("aborted")
    rows = {r["method"]: r for r in doc["results"]}
    over = "did not finish within the method's --method-seconds (2 s)"
    assert rows["slow-prepare"]["error"] == f"prepare: TimeLimitExceeded: {over}"
    assert rows["slow-forward"]["error"] == f"TimeLimitExceeded: {over}"
    assert rows["ws-stream"]["exact"] is True  # undone cleanly, the run went on
    doc = run(["slow-forward"], ["eager", "compiled"])
    assert [r["skipped"] for r in doc["results"]] == [None, f"not run: {over}"]
    assert time.monotonic() - start < 25  # no sleep ran to its end
    with pytest.raises(ValueError, match="method_seconds"):
        runner.run_suite("tiny", [0.5], ["decode-b1"], ["resident"], ["eager"], 1, "cpu",
                         str(tmp_path / "x.json"), method_seconds=0)


@pytest.mark.slow
def test_compressed_weightstream_rows_record_wire_bytes_and_bound_the_link_by_them(tmp_path):
    """ws-auto-compress through the real runner on the CPU: exact, its rows carry wire bytes below the
    raw ones and a link_bytes that counts the wire bytes; raw ws-auto rows carry ratio 1; the report
    shows the wire columns and the comparison bar line."""
    from weightstream.bench import report

    path = str(tmp_path / "wire.json")
    doc = runner.run_suite("tiny-wide", [0.5], ["decode-b1"], ["resident", "ws-auto", "ws-auto-compress"],
                           ["eager"], 1, "cpu", path, command="test")
    assert validate(doc) is doc
    rows = {r["method"]: r for r in doc["results"]}
    raw, coded = rows["ws-auto"], rows["ws-auto-compress"]
    assert raw["exact"] is True and coded["exact"] is True, coded
    assert raw["wire_ratio"] == 1.0 and raw["wire_bytes"] == raw["wire_raw_bytes"]  # raw (may be zero copy)
    assert coded["wire_bytes"] < 0.9 * coded["wire_raw_bytes"]
    assert coded["wire_ratio"] == coded["wire_bytes"] / coded["wire_raw_bytes"]
    stats = coded["setup"]["stats"]
    assert coded["link_bytes"] == stats["streamed_bytes"] + stats["uva_bytes"] - (
        coded["wire_raw_bytes"] - coded["wire_bytes"])
    assert rows["resident"]["wire_bytes"] is None
    table = report.markdown_table([doc])
    assert "| wire bytes | wire ratio |" in table.splitlines()[0]
    assert f"| {coded['wire_ratio']:.3f} |" in table
    doc["h2d_bandwidth_GBps"] = 50.0  # a CPU run has no bound: give it one to check the bar line
    for r in doc["results"]:
        r["link_bound_ms"] = r["link_bytes"] / 50e9 * 1e3 if r["link_bytes"] else None
        r["ratio"] = r["median_ms"] / r["link_bound_ms"] if r["link_bound_ms"] else None
    lines = report.bar_lines([doc])
    assert any("ws-auto-compress" in x and f"wire ratio {coded['wire_ratio']:.3f}" in x
               and "link bound from wire bytes" in x for x in lines), lines
    text = report.write_benchmarks_md([path], str(tmp_path / "b.md"))
    assert report.WIRE_NOTE in text


def test_the_schema_checks_the_wire_fields_and_accepts_rows_without_them(bench_doc):
    import copy

    row = bench_doc["results"][0]
    for key in ("wire_bytes", "wire_raw_bytes", "wire_ratio"):
        row.pop(key, None)  # a file written before compression on the wire
    assert validate(bench_doc)
    for bad, field in (({"wire_bytes": 10, "wire_raw_bytes": 20, "wire_ratio": None}, "wire_ratio"),
                       ({"wire_bytes": 30, "wire_raw_bytes": 20, "wire_ratio": 1.5}, "wire_bytes"),
                       ({"wire_bytes": 10, "wire_raw_bytes": 20, "wire_ratio": 0.7}, "wire_ratio"),
                       ({"wire_bytes": "10", "wire_raw_bytes": 20, "wire_ratio": 0.5}, "wire_bytes")):
        broken = copy.deepcopy(bench_doc)
        broken["results"][0].update(bad)
        with pytest.raises(ValueError, match=rf"results\[0\]\.{field}"):
            validate(broken)


def test_timelines_are_kept_for_the_resident_model_and_each_method_at_the_first_budget(tmp_path, monkeypatch):
    """The resident model's timeline is the baseline of an offloaded one's (its kernels and the gaps
    between them); an offloaded method's is kept at the first budget only. The profiler needs CUDA, so
    its recording is replaced by one fake event per call here; the rest is the real run."""
    from weightstream.bench import timeline

    calls = []

    def fake_record(model, forward):
        calls.append(forward)
        return [("compute", "kernel", 0.0, 1.0)]

    monkeypatch.setattr(timeline, "record_timeline", fake_record)
    doc = runner.run_suite("tiny", [0.5, 0.8], ["decode-b1"], ["resident", "ws-stream"], ["eager"], 1, "cpu",
                           str(tmp_path / "t.json"))
    kept = [(t["method"], t["budget_bytes"]) for t in doc["timelines"]]
    assert kept == [("resident", None), ("ws-stream", doc["budgets"][0])]
    assert len(calls) == 2 and all(t["summary"]["compute_ms"] == 1.0 for t in doc["timelines"])
