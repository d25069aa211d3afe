"""Coded expert copies on the CPU (synchronous backend, the reference decoder): routed experts held
compressed in host memory, one record per expert, decoded into the work buffers each call. The model
zoo's mixtures of experts in bf16 `torch.equal` to the resident model (eager; traced in
test_expert_copies.py), the rows a
call decodes under drawn routings, experts copied raw beside coded ones, the true values state_dict()
and restore() give, what the planner and cost model make of it, and from_pretrained reading them
coded from a checkpoint."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from model_zoo import ZOO, call, same
from test_expert_cache import CACHED, inputs_like, restores_true_state

import weightstream as ws
from weightstream.engine.coded_experts import CodedCopy
from weightstream.errors import ArgumentError
from weightstream.placement.plan import placement_of, plan
from weightstream.placement.prepare import prepare


def bf16_model(name: str):
    model, inputs = ZOO[name]()
    return model.to(torch.bfloat16).eval().requires_grad_(False), inputs


def coded_placement(model, **changes):
    """Every block's routed experts copied and held coded (the placement forced, any profile)."""
    cost = prepare(model, gpu_memory=2**40, device="cpu", compress=True).cost
    apart = tuple(i for i in range(len(cost.block_bytes)) if cost.experts_apart(i))
    placement = placement_of(cost, (), 0, apart, uva_experts=apart, expert_copies=apart, coded_copies=True)
    return dataclasses.replace(placement, **changes), cost


def coded_offload(model, **changes):
    placement, cost = coded_placement(model, **changes)
    return ws.offload(model, gpu_memory=placement.gpu_bytes, device="cpu", placement=placement), cost


@pytest.mark.parametrize("name", CACHED)
def test_coded_copies_are_exact_and_hold_the_experts_compressed(name):
    model, inputs = bf16_model(name)
    ref = copy.deepcopy(model)
    handle, cost = coded_offload(model)
    caches = handle.expert_caches
    coded = [c for c in caches.caches if isinstance(c, CodedCopy)]
    assert len(coded) == len(caches.caches) == len(handle.placement.expert_copies)
    assert all(r.chunks for c in coded for r in c.records)  # every expert of the zoo's codes
    stats = handle.stats
    assert 0.5 < stats.expert_wire_ratio < 0.95
    # the arena holds the records, not the raw experts: pinned (host) bytes shrink by the coded share
    held = sum(c.wire_bytes for c in coded)
    assert handle.engine.arena.nbytes == held
    assert stats.cache_bytes == caches.work_bytes + 2 * handle.placement.copy_landing_bytes
    for seed in range(3):
        batch = inputs_like(inputs, seed)
        assert same(call(model, batch), call(ref, batch)), seed
    decode = dict(inputs, input_ids=inputs["input_ids"][:, :1])
    assert same(call(model, decode), call(ref, decode))
    restores_true_state(handle, model, ref, inputs)


@pytest.fixture(scope="module")
def offloaded_mixtral():
    """The zoo's Mixtral in bf16, offloaded with coded copies once for every drawn case (gathers write
    only the work buffers), with its true expert weights; restored at the end (no engine outlives it)."""
    model, _ = bf16_model("mixtral")
    truth = {k: v.clone() for k, v in model.state_dict().items() if "experts" in k}
    handle, _ = coded_offload(model)
    yield handle.expert_caches, truth
    handle.restore()


@settings(max_examples=25, deadline=None)
@given(routings=st.lists(st.lists(st.integers(-1, 4), min_size=1, max_size=6), min_size=1, max_size=4),
       layer=st.integers(0, 3))
def test_a_call_decodes_exactly_the_rows_of_the_experts_it_routes_to(offloaded_mixtral, routings, layer):
    """Under drawn routings (indices past the experts skipped), each call leaves every routed expert's
    rows in the work buffer equal to the true weights and the rows of experts not routed as they were."""
    caches, truth = offloaded_mixtral
    cache = caches.caches[layer]
    true = [w for k, w in truth.items() if f"layers.{layer}." in k]
    for routing in routings:
        for t in cache.tensors:
            t.work.fill_(0xAB)
        caches.gather(layer, torch.tensor(routing))
        for t, weight in zip(cache.tensors, true, strict=True):
            for e in range(cache.experts):
                rows = t.work[e].view(weight.dtype).view(weight.shape[1:])
                if e in routing:
                    assert torch.equal(rows, weight[e]), (routing, e)
                else:
                    assert bool((t.work[e] == 0xAB).all()), (routing, e)


def test_experts_whose_blobs_would_not_fit_the_landing_buffer_are_copied_raw_beside_coded_ones():
    """A landing buffer smaller than some experts' blobs: those are held raw (a warning counts them) and
    copied into their rows, the others decoded; outputs exact all the same."""
    model, inputs = bf16_model("qwen3_moe")
    ref = copy.deepcopy(model)
    placement, _ = coded_placement(model)
    cut = max(_blob_sizes(model, placement)) - 1  # the largest blobs do not fit
    with pytest.warns(UserWarning, match="copied raw"):
        handle = ws.offload(model, gpu_memory=placement.gpu_bytes, device="cpu",
                            placement=dataclasses.replace(placement, copy_landing_bytes=cut))
    records = [r for c in handle.expert_caches.caches for r in c.records]
    assert any(r.chunks == 0 for r in records) and any(r.chunks for r in records)
    for seed in range(3):
        batch = inputs_like(inputs, seed)
        assert same(call(model, batch), call(ref, batch)), seed
    restores_true_state(handle, model, ref, inputs)


def _blob_sizes(model, placement) -> list[int]:
    handle = ws.offload(copy.deepcopy(model), gpu_memory=placement.gpu_bytes, device="cpu",
                        placement=placement)
    sizes = [r.nbytes for c in handle.expert_caches.caches for r in c.records]
    handle.restore()
    return sizes


def test_a_float32_model_holds_its_experts_raw_and_says_so():
    """The codec codes bf16 and fp16: float32 experts are held raw (a warning), exact."""
    model, inputs = ZOO["mixtral"]()
    model = model.eval().requires_grad_(False)
    ref = copy.deepcopy(model)
    placement, _ = coded_placement(copy.deepcopy(model).to(torch.bfloat16))
    cost = prepare(model, gpu_memory=2**40, device="cpu").cost
    placement = dataclasses.replace(placement, cache_bytes=cost.cache_bytes(placement.expert_copies, 0))
    with pytest.warns(UserWarning, match="copied raw"):
        handle = ws.offload(model, gpu_memory=2**40, device="cpu", placement=placement)
    assert all(r.chunks == 0 for c in handle.expert_caches.caches for r in c.records)
    assert same(call(model, inputs), call(ref, inputs))
    handle.restore()


def test_the_planner_holds_copied_experts_coded_with_compress_true_only():
    """Mixtral-8x7B's shape at 25% on the reference profile: with expert copies and compress=True the
    planner holds the copied experts coded (the blobs, about 0.71 of the bytes, cross the link and the
    prediction drops); with compress="auto" or False, or coded_copies=False (from_pretrained), raw."""
    from weightstream.placement.shapes import meta_model

    cost = prepare(meta_model("mixtral-8x7b", torch.bfloat16), gpu_memory=2**40, device="cpu",
                   allow_meta=True, compress=True).cost
    budget = int(21.75 * 2**30)
    profile = ws.REFERENCE_PROFILE
    coded = plan(cost, budget, profile=profile, expert_copies=True, compress=True)
    raw = plan(cost, budget, profile=profile, expert_copies=True, compress=False)
    auto = plan(cost, budget, profile=profile, expert_copies=True)
    kept_raw = plan(cost, budget, profile=profile, expert_copies=True, compress=True, coded_copies=False)
    assert coded.expert_copies and coded.copy_landing_bytes > 0 and coded.gpu_bytes <= budget
    assert raw.expert_copies and raw.copy_landing_bytes == 0
    assert auto.expert_copies and auto.copy_landing_bytes == 0
    assert kept_raw.copy_landing_bytes == 0
    assert coded.prediction.ms < raw.prediction.ms
    assert coded.prediction.link_bytes < 0.75 * raw.prediction.link_bytes
    # the landing buffers hold the largest expert's predicted blob and count in the GPU bytes
    one_expert = max(cost.routed_bytes[i] // cost.experts for i in coded.expert_copies)
    assert 0.7 * one_expert < coded.copy_landing_bytes < one_expert
    assert coded.gpu_bytes == coded.resident_bytes + coded.cache_bytes + 2 * coded.copy_landing_bytes


def test_coded_copies_need_copied_blocks():
    model, _ = bf16_model("qwen3_moe")
    cost = prepare(model, gpu_memory=2**40, device="cpu", compress=True).cost
    apart = tuple(i for i in range(len(cost.block_bytes)) if cost.experts_apart(i))
    with pytest.raises(ArgumentError, match="coded_copies=True"):
        placement_of(cost, (), 0, apart, uva_experts=apart, coded_copies=True)


@pytest.mark.parametrize("coded", [True, False])
@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_from_pretrained_reads_copied_experts_from_the_checkpoint(tmp_path, name, coded):
    """A checkpoint as transformers saves it (Mixtral's experts one by one, converted on load) loads
    with its copied experts coded from the files, one layer at a time, the arena holding the records
    (or raw, copied as stored); weights, logits and greedy tokens equal transformers' own resident
    load."""
    from transformers import AutoModelForCausalLM

    model, inputs = bf16_model(name)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    placement, _ = coded_placement(reference) if coded else coded_placement(reference, copy_landing_bytes=0)
    config = ws.OffloadConfig(placement.gpu_bytes, device="cpu", placement=placement)
    loaded = ws.from_pretrained(tmp_path, config, progress=False)
    handle = ws.handle_of(loaded)
    copies = handle.expert_caches.caches
    assert len(copies) == len(placement.expert_copies)
    if coded:
        assert all(isinstance(c, CodedCopy) and all(r.chunks for r in c.records) for c in copies)
        assert handle.engine.arena.nbytes == sum(c.wire_bytes for c in copies)
    else:
        assert not any(isinstance(c, CodedCopy) for c in copies)
    got, want = loaded.state_dict(), reference.state_dict()  # the true weights, decoded from the records
    assert got.keys() == want.keys() and all(torch.equal(v, want[k]) for k, v in got.items())
    for seed in range(3):
        x = inputs_like(inputs, seed)
        assert same(call(loaded, x), call(reference, x))
    ids = inputs_like(inputs, 9)["input_ids"][:1]
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(loaded.generate(ids, **kwargs), reference.generate(ids, **kwargs))
