"""Result files of the scripts the bench package replaced (bench_core, bench_plan, bench_load) read as
documents of the one schema, with their numbers unchanged."""

from __future__ import annotations

import json
import os

import pytest

from weightstream.bench import legacy, schema
from weightstream.bench.report import markdown_table, prediction_table

RESULTS = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results")


def _read(name: str) -> tuple[dict, dict]:
    with open(os.path.join(RESULTS, name)) as f:
        old = json.load(f)
    return old, schema.validate(legacy.upgrade(json.loads(json.dumps(old))))


def test_a_current_document_is_left_as_it_is(bench_doc):
    assert legacy.upgrade(bench_doc) is bench_doc


def test_core_results_keep_every_timed_entry():
    old, doc = _read("core_llama-3-8b_stream.json")
    assert doc["converted_from"] == "bench_core.py" and doc["weight_bytes"] == old["weight_bytes"]
    rows = {(r["method"], r["phase"], r["mode"]): r for r in doc["results"]}
    for method, new in (("resident", "resident"), ("stream", "ws-stream")):
        for phase, name in (("decode", "decode-b1"), ("prefill", "prefill-2048")):
            for mode, entry in old["results"][method][phase].items():
                if not isinstance(entry, dict):
                    continue
                row = rows[(new, name, mode)]
                if "median_ms" in entry:
                    assert row["median_ms"] == entry["median_ms"] and row["reps"] == entry["reps"]
                    assert row["exact"] == entry.get("exact")
                    assert row["setup"]["repeatable"] == entry["repeatable"]
                else:
                    assert row["skipped"] == entry["skipped"]
    stream = rows[("ws-stream", "decode-b1", "eager")]
    assert stream["budget_bytes"] == old["results"]["stream"]["setup"]["budget_bytes"]
    assert stream["ratio"] == pytest.approx(stream["median_ms"] / stream["link_bound_ms"])
    assert rows[("resident", "decode-b1", "eager")]["reference"] == "self"


def test_core_accelerate_and_uva_rows_are_named_as_the_bench_names_them():
    _, doc = _read("core_llama-3-8b_uva_accelerate.json")
    methods = {r["method"] for r in doc["results"]}
    assert methods == {"resident", "uva-vllm-style", "accelerate-cpu_offload"}
    table = markdown_table([doc])
    assert "| llama-3-8b | decode-b1 | - | accelerate-cpu_offload | eager |" in table


def test_plan_points_become_rows_with_the_prediction():
    old, doc = _read("plan_llama-3-8b.json")
    assert len(doc["results"]) == len(old["points"])
    for p, r in zip(old["points"], doc["results"], strict=True):
        assert r["method"] == f"ws-{p['strategy']}" and r["budget_bytes"] == p["budget_bytes"]
        assert r["median_ms"] == p["median_ms"] and r["setup"]["prediction"]["ms"] == p["predicted_ms"]
        assert r["mode"] == ("graph-eager" if p["phase"] == "decode" else "eager")
    table = prediction_table([doc]).splitlines()
    assert len(table) == 2 + len(old["points"])
    first = old["points"][0]
    assert any(f"| {first['median_ms']:.2f} | {first['predicted_ms']:.2f} | " in line for line in table)


def test_load_tiers_become_decode_rows():
    old, doc = _read("load_llama-3-8b.json")
    host, disk = doc["results"]
    assert host["method"] == "ws-from_pretrained"
    assert host["median_ms"] == old["host_tier"]["decode_ms_median"]
    assert host["link_bound_ms"] == pytest.approx(old["host_tier"]["link_bound_ms"])
    assert host["setup"]["load_s"] == old["host_tier"]["load_s"] and host["exact"] is True
    assert disk["setup"]["disk_to_gpu_GBps_steady"] == old["disk_tier"]["disk_to_gpu_GBps_steady"]
    assert host["budget_bytes"] == 4 * 2**30
