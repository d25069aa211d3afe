"""The kinds of `weightstream bench` run for real on tiny shapes on the CPU, through the command line, and
each writes the one schema with its outputs exact against the resident model: quantized (fp8) and
encoder-decoder shapes and the `generate-N` phase in the suite, `--kind load` (host and disk tiers),
`--kind codec` (the torch decoder, lossless), `--profile`, `--bound`, `--waits`; every mistake in the
new options ends in one line and exit status 2 before anything is built."""

from __future__ import annotations

import json

import pytest
import torch

from weightstream.bench import cli, run_suite, validate
from weightstream.bench.analysis import bound_rows, bound_table
from weightstream.bench.memory import module_bytes
from weightstream.bench.schema import load_results, write_json
from weightstream.bench.shapes import build_model, shape_weight_bytes
from weightstream.cli import main as weightstream_main


def run_cli(argv: list[str], tmp_path, name: str = "r.json") -> dict:
    out = tmp_path / name
    assert weightstream_main(["bench", "--device", "cpu", *argv, "--out", str(out)]) == 0
    (doc,) = load_results([str(out)])
    return doc


def rows_of(doc: dict) -> dict:
    return {(r["method"], r["phase"], r["mode"]): r for r in doc["results"]}


def test_fp8_weights_stream_as_stored_and_match_the_resident_model(tmp_path):
    """A quantized shape's weight bytes (budgets, link bytes) are its stored bytes, and its offloaded
    forward is exact (formerly benchmarks/bench_quant.py)."""
    fp8 = build_model("tiny-fp8", torch.device("cpu"))
    assert shape_weight_bytes("tiny-fp8") == module_bytes(fp8) < shape_weight_bytes("tiny")
    assert any(p.dtype == torch.float8_e4m3fn for p in fp8.parameters())
    doc = run_cli(["--shape", "tiny-fp8", "--budgets", "0.5", "--phases", "decode-b1", "--modes", "eager",
                   "--methods", "resident,ws-stream", "--reps", "2"], tmp_path)
    assert doc["kind"] == "suite" and "float8" in doc["shape"]["dtype"]
    row = rows_of(doc)[("ws-stream", "decode-b1", "eager")]
    assert row["exact"] is True and row["reference"] == "resident eager"
    assert 0 < row["link_bytes"] < doc["weight_bytes"]
    assert row["setup"]["engine_per_call"]["misses"] == 0


@pytest.mark.slow
def test_encoder_decoder_steps_and_generations_are_exact(tmp_path):
    """T5's decoder step on fixed encoder states, and a greedy generation with a KV cache, offloaded and
    resident give the same logits and tokens (formerly benchmarks/bench_encdec.py); a step's link bytes
    are the decoder's groups only; a generation is timed eager only."""
    doc = run_cli(["--shape", "tiny-t5-encdec", "--budgets", "0.5", "--phases", "decode-b1,generate-3",
                   "--modes", "eager,graph", "--methods", "resident,ws-stream", "--reps", "2"], tmp_path)
    rows = rows_of(doc)
    step = rows[("ws-stream", "decode-b1", "eager")]
    assert step["exact"] is True
    assert 0 < step["link_bytes"] < step["setup"]["all_groups_link_bytes"]  # the encoder's stay put
    assert step["setup"]["engine_per_call"]["misses"] == 0  # every timed step in run order
    gen = rows[("ws-stream", "generate-3", "eager")]
    assert gen["exact"] is True and gen["tokens"] == 3 and gen["link_bytes"] is None
    assert "eager only" in rows[("ws-stream", "generate-3", "graph")]["skipped"]


def test_a_causal_lm_generation_is_exact_and_planned_for_one_token(tmp_path, monkeypatch):
    """`generate-N` on a causal LM: the offloaded model's tokens equal the resident model's, and the
    method is planned for one new token per step (not N)."""
    from weightstream.bench.methods import weightstream as ws_methods

    planned = []
    offload = ws_methods.offload
    monkeypatch.setattr(ws_methods, "offload",
                        lambda *a, **k: planned.append(k["tokens"]) or offload(*a, **k))
    doc = run_suite("tiny", [0.5], ["generate-4"], ["resident", "ws-stream"], ["eager"], 2, "cpu",
                    str(tmp_path / "g.json"), command="test", timeline=False)
    assert validate(doc) is doc and planned == [1]
    row = rows_of(doc)[("ws-stream", "generate-4", "eager")]
    assert row["exact"] is True and row["tokens_per_s"] == pytest.approx(4 / (row["median_ms"] / 1e3))


def test_pipeline_kind_generates_exactly_with_and_without_compression(tmp_path):
    """`--kind pipeline` (formerly benchmarks/bench_pipeline.py): the whole tiny Flux pipeline offloaded
    under 60% of its bytes gives latents and an image torch.equal to the resident pipeline's, streamed
    raw and compressed (what shrinks crosses the link smaller); diffusers' offloading needs CUDA."""
    pytest.importorskip("diffusers")
    doc = run_cli(["--kind", "pipeline", "--shape", "tiny-flux-pipeline", "--budgets", "0.6",
                   "--methods", "resident,ws-stream-raw,ws-stream-compress,diffusers-group"], tmp_path)
    assert doc["kind"] == "pipeline" and doc["phases"] == ["generate-2"]
    rows = {r["method"]: r for r in doc["results"]}
    assert rows["resident"]["reference"] == "self" and "CUDA" in rows["diffusers-group"]["skipped"]
    for method, compress in (("ws-stream-raw", False), ("ws-stream-compress", True)):
        row, setup = rows[method], rows[method]["setup"]
        assert row["exact"] is True and setup["exact_warmup"] is True and setup["timing"] == "measured"
        assert setup["steps_timed"] == 2 and row["tokens"] == 2 * (4 * 4 + 16)  # 16 image + 16 text tokens
        assert setup["compress"] is compress
        components = setup["components"]
        assert components["transformer"]["streamed_blocks"]  # the budget really made it stream
        for c in components.values():
            assert c["compressed"] == (c["wire_bytes"] < c["wire_raw_bytes"]) and c["compressed"] <= compress
        assert compress is False or any(c["compressed"] for c in components.values())


def test_predict_prints_the_planned_split_at_every_budget(tmp_path, capsys):
    """`--kind pipeline --predict` (formerly benchmarks/plan_flux_pipeline.py): raw, compressed and auto
    at each budget, and the transformer alone; a budget below every component's minimum does not fit."""
    pytest.importorskip("diffusers")
    out = tmp_path / "plan.md"
    assert cli.main(["--kind", "pipeline", "--shape", "tiny-flux-pipeline", "--predict", "--budgets",
                     "100KiB,1KiB", "--decode-gbps", "990", "--out", str(out)]) == 0
    text = out.read_text()
    split, alone = text.split("The transformer alone")
    rows = [line for line in split.splitlines() if line.startswith("| 1")]
    assert len(rows) == 6  # two budgets x (False, True, auto)
    assert all("does not fit" in r for r in rows if r.startswith("| 1KiB"))
    assert all("ms/call" in r and "does not fit" not in r for r in rows if r.startswith("| 100KiB"))
    steps = [line for line in alone.splitlines() if line.startswith("| 1")]
    assert len(steps) == 2 and "ms/call" in steps[0] and "does not fit" in steps[1]
    assert "decode 990 GB/s" in capsys.readouterr().out


def test_load_kind_reads_the_host_and_the_disk_tier_exactly(tmp_path):
    """`--kind load` (formerly benchmarks/bench_load.py): a tiny checkpoint saved, loaded into place
    (host tier) and read from its files every forward (disk tier), both exact; the folder is removed."""
    folder = tmp_path / "ckpt"
    doc = run_cli(["--kind", "load", "--shape", "tiny", "--budgets", "200KB", "--reps", "1",
                   "--no-drop-page-cache", "--checkpoint-dir", str(folder)], tmp_path)
    host, disk = doc["results"]
    assert doc["kind"] == "load"
    assert (host["method"], disk["method"]) == ("ws-from_pretrained", "ws-from_pretrained-disk")
    assert host["exact"] is True and disk["exact"] is True
    assert host["setup"]["stats"]["disk_bytes"] == 0 < disk["setup"]["stats"]["disk_bytes"]
    assert disk["setup"]["disk_to_gpu_GBps_steady"] > 0 and not folder.exists()


def test_codec_kind_decodes_losslessly_and_skips_the_gpu_decoder_on_a_cpu(tmp_path):
    """`--kind codec` (formerly benchmarks/bench_decoder.py): the torch decoder gives back the weights'
    bytes for bf16 and fp16, bf16 of HF-initialized weights shrinks to about 0.71, and the Triton
    decoder's rows say why they were not run."""
    doc = run_cli(["--kind", "codec", "--group-size", "64KiB", "--warps", "2,4", "--reps", "2"], tmp_path)
    assert doc["kind"] == "codec" and doc["phases"] == ["bf16-64KiB", "fp16-64KiB"]
    rows = rows_of(doc)
    for phase in doc["phases"]:
        torch_row = rows[("torch-decoder", phase, "eager")]
        assert torch_row["exact"] is True and torch_row["wire_ratio"] < 1
        assert torch_row["setup"]["decoded_GBps"] > 0
        for warps in (2, 4):
            assert "CUDA" in rows[(f"triton-decoder-w{warps}", phase, "eager")]["skipped"]
            assert "CUDA" in rows[(f"triton-decoder-in-place-w{warps}", phase, "eager")]["skipped"]
    assert 0.69 < rows[("torch-decoder", "bf16-64KiB", "eager")]["wire_ratio"] < 0.73


@pytest.mark.gpu
def test_the_gpu_decoder_reading_the_blob_in_place_from_host_memory_is_lossless(tmp_path):
    """`triton-decoder-in-place-wN`: the decoder reads the compressed blob through a zero-copy view of
    pinned host memory (the compressed bytes cross the link inside the kernel) and gives back the
    weights' bytes, as it does from device memory."""
    doc = run_cli(["--kind", "codec", "--device", "cuda", "--group-size", "8MiB", "--warps", "2",
                   "--reps", "2"], tmp_path)
    rows = rows_of(doc)
    for phase in doc["phases"]:
        for method in ("triton-decoder-w2", "triton-decoder-in-place-w2"):
            assert rows[(method, phase, "eager")]["exact"] is True, rows[(method, phase, "eager")]
        assert rows[("triton-decoder-in-place-w2", phase, "eager")]["setup"]["wire_GBps"] > 0


def test_profile_writes_a_trace_and_host_figures_per_measured_row(tmp_path):
    """`--profile DIR` (formerly benchmarks/diag_eager_host.py): each measured row gets its host enqueue
    ms, the top ops and a Chrome trace in DIR; rows stay exact."""
    traces = tmp_path / "traces"
    doc = run_cli(["--shape", "tiny", "--budgets", "0.5", "--phases", "decode-b1", "--modes", "eager",
                   "--methods", "resident,ws-stream", "--reps", "2", "--profile", str(traces)], tmp_path)
    for row in doc["results"]:
        profile = row["setup"]["profile"]
        assert profile["host_enqueue_ms"] > 0 and profile["top_ops"], profile
        with open(profile["trace"]) as f:
            assert json.load(f)["traceEvents"]
    assert len(list(traces.iterdir())) == 2


def test_the_bound_is_the_larger_of_resident_compute_and_link_transfer(tmp_path, capsys):
    """`--bound` (formerly benchmarks/diffusion_bound.py) on stored rows."""

    def row(method, ms, link=None, budget=None):
        return dict(method=method, phase="denoise-b1", mode="eager", median_ms=ms, link_bound_ms=link,
                    budget_bytes=budget, exact=True, min_ms=ms, max_ms=ms, reps=1, tokens_per_s=1.0,
                    ratio=None, error=None, skipped=None)

    doc = {"command": "t", "date": "d", "gpu": "g", "torch": "t", "shape": {"name": "s"}, "weight_bytes": 1,
           "h2d_bandwidth_GBps": 54.0,
           "results": [row("resident", 200.0), row("ws-auto", 260.0, 250.0, 2**30),
                       row("peer", 300.0, 100.0)]}
    got = {r["method"]: r for r in bound_rows(doc)}
    assert got["ws-auto"]["bound_ms"] == 250.0 and got["ws-auto"]["ratio"] == 260.0 / 250.0
    assert got["peer"]["bound_ms"] == 200.0 and got["peer"]["ratio"] == 1.5  # compute bound
    assert "54.0 GB/s" in bound_table([doc])
    write_json(doc, str(tmp_path / "d.json"))
    assert cli.main(["--bound", str(tmp_path / "d.json")]) == 0
    assert "| s | denoise-b1 | 1.00 GiB | ws-auto | eager | 260.0 | 200.0 | 250.0 | 250.0 | 1.040 |" in \
        capsys.readouterr().out


def test_waits_reads_the_stored_timelines(tmp_path, capsys):
    """`--waits` (formerly benchmarks/timeline_waits.py): the first group's wait and the compute row's
    idle time split by what ran meanwhile, from the stored events."""
    doc = run_suite("tiny", [0.5], ["decode-b1"], ["resident"], ["eager"], 1, "cpu", str(tmp_path / "w.json"),
                    command="test", timeline=False)
    events = [["copy", "Memcpy HtoD", 0.0, 1.0], ["compute", "gemm", 0.0, 0.5], ["compute", "gemm", 1.2, 2.0],
              ["copy", "Memcpy HtoD", 1.5, 2.5], ["compute", "add", 2.01, 3.0]]
    doc["timelines"] = [{"method": "ws-stream", "phase": "decode-b1", "mode": "eager", "budget_bytes": 1024,
                         "events": events}]
    write_json(doc, str(tmp_path / "w.json"))
    assert cli.main(["--waits", str(tmp_path / "w.json")]) == 0
    out = capsys.readouterr().out
    assert "ws-stream decode-b1 eager budget 0.00 GiB" in out
    # compute idle from 0.5 to 1.2 ms, the first copy running until 1.0: 0.5 ms of it copying, and 0.7 ms
    # from the end of compute to its start after the first group
    assert "first_group_wait_ms 0.7" in out and "compute_idle_copying_ms 0.5" in out
    assert "gaps between kernels under 50 us, during a copy: 10.0 us median of 1" in out


MISTAKES = {  # name: (argv, what the one line must say); each refused before a model is built
    "--warps with the suite": (["--warps", "2"], "--warps does not apply to --kind suite"),
    "--profile with load": (["--kind", "load", "--profile", "/tmp/p"], "--profile does not apply to --kind"),
    "--methods with codec": (["--kind", "codec", "--methods", "resident"], "--methods does not apply"),
    "--modes with pipeline": (["--kind", "pipeline", "--shape", "tiny-flux-pipeline", "--modes", "eager"],
                              "--modes does not apply to --kind pipeline"),
    "a pipeline shape in the suite": (["--shape", "tiny-flux-pipeline"], "run it with --kind pipeline"),
    "an LM shape as a pipeline": (["--kind", "pipeline", "--shape", "tiny"], "runs a pipeline shape"),
    "a pipeline phase": (["--kind", "pipeline", "--shape", "tiny-flux-pipeline", "--phases", "decode-b1"],
                         "generate-N"),
    "a pipeline method": (["--kind", "pipeline", "--shape", "tiny-flux-pipeline", "--methods", "accelerate"],
                          "--kind pipeline runs resident"),
    "int4 on a CPU": (["--shape", "tiny-int4"], "needs a CUDA device"),
    "a generation of a denoiser": (["--shape", "tiny-flux", "--phases", "generate-2"], "has no generation"),
    "load of a quantized shape": (["--kind", "load", "--shape", "tiny-fp8"], "plain bf16 causal LM"),
    "load without CUDA at full size": (["--kind", "load", "--shape", "llama-3-8b"], "runs on a tiny shape"),
    "--warps 3": (["--kind", "codec", "--warps", "3"], "powers of 2"),
    "--warps two": (["--kind", "codec", "--warps", "two"], "whole numbers"),
    "--group-size 100": (["--kind", "codec", "--group-size", "100"], "at least 4KiB"),
    "--group-size lots": (["--kind", "codec", "--group-size", "lots"], "lots"),
    "--decode-gbps 0": (["--kind", "pipeline", "--shape", "tiny-flux-pipeline", "--predict", "--decode-gbps",
                         "0"], "positive rate"),
    "--decode-gbps without --predict": (["--kind", "pipeline", "--shape", "tiny-flux-pipeline",
                                         "--decode-gbps", "990"], "--predict"),
    "--predict of two generations": (["--kind", "pipeline", "--shape", "tiny-flux-pipeline", "--predict",
                                      "--phases", "generate-2,generate-4"], "one --phases generate-N"),
    "--kind unknown": (["--kind", "quant"], "invalid choice: 'quant'"),
    "--bound of a missing file": (["--bound", "/nonexistent/x.json"], "No such file"),
}


@pytest.mark.parametrize("name", MISTAKES)
def test_every_mistake_in_the_new_options_is_one_line_and_exit_2(name, tmp_path, capsys, monkeypatch):
    argv, says = MISTAKES[name]
    from weightstream.bench import codec, load, pipeline_run, runner

    def never(*args, **kwargs):
        raise AssertionError("the mistake was found only after the run started")

    for module, name in ((runner, "_start"), (load, "run_load"), (pipeline_run, "run_pipeline"),
                         (codec, "run_codec")):
        monkeypatch.setattr(module, name, never)
    try:
        status = weightstream_main(["bench", "--device", "cpu", *argv, "--out", str(tmp_path / "x.json")])
    except SystemExit as stop:  # argparse's own mistakes (OneLineParser)
        status = stop.code
    assert status == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("weightstream bench: ") and says in lines[0], lines
