"""`weightstream bench --kind pipeline --methods ws-load[-cpu<size>]`: the tiny Flux pipeline saved, loaded
straight into place by `from_pretrained` (with and without a cpu_memory that keeps groups on disk),
generates the resident pipeline's image; the row records the load's host memory peak."""

from __future__ import annotations

import pytest

from weightstream.bench.pipeline_run import HostPeak, check_pipeline
from weightstream.bench.schema import load_results
from weightstream.cli import main as weightstream_main


def test_a_pipeline_loaded_from_its_folder_is_exact_and_its_host_peak_is_recorded(tmp_path):
    pytest.importorskip("diffusers")
    out = tmp_path / "p.json"
    argv = ["bench", "--device", "cpu", "--kind", "pipeline", "--shape", "tiny-flux-pipeline", "--budgets",
            "0.6", "--methods", "ws-load,resident,ws-load-cpu60KB", "--out", str(out)]
    assert weightstream_main(argv) == 0
    (doc,) = load_results([str(out)])
    rows = {r["method"]: r for r in doc["results"]}
    assert [r["method"] for r in doc["results"]] == ["resident", "ws-load", "ws-load-cpu60KB"]  # loads last
    for name in ("ws-load", "ws-load-cpu60KB"):
        row, setup = rows[name], rows[name]["setup"]
        assert row["exact"] is True and setup["exact_warmup"] is True, name
        assert setup["load_s"] > 0 and setup["host_peak_bytes"] >= setup["host_before_bytes"] > 0
        assert setup["host_peak_growth_bytes"] == setup["host_peak_bytes"] - setup["host_before_bytes"]
        assert setup["components"]["transformer"]["streamed_blocks"]
    assert rows["ws-load"]["setup"]["cpu_memory_bytes"] is None and "save_s" in rows["ws-load"]["setup"]
    assert not any(c["disk_bytes"] for c in rows["ws-load"]["setup"]["components"].values())
    limited = rows["ws-load-cpu60KB"]["setup"]
    assert limited["cpu_memory_bytes"] == 60_000
    assert any(c["disk_bytes"] for c in limited["components"].values())  # groups left on disk


def test_a_load_method_needs_a_size_it_can_read():
    check_pipeline("tiny-flux-pipeline", ["generate-2"], ["ws-load", "ws-load-cpu16GiB"])
    with pytest.raises(ValueError, match="ws-load-cpu<size>"):
        check_pipeline("tiny-flux-pipeline", ["generate-2"], ["ws-load-cpulots"])


def test_the_host_peak_sees_memory_held_inside_it():
    import torch

    with HostPeak() as peak:
        held = torch.ones(64 << 20, dtype=torch.uint8)
    del held
    assert peak.growth >= 64 << 20
