"""The command line, run in-process on the CPU."""

import json
import re
import struct

import pytest
import torch

from weightstream.cli import main


def test_demo_runs_on_the_cpu_and_reports_identical_tokens(capsys):
    assert main(["demo", "--device", "cpu", "--new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "synchronous backend" in out
    assert "tokens identical to the fully resident run: yes" in out
    assert "streamed" in out


def test_plan_prints_a_table_and_json_that_respects_the_budget(capsys):
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


def test_plan_shows_a_gpu_expert_cache_and_predicts_with_it(capsys):
    """Mixtral read in place at 2048 tokens: the planner puts an expert cache in the budget (the cost
    model prices misses read once, not once per token tile); the table and JSON say so, and the
    prediction is the planner's own, cache included."""
    from weightstream.config import config_of
    from weightstream.placement.plan import plan
    from weightstream.placement.prepare import prepare
    from weightstream.placement.probe import load_profile
    from weightstream.placement.shapes import meta_model

    args = ["plan", "mixtral-8x7b", "--gpu-memory", "70GiB", "--tokens", "2048", "--strategy", "uva"]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    cache = report["expert_cache"]
    assert cache["blocks"] and set(cache["blocks"]) <= set(report["zero_copy"]["experts_only_blocks"])
    assert 0 < cache["slots"] < cache["experts"] == 8 and cache["bytes"] > 0
    assert report["gpu_bytes"] <= 70 * 2**30
    cost = prepare(meta_model("mixtral-8x7b"), gpu_memory=2**40, allow_meta=True).cost
    p = plan(cost, 70 * 2**30, tokens=2048, profile=load_profile(config_of("70GiB").device), strategy="uva")
    assert (p.expert_cache, p.expert_slots, p.cache_bytes) == (tuple(cache["blocks"]), cache["slots"],
                                                              cache["bytes"])
    assert report["predicted"]["prefill_2048"]["ms"] == round(p.prediction.again_ms, 2)
    assert main(args) == 0
    table = capsys.readouterr().out
    assert f"{cache['slots']} of 8 experts per block on the GPU" in table
    assert main(["plan", "mixtral-8x7b", "--gpu-memory", "70GiB"]) == 0  # decode: no cache pays
    assert "expert cache" not in capsys.readouterr().out


def test_probe_without_a_gpu_says_so(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["probe"]) == 1
    assert "no CUDA GPU" in capsys.readouterr().out


def test_plan_reads_a_local_config_folder(tmp_path, capsys):
    from conftest import hf_config

    hf_config("qwen2").save_pretrained(tmp_path)
    args = ["plan", str(tmp_path), "--gpu-memory", "100KB", "--json", "--strategy", "stream"]
    assert main([*args, "--dtype", "bf16"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["blocks"] == 4 and report["placement_kind"] == "stream" and report["gpu_bytes"] <= 100_000
    assert report["requested_strategy"] == "stream" and report["dtype"] == "bfloat16"
    assert main(args[:-2]) == 0  # the config's own dtype (float32 here): twice the bytes
    fp32 = json.loads(capsys.readouterr().out)
    assert fp32["dtype"] == "float32" and fp32["weight_bytes"] > 1.9 * report["weight_bytes"]


def test_plan_compress_shows_wire_bytes_ratio_and_landing_buffers(tmp_path, capsys):
    from conftest import hf_config

    hf_config("llama").save_pretrained(tmp_path)
    args = ["plan", str(tmp_path), "--gpu-memory", "200KB", "--strategy", "stream", "--dtype", "bf16"]
    assert main([*args, "--compress", "true", "--json"]) == 0
    coded = json.loads(capsys.readouterr().out)
    wire = coded["wire"]
    assert wire["compressed"] and wire["landing_bytes"] > 0 and coded["gpu_bytes"] <= 200_000
    # tiny tensors code to whole chunks: well above the 0.71 of large ones, still below MAX_RATIO
    assert wire["raw_bytes"] == coded["streamed"]["bytes"] and wire["bytes"] < 0.95 * wire["raw_bytes"]
    assert wire["ratio"] == round(wire["bytes"] / wire["raw_bytes"], 4)
    assert main([*args, "--compress", "false", "--json"]) == 0
    raw = json.loads(capsys.readouterr().out)["wire"]
    assert not raw["compressed"] and raw["bytes"] == raw["raw_bytes"] and raw["ratio"] == 1.0
    assert raw["landing_bytes"] == 0
    assert main([*args, "--compress", "true"]) == 0
    table = capsys.readouterr().out
    assert "streamed per forward, compressed (ratio 0." in table and "landing buffers" in table
    assert main(args) == 0
    assert "raw (ratio 1.000; no landing buffers)" in capsys.readouterr().out


# --- every mistake: one line on stderr, exit status 2 -------------------------------------------------

def _header_without_dtype(folder):
    for f in folder.glob("*.safetensors*"):
        f.unlink()
    header = json.dumps({"lm_head.weight": {"shape": [1], "data_offsets": [0, 4]}}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)


def _config(fields):
    def edit(folder):
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(fields(config)))
    return edit


MISTAKES = {  # name: (argv after the folder, how to spoil the folder, what the line must say)
    "generate --dtype bfloat": (["generate", "{}", "--dtype", "bfloat"], None, "dtype='bfloat'"),
    "generate --prompt ''": (["generate", "{}", "--prompt", ""], None, "--prompt is empty"),
    "generate --max-new-tokens 0": (["generate", "{}", "--max-new-tokens", "0"], None, "at least 1 token"),
    "generate --device tpu": (["generate", "{}", "--device", "tpu"], None, "device='tpu'"),
    "generate --gpu-memory lots": (["generate", "{}", "--gpu-memory", "lots"], None, "as a size"),
    "generate budget too small": (["generate", "{}", "--gpu-memory", "1KB"], None, "give at least"),
    "generate index without weight_map": (
        ["generate", "{}"], lambda f: (f / "model.safetensors.index.json").write_text('{"metadata": {}}'),
        "no weight_map"),
    "generate index not JSON": (
        ["generate", "{}"], lambda f: (f / "model.safetensors.index.json").write_text("{oops"),
        "model.safetensors.index.json is not valid JSON"),
    "generate header entry without dtype": (["generate", "{}"], _header_without_dtype,
                                            "lacks dtype, shape or data_offsets"),
    "generate config not JSON": (["generate", "{}"], lambda f: (f / "config.json").write_text("{"),
                                 "config.json is not valid JSON"),
    "generate unknown class": (["generate", "{}"], _config(lambda c: c | {"architectures": ["NoSuchLM"]}),
                               "names the class 'NoSuchLM'"),
    "plan config without model_type": (["plan", "{}"], _config(lambda c: {k: v for k, v in c.items()
                                                                          if k != "model_type"}),
                                       "has no model_type"),
    "plan config not JSON": (["plan", "{}"], lambda f: (f / "config.json").write_text("[1, 2"),
                             "config.json is not valid JSON"),
    "plan --dtype int8": (["plan", "{}", "--dtype", "int8"], None, "floating-point dtype"),
    "plan --tokens 0": (["plan", "{}", "--tokens", "0"], None, "tokens=0"),
    "plan unknown model": (["plan", "no-such-model"], None, "built-in shape"),
    "plan --steps 0": (["plan", "{}", "--steps", "0"], None, "at least 1 denoising step"),
    "plan --steps without a pipeline": (["plan", "{}", "--steps", "4"], None, "drop --steps"),
    "generate --steps without a pipeline": (["generate", "{}", "--steps", "4"], None, "drop --steps"),
    "generate image options without a pipeline": (
        ["generate", "{}", "--size", "64", "--seed", "0", "--out", "x.png"], None,
        "--size and --seed and --out not used here: only a diffusers pipeline folder"),
    "plan budget too small": (["plan", "llama-3-8b", "--gpu-memory", "1GiB"], None, "give at least"),
    "plan --gpu-memory 0.25": (["plan", "llama-3-8b", "--gpu-memory", "0.25"], None, "bytes come whole"),
    "generate --routing-skew -1": (["generate", "{}", "--routing-skew", "-1"], None,
                                   "routing_skew=-1.0: give the Zipf exponent"),
    "generate --expert-copies with a draft": (
        ["generate", "{}", "--speculate", "self", "--expert-copies"], None,
        "expert_copies=True (--expert-copies) with the self draft: the budget split beside a draft plans"),
    "plan --expert-copies with a draft": (
        ["plan", "{}", "--speculate", "prompt-lookup", "--expert-copies"], None,
        "expert_copies=True (--expert-copies) with the prompt-lookup draft"),
    "plan cpu_memory too small": (["plan", "llama-3-8b", "--gpu-memory", "3GiB", "--cpu-memory", "1MB"],
                                  None, "cpu_memory"),
    "demo --fraction 0.05": (["demo", "--device", "cpu", "--fraction", "0.05"], None, "at least --fraction"),
    "demo --fraction 1.5": (["demo", "--device", "cpu", "--fraction", "1.5"], None, "in (0, 1]"),
    "demo --new-tokens 0": (["demo", "--device", "cpu", "--new-tokens", "0"], None, "at least 1 token"),
    "demo --device cuda": (["demo", "--device", "cuda"], None, "CUDA is not available"),
}


@pytest.mark.parametrize("name", MISTAKES)
def test_every_mistake_ends_in_one_line_and_exit_status_2(name, checkpoint, capsys):
    argv, spoil, says = MISTAKES[name]
    if name == "demo --device cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    folder, _ = checkpoint
    if spoil is not None:
        spoil(folder)
    argv = [a.format(folder) for a in argv]
    defaults = {"generate": ["--prompt", "w1 w2", "--gpu-memory", "200KB", "--device", "cpu"],
                "plan": ["--gpu-memory", "200KB"], "demo": []}[argv[0]]
    given = set(argv)
    for flag, value in zip(defaults[::2], defaults[1::2], strict=True):
        if flag not in given:
            argv += [flag, value]
    assert main(argv) == 2
    err = capsys.readouterr().err
    ours = [line for line in err.splitlines() if line.startswith(f"weightstream {argv[0]}: ")]
    assert len(ours) == 1 and says in ours[0], err
    assert "Traceback" not in err


USAGE_MISTAKES = {  # argparse's own: name: (argv, what the one line must say)
    "no command": ([], "weightstream: the following arguments are required: command"),
    "unknown command": (["nosuch"], "invalid choice: 'nosuch'"),
    "plan without --gpu-memory": (["plan", "llama-3-8b"], "required: --gpu-memory"),
    "plan --strategy foo": (["plan", "llama-3-8b", "--gpu-memory", "8GiB", "--strategy", "foo"],
                            "invalid choice: 'foo'"),
    "plan --tokens x": (["plan", "llama-3-8b", "--gpu-memory", "8GiB", "--tokens", "x"], "invalid int value"),
    "demo --fraction x": (["demo", "--fraction", "x"], "invalid float value"),
    "probe extra argument": (["probe", "x"], "unrecognized arguments: x"),
    "bench --shape nope": (["bench", "--shape", "nope"], "weightstream bench: argument --shape: invalid"),
    "bench --reps x": (["bench", "--reps", "x"], "invalid int value: 'x'"),
}


@pytest.mark.parametrize("name", USAGE_MISTAKES)
def test_every_usage_mistake_is_one_line_and_exit_status_2(name, capsys):
    argv, says = USAGE_MISTAKES[name]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and says in lines[0] and "--help)" in lines[0], captured.err
    assert lines[0].startswith("weightstream") and not captured.out


def test_generate_takes_dtype_aliases(checkpoint, capsys):
    folder, _ = checkpoint
    assert main(["generate", str(folder), "--prompt", "w3 w4", "--gpu-memory", "200KB", "--device", "cpu",
                 "--max-new-tokens", "2", "--dtype", "fp16"]) == 0
    assert "tokens/s" in capsys.readouterr().out


def test_generate_refuses_a_model_that_is_not_a_causal_lm(tmp_path, capsys):
    import transformers

    cfg = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32)
    transformers.BertModel(cfg).save_pretrained(tmp_path)
    argv = ["generate", str(tmp_path), "--prompt", "hi", "--gpu-memory", "1MB", "--device", "cpu"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    ours = [line for line in err.splitlines() if line.startswith("weightstream generate: ")]
    assert len(ours) == 1 and "BertModel" in ours[0] and "not a causal LM" in ours[0], err
    assert "LlamaForCausalLM" in ours[0] and "Traceback" not in err


@pytest.fixture
def pipeline_folder(tmp_path):
    """A tiny FluxPipeline saved in float32 (the dtype its modules were built in): (folder, pipeline)."""
    pytest.importorskip("diffusers")
    from test_pipeline import tiny_flux_pipeline

    pipe = tiny_flux_pipeline()
    pipe.save_pretrained(tmp_path)
    return tmp_path, pipe


@pytest.mark.parametrize("option", [["--tokens", "64"], ["--routing-skew", "1"], ["--expert-copies"]])
def test_plan_of_a_pipeline_folder_refuses_an_option_it_would_ignore(pipeline_folder, option, capsys):
    folder, _ = pipeline_folder
    assert main(["plan", str(folder), "--gpu-memory", "1MB", *option]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"drop {option[0]}" in err and "Traceback" not in err, err


def test_plan_of_a_pipeline_folder_takes_the_dtype_its_weights_are_stored_in(pipeline_folder, capsys):
    from weightstream.pipeline import component_costs, modules_of

    folder, pipe = pipeline_folder
    costs = component_costs(modules_of(pipe), "cpu")  # the float32 pipeline in memory
    fp32 = {name: c.fixed_bytes + sum(c.block_bytes) for name, c in costs.items()}
    assert main(["plan", str(folder), "--gpu-memory", "1MB", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["components"]
    assert {name: c["weight_bytes"] for name, c in planned.items()} == fp32
    assert {c["dtype"] for c in planned.values()} == {"float32"}
    assert main(["plan", str(folder), "--gpu-memory", "1MB", "--json", "--dtype", "bf16"]) == 0
    halved = json.loads(capsys.readouterr().out)["components"]
    assert {c["dtype"] for c in halved.values()} == {"bfloat16"}
    assert halved["transformer"]["weight_bytes"] * 2 == fp32["transformer"]
    # one diffusers model folder of the pipeline: the same dtype
    assert main(["plan", str(folder / "transformer"), "--gpu-memory", "1MB", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["dtype"] == "float32" and report["weight_bytes"] == fp32["transformer"]


@pytest.mark.parametrize("options, says", [
    (["--max-new-tokens", "8"], "drop --max-new-tokens"),
    (["--chat", "--compile"], "drop --compile and --chat"),
    (["--speculate", "prompt-lookup", "--tree", "2x2"], "drop --speculate and --tree"),
    (["--tree", "2x2"], "drop --tree"),
    (["--routing-skew", "1"], "drop --routing-skew"),
    (["--steps", "0"], "at least 1 denoising step"),
    (["--size", "0"], "--size 0"),
    (["--out", "cat.jpg"], "ending in .png"),
    (["--out", "no/such/folder/cat.png"], "does not exist"),
    (["--prompt", ""], "--prompt is empty"),
])
def test_generate_on_a_pipeline_folder_refuses_text_options_and_bad_image_options(pipeline_folder, options,
                                                                                  says, capsys):
    folder, _ = pipeline_folder
    argv = ["generate", str(folder), "--prompt", "a red cat", "--gpu-memory", "1MB", "--device", "cpu"]
    assert main(argv + options) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("weightstream generate: ") and says in err, err
    assert "image, not text" in err or "drop" not in err


def test_plan_with_a_routing_skew_caches_popular_experts_at_decode_and_says_what_it_planned_for(capsys):
    """qwen3-30b-a3b at 8 GiB: under uniform routing no expert cache at decode; told Zipf(1) routing the
    planner trades resident blocks for a cache in every layer and predicts a faster decode."""
    import json

    predicted = {}
    for skew in (None, "1.0"):
        argv = ["plan", "qwen3-30b-a3b", "--gpu-memory", "8GiB", "--json"]
        assert main(argv + (["--routing-skew", skew] if skew else [])) == 0
        report = json.loads(capsys.readouterr().out)
        cache = report["expert_cache"]
        assert bool(cache["blocks"]) == (skew is not None)
        assert cache["routing_skew"] == (None if skew is None else 1.0)
        predicted[skew] = report["predicted"]["decode"]["ms"]
    assert predicted["1.0"] < predicted[None]
    assert main(["plan", "qwen3-30b-a3b", "--gpu-memory", "8GiB", "--routing-skew", "1.0"]) == 0
    out = capsys.readouterr().out
    assert "of the routed reads under Zipf(1) routing" in out and "replayed from a CUDA graph" in out
    assert main(["plan", "qwen3-30b-a3b", "--gpu-memory", "8GiB", "--routing-skew", "-2"]) == 2
    assert "give the Zipf exponent" in capsys.readouterr().err


def test_plan_help_names_every_built_in_shape(capsys):
    from weightstream.placement.shapes import SHAPES

    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = re.sub(r"-\s+", "-", capsys.readouterr().out)  # argparse may wrap a name at a hyphen
    assert [name for name in SHAPES if name not in text] == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="compress='auto' is raw only without CUDA")
def test_plan_says_when_compress_auto_planned_raw_only_for_want_of_cuda(pipeline_folder, capsys):
    """The plan is costed on a GPU's profile, but "auto" resolves to raw groups on a machine without
    CUDA: the report says so (text and JSON), for one model and for a pipeline, and not where raw was
    asked for."""
    from weightstream.pipeline import AUTO_RAW_NOTE

    argv = ["plan", "llama-3-8b", "--gpu-memory", "4GiB"]
    assert main(argv) == 0 and AUTO_RAW_NOTE in capsys.readouterr().out
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["wire"]["auto_raw_without_cuda"]
    assert main([*argv, "--compress", "false"]) == 0 and AUTO_RAW_NOTE not in capsys.readouterr().out
    folder, _ = pipeline_folder
    argv = ["plan", str(folder), "--gpu-memory", "60KB", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert any(c["streamed_blocks"] for c in report["components"].values())
    assert report["compress_auto_raw_without_cuda"]
    assert main(argv[:-1]) == 0 and AUTO_RAW_NOTE in capsys.readouterr().out
    assert main([*argv[:-1], "--compress", "false"]) == 0 and AUTO_RAW_NOTE not in capsys.readouterr().out
