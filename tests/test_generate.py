"""`weightstream generate` end to end on the CPU, with a tokenizer built locally (no downloads): a causal
LM's text, and a diffusers pipeline folder's image against the resident pipeline's."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from weightstream.cli import main
from weightstream.generate import generate_text


def expected_text(folder, tokenizer, prompt_ids, n):
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    out = reference.generate(prompt_ids, max_new_tokens=n, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones_like(prompt_ids))
    return tokenizer.decode(out[0, prompt_ids.shape[1]:], skip_special_tokens=True)


def test_generate_prints_the_reference_text_and_a_summary(checkpoint, capsys):
    folder, tokenizer = checkpoint
    prompt = "w5 w9 w33 w17"
    code = main(["generate", str(folder), "--prompt", prompt, "--gpu-memory", "200KB",
                 "--max-new-tokens", "8", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0
    want = expected_text(folder, tokenizer, tokenizer(prompt, return_tensors="pt")["input_ids"], 8)
    assert want.strip() and want.strip() in out
    assert "tokens/s" in out and "time to first token" in out and "pinned" in out


def test_chat_template_and_compiled_static_cache(checkpoint, capsys):
    folder, tokenizer = checkpoint
    summary = generate_text(folder, "w7 w8", "200KB", max_new_tokens=5, chat=True, compile=True,
                            device="cpu")
    printed = capsys.readouterr().out
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "w7 w8"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    assert expected_text(folder, tokenizer, ids, 5).strip() in printed
    assert summary.new_tokens >= 1 and summary.tokens_per_second > 0


def test_compile_graphs_decodes_in_reduce_overhead_mode_with_the_reference_text(checkpoint, capsys):
    """`--compile graphs`: the forward compiled with mode="reduce-overhead" (each step a CUDA graph
    replay on a GPU; compiled alone on the CPU), the same text as the resident model's; a value other
    than fullgraph or graphs is refused."""
    folder, tokenizer = checkpoint
    prompt = "w3 w4 w5"
    argv = ["generate", str(folder), "--prompt", prompt, "--gpu-memory", "200KB", "--max-new-tokens", "4",
            "--device", "cpu", "--compile"]
    assert main(argv + ["graphs"]) == 0
    want = expected_text(folder, tokenizer, tokenizer(prompt, return_tensors="pt")["input_ids"], 4)
    assert want.strip() and want.strip() in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(argv + ["cudagraphs"])
    assert "invalid choice: 'cudagraphs'" in capsys.readouterr().err


def test_generate_reports_bad_folders_without_a_traceback(checkpoint, tmp_path, capsys):
    args = ["--prompt", "w1", "--gpu-memory", "1GB", "--device", "cpu"]
    assert main(["generate", str(tmp_path / "nothing"), *args]) == 2
    assert "is not a folder" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["generate", str(empty), *args]) == 2
    assert "no config.json" in capsys.readouterr().err
    folder, _ = checkpoint
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    assert main(["generate", str(folder), *args]) == 2
    assert "no usable tokenizer" in capsys.readouterr().err


def test_cpu_memory_leaves_groups_of_a_checkpoint_on_disk_with_the_same_text(checkpoint, capsys):
    import json
    import re

    folder, _ = checkpoint
    args = ["generate", str(folder), "--prompt", "w5 w9 w33", "--gpu-memory", "300KB", "--device", "cpu",
            "--max-new-tokens", "6"]
    assert main(args) == 0
    free = capsys.readouterr().out
    plan = ["plan", str(folder), "--gpu-memory", "300KB", "--json"]
    assert main(plan) == 0
    streamed = json.loads(capsys.readouterr().out)["streamed"]
    cpu_memory = 2 * streamed["slot_bytes"]  # the two bounce buffers: every group on disk
    assert main([*plan, "--cpu-memory", str(cpu_memory)]) == 0
    assert json.loads(capsys.readouterr().out)["disk"]["bytes"] == streamed["bytes"] > 0
    assert main([*args, "--cpu-memory", str(cpu_memory)]) == 0
    limited = capsys.readouterr().out
    text = free[:free.rindex("\n", 0, len(free) - 1)]  # everything before the summary line
    assert limited.startswith(text)
    assert re.search(r", on disk [\d.]+ KiB; placement stream: ", limited) and "on disk" not in free


# --- an image from a diffusers pipeline folder: weightstream generate FOLDER -------------------------------

PROMPT = "a photo of a red cat"


def png_bytes(image) -> bytes:
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    """A saved bf16 FluxPipeline folder, the GPU budget to load it under (bytes: two thirds of its
    weights, where every component streams), and the PNG bytes of the resident pipeline's 16x16 image
    after 2 steps by seed (0 and 1)."""
    pytest.importorskip("diffusers")
    from test_pipeline import diffusers_loaded, saved, tiny_flux_pipeline, total_bytes

    folder = saved(tiny_flux_pipeline().to(dtype=torch.bfloat16), tmp_path_factory.mktemp("flux"))
    reference = diffusers_loaded(folder, torch.bfloat16)
    reference.set_progress_bar_config(disable=True)
    images = {seed: png_bytes(reference(PROMPT, num_inference_steps=2, height=16, width=16,
                                        generator=torch.Generator().manual_seed(seed)).images[0])
              for seed in (0, 1)}
    return folder, total_bytes(reference) * 2 // 3, images


SUMMARY = (r"^(?P<path>\S+) \(16x16\): loaded in [\d.]+ s, generated in [\d.]+ s, 2 steps at \d+ ms per "
           r"step, GPU allocated n/a \(CPU\), pinned 0 B(?P<disk>, on disk [\d.]+ KiB)?$")


def test_generate_on_a_pipeline_folder_saves_the_resident_pipelines_image(image_folder, tmp_path,
                                                                           monkeypatch, capsys):
    import re

    folder, budget, images = image_folder
    monkeypatch.chdir(tmp_path)  # the default file: image.png in the current folder
    assert main(["generate", folder, "--prompt", PROMPT, "--gpu-memory", str(budget), "--device", "cpu",
                 "--steps", "2", "--size", "16"]) == 0
    captured = capsys.readouterr()
    assert (tmp_path / "image.png").read_bytes() == images[0]
    lines = captured.out.strip().splitlines()
    summary = re.match(SUMMARY, lines[-1])
    assert summary and summary["path"] == "image.png" and summary["disk"] is None, lines[-1]
    assert "2/2" in captured.err  # diffusers' own step progress bar


def test_a_small_cpu_memory_keeps_groups_on_disk_and_gives_the_same_image(image_folder, tmp_path, capsys):
    import re

    import weightstream as ws
    from weightstream.errors import BudgetError
    from weightstream.generate import generate_image

    folder, budget, images = image_folder
    with pytest.raises(BudgetError) as err:
        ws.from_pretrained(folder, gpu_memory=budget, cpu_memory=1, device="cpu", progress=False)
    least = err.value.minimum_bytes  # the least that fits: groups of every component of 3 or more on disk
    out = tmp_path / "cat.png"
    assert main(["generate", folder, "--prompt", PROMPT, "--gpu-memory", str(budget), "--device", "cpu",
                 "--steps", "2", "--size", "16", "--seed", "1", "--out", str(out),
                 "--cpu-memory", str(least)]) == 0
    assert out.read_bytes() == images[1] != images[0]
    summary = re.match(SUMMARY, capsys.readouterr().out.strip().splitlines()[-1])
    assert summary and summary["path"] == str(out) and summary["disk"], summary
    image = generate_image(folder, PROMPT, budget, cpu_memory=least, steps=2, size=16, device="cpu",
                           out=out, progress=False)
    assert image.disk_bytes > 0 and image.steps == 2 and image.step_ms > 0 and image.load_seconds > 0
    assert out.read_bytes() == images[0]


@pytest.mark.parametrize("asked", [{"expert_copies": True}, {"expert_cache": False}])
def test_a_draft_in_the_budget_refuses_expert_options_its_split_would_drop(tmp_path, asked):
    """The budget split beside a draft plans no expert copies and a GPU expert cache where faster:
    asking otherwise is refused before anything loads, by generate_text and by plan_report."""
    from weightstream.config import OffloadConfig
    from weightstream.errors import ArgumentError
    from weightstream.planview import plan_report

    config = OffloadConfig("1MiB", device="cpu", **asked)
    name = next(iter(asked))
    with pytest.raises(ArgumentError, match=f"{name}=.* with the self draft"):
        generate_text(tmp_path / "nothing here", "w1", config, speculate="self")
    for draft in ("self", "prompt-lookup"):
        with pytest.raises(ArgumentError, match=f"{name}=.* with the {draft} draft"):
            plan_report("mixtral-8x7b", config.replace(gpu_memory="24GiB"), speculate=draft)
