"""`weightstream generate` end to end on the CPU, with a tokenizer built locally (no downloads)."""

from __future__ import annotations

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
