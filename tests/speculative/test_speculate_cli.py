"""`weightstream generate --speculate` on the CPU: the plain greedy text, and one-line usage errors."""

from __future__ import annotations

import torch
from conftest import make_model
from transformers import AutoModelForCausalLM

from weightstream.cli import main

PROMPT = "w5 w9 w33 w17 w5 w9 w33 w17 w5 w9"


def greedy_text(folder, tokenizer, n: int, **settings) -> str:
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    out = reference.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones_like(ids), **settings)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def run(folder, *extra: str) -> int:
    return main(["generate", str(folder), "--prompt", PROMPT, "--gpu-memory", "200KB",
                 "--max-new-tokens", "10", "--device", "cpu", *extra])


def test_prompt_lookup_prints_the_greedy_text_and_the_speculation(checkpoint, capsys):
    folder, tokenizer = checkpoint
    assert run(folder, "--speculate", "prompt-lookup", "--tree", "2x3") == 0
    captured = capsys.readouterr()
    want = greedy_text(folder, tokenizer, 10)
    assert want.strip() and want.strip() in captured.out
    assert "speculative (prompt-lookup, tree 2x3)" in captured.out and "accepted per pass" in captured.out
    assert "tok_s" in captured.err  # the progress bar


def test_tree_auto_lets_the_cost_model_choose_the_shape_and_gives_the_greedy_text(checkpoint, capsys):
    folder, tokenizer = checkpoint
    assert run(folder, "--speculate", "prompt-lookup", "--tree", "auto") == 0
    out = capsys.readouterr().out
    assert greedy_text(folder, tokenizer, 10).strip() in out
    shape = out.split("speculative (prompt-lookup, tree ")[1].split(")")[0]
    width, depth = map(int, shape.split("x"))
    assert 1 <= width <= 8 and 1 <= depth <= 12


def test_a_draft_folder_is_loaded_resident_and_gives_the_same_text(checkpoint, tmp_path, capsys):
    folder, tokenizer = checkpoint
    draft = tmp_path / "draft"
    make_model("llama", seed=3).save_pretrained(draft)
    capsys.readouterr()  # save_pretrained's own progress bar
    # the draft's weights (about 550 KB) count in the budget: 200KB is refused, saying what suffices
    assert run(folder, "--speculate", str(draft)) == 2
    err = capsys.readouterr().err
    assert "cannot hold the model draft beside the model's weights" in err and len(err.splitlines()) == 1
    assert run(folder, "--speculate", str(draft), "--gpu-memory", "900KB") == 0
    captured = capsys.readouterr()
    assert greedy_text(folder, tokenizer, 10).strip() in captured.out
    assert "speculative (model, tree 4x6)" in captured.out
    assert "budget split: gpu_memory 878.91 KiB with the model draft: target resident" in captured.err


def test_the_self_draft_gives_the_same_text(checkpoint, capsys):
    folder, tokenizer = checkpoint
    assert run(folder, "--speculate", "self", "--tree", "2x3") == 0
    captured = capsys.readouterr()
    assert greedy_text(folder, tokenizer, 10).strip() in captured.out
    assert "speculative (self int4 g128, tree 2x3)" in captured.out
    assert "budget split: gpu_memory 195.31 KiB with the self int4 g128 draft" in captured.err


def test_speculation_mistakes_end_in_one_line_and_exit_2(checkpoint, tmp_path, capsys):
    folder, _ = checkpoint
    cases = [
        (["--speculate", str(tmp_path / "missing")], "is not a folder"),
        (["--speculate", "prompt-lookup", "--tree", "4-6"], "give WIDTHxDEPTH"),
        (["--speculate", "prompt-lookup", "--tree", "0x3"], "give WIDTHxDEPTH"),
        (["--tree", "2x2"], "--tree 2x2 not used here"),
    ]
    for extra, message in cases:
        assert run(folder, *extra) == 2
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("weightstream generate: ")]
        assert len(lines) == 1 and message in lines[0], err


def test_a_generation_config_setting_speculation_does_not_apply_is_one_line_and_exit_2(checkpoint, capsys):
    """A checkpoint whose generation_config.json sets repetition_penalty: the plain path applies it (the
    text of transformers' generate); --speculate, which does not, refuses in one line before the weights
    load, naming the setting and what to change."""
    from transformers import GenerationConfig

    folder, tokenizer = checkpoint
    config = GenerationConfig.from_pretrained(folder)
    config.repetition_penalty = 1.8
    config.save_pretrained(folder)
    want = greedy_text(folder, tokenizer, 10)
    assert want != greedy_text(folder, tokenizer, 10, repetition_penalty=1.0)  # the setting changes the text
    assert run(folder) == 0
    assert want.strip() in capsys.readouterr().out
    for draft in ("prompt-lookup", "self"):
        assert run(folder, "--speculate", draft, "--tree", "2x3") == 2
        captured = capsys.readouterr()
        assert not captured.out and "Loading weights" not in captured.err
        err = captured.err.strip()
        assert len(err.splitlines()) == 1, err
        assert err.startswith("weightstream generate: the model's generation_config sets "
                              "repetition_penalty=1.8")
        assert "without --speculate" in err and '"repetition_penalty": 1.0 in ' in err

