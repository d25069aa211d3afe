"""The command line, run in-process on the CPU."""

import pytest

from weightstream.cli import main


def test_demo_runs_on_the_cpu_and_reports_identical_tokens(capsys):
    assert main(["demo", "--device", "cpu", "--new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "synchronous backend" in out
    assert "tokens identical to the fully resident run: yes" in out
    assert "streamed" in out


def test_demo_rejects_a_bad_fraction():
    with pytest.raises(SystemExit):
        main(["demo", "--fraction", "1.5"])


def test_plan_prints_a_table_and_json_that_respects_the_budget(capsys):
    import json

    assert main(["plan", "llama-3-8b", "--gpu-memory", "8GiB"]) == 0
    table = capsys.readouterr().out
    assert "streamed" in table and "predicted decode" in table and "-bound" in table
    assert main(["plan", "llama-3-8b", "--gpu-memory", "8GiB", "--tokens", "2048", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["gpu_bytes"] <= 8 * 2**30 and report["blocks"] == 32
    placed = report["resident"]["blocks"] + report["streamed"]["blocks"] + report["zero_copy"]["blocks"]
    assert sorted(placed) == list(range(32))
    assert report["predicted"]["prefill_2048"]["ms"] >= report["predicted"]["decode"]["ms"]
    # bytes on the GPU and over the link add up to the weights, a block streaming only part of itself too
    assert report["resident"]["bytes"] + report["streamed"]["bytes"] + report["zero_copy"]["bytes"] == (
        report["weight_bytes"])
    part = report["streamed"]["largest_tensors_per_block"]
    assert part is None or (part >= 1 and "largest tensors" in table)


def test_plan_reports_a_budget_too_small_and_an_unknown_model(capsys):
    assert main(["plan", "llama-3-8b", "--gpu-memory", "1GiB"]) == 1
    assert "at least" in capsys.readouterr().err
    assert main(["plan", "no-such-model", "--gpu-memory", "1GiB"]) == 1
    assert "built-in shape" in capsys.readouterr().err


def test_probe_without_a_gpu_says_so(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["probe"]) == 1
    assert "no CUDA GPU" in capsys.readouterr().out


def test_plan_reads_a_local_config_folder(tmp_path, capsys):
    import json

    from conftest import hf_config

    hf_config("qwen2").save_pretrained(tmp_path)
    assert main(["plan", str(tmp_path), "--gpu-memory", "100KB", "--json", "--strategy", "stream"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["blocks"] == 4 and report["strategy"] == "stream" and report["gpu_bytes"] <= 100_000
