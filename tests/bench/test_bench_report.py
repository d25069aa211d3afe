"""The report of stored results: markdown table, run sections, the bars, docs/benchmarks.md."""

from __future__ import annotations

import copy
import glob
import json
import os
import re

from weightstream.bench import report
from weightstream.bench.index import page_links, result_files
from weightstream.bench.schema import load_results, validate, write_json


def test_markdown_table_has_one_row_per_result(bench_doc):
    doc = bench_doc
    table = report.markdown_table([doc])
    lines = table.splitlines()
    assert lines[0].startswith("| shape | phase | budget | method | mode | tokens/s")
    assert len(lines) == 2 + len(doc["results"])
    assert any("| resident | eager |" in line and line.endswith("| ref |") for line in lines)
    assert any("| ws-stream | eager |" in line and line.endswith("| True |") for line in lines)


def test_errors_and_skips_show_in_the_table(bench_doc):
    broken = copy.deepcopy(bench_doc)
    broken["results"][0].update(median_ms=None, tokens_per_s=None, error="Unsupported: compiler.disable")
    broken["results"][1].update(median_ms=None, tokens_per_s=None, skipped="CUDA graphs need a CUDA device")
    table = report.markdown_table([validate(broken)])
    assert "error: Unsupported: compiler.disable" in table and "skipped: CUDA graphs" in table


def test_benchmarks_md_from_stored_results(bench_stored, tmp_path):
    md = tmp_path / "docs" / "benchmarks.md"
    png = str(tmp_path / "docs" / "bench_tiny.png")
    text = report.write_benchmarks_md([bench_stored], str(md), images=[png])
    assert md.read_text() == text
    assert text.startswith("# Benchmarks") and "link bound" in text and "command: `test`" in text
    assert "![bench_tiny.png](bench_tiny.png)" in text and "| tiny | decode-b1 |" in text


def test_recorded_h200_results_are_valid_and_render():
    """The committed result files pass the schema and go into the page (notes included)."""
    results = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results")
    paths = sorted(glob.glob(os.path.join(results, "*", "suite_*.json")))
    assert paths, "no recorded suite results"
    text = report.markdown_table(load_results(paths))
    assert "ws-auto" in text and "accelerate-cpu_offload" in text
    for path in paths:
        section = report.run_section(load_results([path])[0], path)
        with open(path) as f:
            note = json.load(f).get("note")
        assert note is None or note in section


def test_the_committed_page_is_what_the_recorded_results_give(tmp_path):
    """docs/benchmarks.md is exactly what `--report benchmarks/results --index ...` writes from the result
    documents there (run from the repository root, as benchmarks/README.md says; the images as the page
    links them)."""
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    with open(os.path.join(root, "docs", "benchmarks.md")) as f:
        committed = f.read()
    linked = re.findall(r"!\[[^]]*\]\(([^)]+)\)", committed)
    images = [os.path.join(str(tmp_path), "docs", name) for name in linked]
    assert len(images) >= 3
    cwd = os.getcwd()
    try:
        os.chdir(root)
        paths = result_files(["benchmarks/results"])
        md = str(tmp_path / "docs" / "benchmarks.md")
        links = page_links(paths, md, str(tmp_path / "benchmarks" / "results" / "INDEX.md"))
        text = report.write_benchmarks_md(paths, md, images, *links)
    finally:
        os.chdir(cwd)
    assert text == committed


def test_bar_lines_compare_auto_with_the_peers(bench_doc):
    doc = bench_doc

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
    lines = report.bar_lines([fake])
    assert any("decode-b1 at 500 B (25%)" in x and "4.5x" in x and "NOT met" in x and "device_map" in x
               for x in lines)
    assert any("at 500 B (25%)" in x and "1.040x the link bound" in x and "(met" in x for x in lines)
    assert any("prefill-8 at 500 B (25%)" in x and "1.5x" in x and "NOT met: >= 2x" in x for x in lines)
    assert any("decode-b1 at 1000 B (50%)" in x and "1.2x" in x for x in lines)
    assert any("at 1000 B (50%)" in x and "1.100x the link bound" in x and "NOT met" in x for x in lines)
    assert any("prefill-8 at 1000 B (50%)" in x and "ws-uva not measured at this budget" in x for x in lines)
    assert "- tiny decode-b64: cannot be checked: ws-auto not measured" in lines
    assert len(lines) == 7


def test_prediction_table_lists_the_measured_weightstream_rows(bench_doc):
    rows = bench_doc["results"]
    measured = [r for r in rows if r["median_ms"] is not None and r["setup"].get("prediction")]
    lines = report.prediction_table([bench_doc]).splitlines()
    assert lines[0].startswith("| budget | phase | method | mode | placement | measured ms | predicted ms")
    assert len(lines) == 2 + len(measured)


def test_describe_says_the_outcome_of_a_row():
    from weightstream.bench.schema import ResultRow

    row = ResultRow("ws-auto", "decode-b1", 2**30, "eager", median_ms=2.0, min_ms=1.0, max_ms=3.0, reps=5,
                    tokens_per_s=500.0, ratio=1.04, exact=True, reference="resident eager")
    assert report.describe(row) == ("ws-auto decode-b1 budget 1.00 GiB eager: 2.00 ms [1.00..3.00] x5, "
                                    "500.0 tok/s, ratio 1.04, exact True (resident eager)")
    assert report.describe(ResultRow("x", "decode-b1", None, "graph", skipped="no")).endswith(": skipped: no")


def test_the_graph_eager_mode_is_explained_only_where_it_appears(bench_doc, tmp_path):
    path = str(tmp_path / "doc.json")
    write_json(bench_doc, path)
    assert report.GRAPH_EAGER_NOTE not in report.write_benchmarks_md([path], str(tmp_path / "a.md"))
    bench_doc["results"][0]["mode"] = "graph-eager"
    write_json(bench_doc, path)
    assert report.GRAPH_EAGER_NOTE in report.write_benchmarks_md([path], str(tmp_path / "b.md"))


def test_compressed_rows_are_compared_with_raw_streaming_in_their_own_mode(bench_doc):
    doc = bench_doc

    def row(method, mode, ms, wire_ratio, budget=500):
        return {**doc["results"][0], "method": method, "phase": "decode-b1", "mode": mode, "median_ms": ms,
                "ratio": None, "link_bound_ms": None, "error": None, "skipped": None, "budget_bytes": budget,
                "wire_ratio": wire_ratio}

    rows = [row("ws-auto", "compiled", 80.0, 0.7), row("ws-auto-compress", "eager", 120.0, 0.7),
            row("ws-auto-raw", "eager", 100.0, 1.0), row("ws-auto-compress", "graph", 90.0, 0.7),
            row("ws-auto-compress", "compiled", 80.0, 0.7)]
    lines = [x for x in report.bar_lines([{**doc, "results": rows, "weight_bytes": 2000}])
             if "ws-auto-compress" in x]
    assert len(lines) == 3, lines
    eager, compiled, graph = (next(x for x in lines if f"(ws-auto-compress {m})" in x)
                              for m in ("eager", "compiled", "graph"))
    assert "vs ws-auto-raw 100.0 ms, wire ratio 1.000: **0.83x**" in eager  # never the compiled ws-auto
    assert "vs ws-auto 80.0 ms, wire ratio 0.700: **1.00x**" in compiled  # ws-auto compressed as well
    assert "no ws-auto-raw or ws-auto run in graph mode" in graph
