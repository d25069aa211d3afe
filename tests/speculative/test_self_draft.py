"""`draft="self"` on the CPU backend: offloaded equals resident (tokens and logits, greedy and sampling,
int4 and int8), greedy equals plain greedy for every architecture, the draft shares the model's resident
modules and never calls the engine, its bytes are counted before it is built, and bad options are refused."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import ARCHS, make_model, weight_bytes
from test_loop import off_gpu_blocks, plain_greedy, repetitive_prompt, speculate_both
from torch import nn

import weightstream as ws
from weightstream.errors import ArgumentError, BudgetError
from weightstream.speculative import SelfDraft
from weightstream.speculative.checks import generation_bytes
from weightstream.speculative.quantize import quantized_bytes


def offloaded(model, fraction: float = 0.5, strategy: str = "stream"):
    ws.offload(model, gpu_memory=int(weight_bytes(model) * fraction), device="cpu", strategy=strategy)
    return model


@pytest.fixture(scope="module")
def resident_and_offloaded():
    ref = make_model("llama")
    return ref, offloaded(copy.deepcopy(ref))


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_offloaded_self_draft_generation_equals_the_resident_run(resident_and_offloaded, bits, do_sample):
    ref, model = resident_and_offloaded
    # the resident model drafts with low-bit copies of the same blocks
    resident, streamed = speculate_both(
        ref, model, lambda target: SelfDraft(bits=bits, group=64, blocks=off_gpu_blocks(model)), do_sample)
    assert do_sample or sum(streamed.stats.accepted) > 0  # a random model samples near-uniformly
    assert streamed.stats.draft == f"self int{bits} g64"
    assert streamed.stats.draft_bytes == resident.stats.draft_bytes > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_self_draft_equals_plain_greedy_for_each_architecture(arch):
    model = make_model(arch)
    ids = repetitive_prompt(3)
    want = plain_greedy(model, ids, 12)
    out = ws.generate(model, ids, 12, draft="self", width=2, depth=4, eos_token_id=[])
    assert torch.equal(out.tokens, want)
    streamed = offloaded(copy.deepcopy(model), 0.6)
    for bits in (4, 8):
        out = ws.generate(streamed, ids, 12, draft=SelfDraft(bits=bits), width=2, depth=4, eos_token_id=[])
        assert torch.equal(out.tokens, want) and out.stats.passes < 11  # drafted tokens were accepted


def test_zero_copy_blocks_are_drafted_too():
    ref = make_model("llama")
    model = offloaded(copy.deepcopy(ref), 0.5, strategy="uva")
    handle = ws.handle_of(model)
    assert handle.uva_blocks
    draft = SelfDraft()
    ids = repetitive_prompt(4)
    out = ws.generate(model, ids, 10, draft=draft, width=2, depth=3, eos_token_id=[])
    assert torch.equal(out.tokens, plain_greedy(ref, ids, 10))
    assert draft.block_names(model) == [*handle.streamed_blocks, *handle.uva_blocks]


def test_the_draft_shares_the_resident_modules_and_copies_only_the_off_gpu_blocks(resident_and_offloaded):
    _, model = resident_and_offloaded
    draft = SelfDraft(group=64)
    need = draft.needed_bytes(model)
    built = draft.build(model)
    assert draft.device_bytes() == need > 0
    assert built is not model and built.lm_head is model.lm_head
    assert built.model.embed_tokens is model.model.embed_tokens and built.model.norm is model.model.norm
    drafted = set(off_gpu_blocks(model))
    guards = ws.handle_of(model).engine.guards
    modules = dict(built.named_modules())
    expected = 0
    for i, layer in enumerate(model.model.layers):
        mine = built.model.layers[i]
        if f"model.layers.{i}" not in drafted:
            assert mine is layer
            continue
        assert mine is not layer and "Streamed" not in type(mine).__name__
        assert not hasattr(mine, "_ws_engine_id")
        for name, live in nn.Module.named_parameters(layer):  # the tensors the block's forward reads
            if live.dim() >= 2:  # stored low-bit
                stored = modules[f"model.layers.{i}.{name.rpartition('.')[0]}"].parametrizations.weight
                assert stored.original0.dtype == torch.uint8
                expected += quantized_bytes(live.shape, 4, 64)
            else:  # the model's own where it is resident, else a copy of its true value
                held = built.get_parameter(f"model.layers.{i}.{name}")
                off = guards.true_value(live) is not live
                assert (held is not live) == off and torch.equal(held, guards.true_value(live))
                expected += live.numel() * live.element_size() if off else 0
    assert model.model.layers is not built.model.layers  # the model's own list is untouched
    assert need == expected
    assert draft.needed_bytes(model) == 0 and draft.build(model) is built  # kept for the next call


def test_a_draft_step_never_calls_the_engine(resident_and_offloaded, monkeypatch):
    _, model = resident_and_offloaded
    engine = ws.handle_of(model).engine
    calls = []
    for name in ("wait", "release"):
        original = getattr(engine, name)
        monkeypatch.setattr(engine, name, lambda group, original=original, name=name: (
            calls.append(name), original(group))[1])
    draft = SelfDraft()
    during = []
    propose = draft.propose

    def counted(context, shape):
        before, copies = len(calls), engine.schedule.copies
        tree = propose(context, shape)
        during.append((len(calls) - before, engine.schedule.copies - copies))
        return tree

    monkeypatch.setattr(draft, "propose", counted)
    out = ws.generate(model, repetitive_prompt(5), 12, draft=draft, width=2, depth=3, eos_token_id=[])
    assert out.stats.passes == len(during) > 1
    assert all(d == (0, 0) for d in during)  # no wait, no release, no copy while drafting
    assert calls.count("wait") == len(model.model.layers) * (out.stats.passes + 1)  # the prefill and verifies


def test_a_resident_model_drafts_with_a_chosen_subset_of_its_blocks():
    model = make_model("qwen2")
    ids = repetitive_prompt(6)
    draft = SelfDraft(bits=8, blocks=["model.layers.1", "model.layers.3"])
    out = ws.generate(model, ids, 10, draft=draft, width=2, depth=3, eos_token_id=[])
    assert torch.equal(out.tokens, plain_greedy(model, ids, 10))
    assert draft.model.model.layers[0] is model.model.layers[0]
    assert draft.model.model.layers[1] is not model.model.layers[1]


def test_a_draft_that_does_not_fit_names_its_bytes_and_the_way_out(resident_and_offloaded):
    _, model = resident_and_offloaded
    ids = repetitive_prompt(7)
    draft = SelfDraft(bits=8)
    copies = draft.needed_bytes(model)
    need = generation_bytes(model, None, ids.shape[1] + 8 - 1 + 7, 7, 128) + copies
    message = "self int8 g128 draft's low-bit copies .*bits=4.*gpu_memory .* smaller"
    with pytest.raises(BudgetError, match=message) as caught:
        ws.generate(model, ids, 8, draft=draft, width=2, depth=3, cache_memory=need - 1)
    assert caught.value.minimum_bytes == need
    assert draft.model is None  # refused before anything was built
    out = ws.generate(model, ids, 8, draft=draft, width=2, depth=3, cache_memory=need, eos_token_id=[])
    assert out.stats.draft_bytes == copies


@pytest.mark.parametrize("kwargs, message", [
    (dict(bits=3), r"bits=3\): give bits=4 \(the default\) or bits=8"),
    (dict(bits=True), "give bits=4"),
    (dict(group=32), "group=32.*at least 64"),
    (dict(group=65), "group=65.*even"),
    (dict(group=128.0), "group=128.0"),
    (dict(blocks="model.layers.0"), "a list of block names"),
])
def test_bad_self_draft_options_get_one_error_each(kwargs, message):
    with pytest.raises(ArgumentError, match=message):
        SelfDraft(**kwargs)


def test_a_block_name_the_model_lacks_is_refused(resident_and_offloaded):
    ref, _ = resident_and_offloaded
    with pytest.raises(ArgumentError, match="'model.layer.9' is not one of the model's blocks"):
        ws.generate(ref, repetitive_prompt(8), 4, draft=SelfDraft(blocks=["model.layer.9"]))
