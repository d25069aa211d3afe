"""Threads calling one offloaded mixture of experts at once, its routed experts copied (raw or coded)
or behind a GPU expert cache: every layer's gather writes the same work buffers, so the experts of one
thread run at a time, and every output equals the resident model's (CPU backend)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from model_zoo import call
from test_compiled_experts import offloaded, tiny
from test_expert_cache import inputs_like


@pytest.mark.parametrize("kind", ["copies", "coded", "cache"])
def test_threads_calling_one_model_get_the_resident_outputs(kind):
    model, inputs = tiny("mixtral", torch.bfloat16)
    ref = copy.deepcopy(model)
    handle = offloaded(kind, model)
    batches = [dict(b, input_ids=b["input_ids"].repeat(1, 4)) for b in
               (inputs_like(inputs, seed) for seed in range(4))]
    want = [call(ref, b).logits for b in batches]
    wrong, errors = [], []

    def run(k: int) -> None:
        try:
            for step in range(6):
                i = (k + step) % len(batches)
                if not torch.equal(call(model, batches[i]).logits, want[i]):
                    wrong.append((k, step))
        except Exception as e:  # reported below, from the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not wrong, (errors, wrong)
    handle.restore()
