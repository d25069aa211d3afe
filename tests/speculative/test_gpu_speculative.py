"""`ws.generate` on a real GPU: offloaded equals resident eagerly, compiled (`fullgraph`, no graph breaks,
one graph per forward shape) and from CUDA graphs (`mode="reduce-overhead"`); greedy equals plain greedy
in fp32. Run with `pytest -m gpu tests/speculative` on a CUDA machine; skipped elsewhere."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from conftest import make_model, with_boundaries
from test_gpu import eager_rounding, streaming_all_budget  # noqa: F401  (a fixture, and the budget)
from test_loop import off_gpu_blocks

import weightstream as ws
from weightstream.placement.probe import H200

pytestmark = pytest.mark.gpu


def prompt(seed: int = 0, length: int = 24) -> torch.Tensor:
    return torch.randint(0, 6, (1, length), generator=torch.Generator().manual_seed(seed)).cuda()


def offloaded(model):
    ws.offload(model, gpu_memory=streaming_all_budget(model), strategy="stream", profile=H200)
    return model


def run(model, **kwargs):
    args = dict(max_new_tokens=24, width=3, depth=4, eos_token_id=[], output_logits=True,
                generator=torch.Generator().manual_seed(2)) | kwargs
    return ws.generate(model, prompt(), **args)


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("draft", ["prompt-lookup", "model"])
def test_eager_offloaded_equals_resident_and_the_streamed_bytes_stay_off_the_gpu(draft, do_sample):
    ref = make_model("llama", dtype=torch.bfloat16).cuda()
    model = offloaded(copy.deepcopy(ref))
    small = make_model("llama", seed=0, dtype=torch.bfloat16).cuda()
    kind = small if draft == "model" else draft
    a = run(ref, draft=kind, do_sample=do_sample)
    b = run(model, draft=kind, do_sample=do_sample)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logits, b.logits)
    assert a.stats.accepted == b.stats.accepted
    handle = ws.handle_of(model)
    assert handle.stats.misses == 0 and handle.stats.streamed_bytes > 0


def test_greedy_equals_plain_greedy_in_fp32_on_the_gpu():
    model = make_model("llama").cuda()
    ids = prompt(3)
    want = model.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False, eos_token_id=None,
                          pad_token_id=0, attention_mask=torch.ones_like(ids))
    for draft in ("prompt-lookup", copy.deepcopy(model)):
        out = ws.generate(offloaded(copy.deepcopy(model)), ids, 20, draft=draft, width=2, depth=5,
                          eos_token_id=[])
        assert torch.equal(out.tokens.cuda(), want)


@pytest.mark.parametrize("mode", [True, "reduce-overhead"])
def test_compiled_verify_is_one_fullgraph_and_offloaded_equals_its_reference(mode, eager_rounding):  # noqa: F811
    """Compiled, the reference is the resident model with the (idle) schedule ops at the same block edges
    (docs/exactness.md: a forward filling a static cache differs from the plain compiled model in the
    rotary embedding's last bits)."""
    ref = make_model("llama", dtype=torch.bfloat16).cuda()
    model = offloaded(copy.deepcopy(ref))
    reference = with_boundaries(copy.deepcopy(ref))
    torch._dynamo.utils.counters.clear()
    a = run(reference, draft="prompt-lookup", compile=mode)
    b = run(model, draft="prompt-lookup", compile=mode)
    assert not torch._dynamo.utils.counters["graph_break"]
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logits, b.logits)
    # one graph per generation, whatever its passes: every verify pass after the first replays it
    assert b.stats.passes > 1 and torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


def test_a_cuda_generator_is_refused_with_the_way_out():
    model = make_model("llama").cuda()
    with pytest.raises(ws.ArgumentError, match="give torch.Generator\\(\\) \\(on the CPU\\)"):
        ws.generate(model, prompt(), 2, do_sample=True, generator=torch.Generator(device="cuda"))


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_self_draft_offloaded_equals_resident_and_its_bytes_are_on_the_gpu(bits, do_sample):
    ref = make_model("llama", dtype=torch.bfloat16).cuda()
    model = offloaded(copy.deepcopy(ref))
    blocks = off_gpu_blocks(model)
    a = run(ref, draft=ws.SelfDraft(bits=bits, blocks=blocks), do_sample=do_sample)
    draft = ws.SelfDraft(bits=bits)
    need = draft.needed_bytes(model)
    gc.collect()  # the reference run's garbage goes now, not while the draft is built
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    draft.build(model)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before >= need == draft.device_bytes() > 0
    assert all(t.is_cuda for t in (*draft.model.parameters(), *draft.model.buffers()))
    handle = ws.handle_of(model)
    copies = []
    propose = draft.propose

    def counted(context, shape):
        before = handle.stats.copies
        tree = propose(context, shape)
        copies.append(handle.stats.copies - before)
        return tree

    draft.propose = counted
    b = run(model, draft=draft, do_sample=do_sample)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logits, b.logits)
    assert a.stats.accepted == b.stats.accepted and b.stats.draft_bytes == need
    assert copies and not any(copies)  # nothing of the draft streams
    assert handle.stats.misses == 0


def test_self_draft_greedy_equals_plain_greedy_in_fp32_on_the_gpu():
    model = make_model("llama").cuda()
    ids = prompt(3)
    want = model.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False, eos_token_id=None,
                          pad_token_id=0, attention_mask=torch.ones_like(ids))
    for bits in (4, 8):
        out = ws.generate(offloaded(copy.deepcopy(model)), ids, 20, draft=ws.SelfDraft(bits=bits), width=2,
                          depth=5, eos_token_id=[])
        assert torch.equal(out.tokens.cuda(), want) and sum(out.stats.accepted) > 0


@pytest.mark.parametrize("mode", [True, "reduce-overhead"])
def test_compiled_self_draft_offloaded_equals_its_reference(mode, eager_rounding):  # noqa: F811
    ref = make_model("llama", dtype=torch.bfloat16).cuda()
    model = offloaded(copy.deepcopy(ref))
    reference = with_boundaries(copy.deepcopy(ref))
    torch._dynamo.utils.counters.clear()
    a = run(reference, draft=ws.SelfDraft(blocks=off_gpu_blocks(model)), compile=mode)
    b = run(model, draft="self", compile=mode)
    assert not torch._dynamo.utils.counters["graph_break"]
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logits, b.logits)
