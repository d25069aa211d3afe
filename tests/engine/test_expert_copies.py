"""Expert copies on the CPU (synchronous backend): each call's routed experts copied into the work
buffers once the host has read the routing. The rows copied under drawn routings, the model zoo's
mixtures of experts `torch.equal` to the resident model (eager and traced), what the planner, the cost
model, the counters, `OffloadConfig` and the command line make of it."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from model_zoo import ZOO, call, same
from test_coded_copies import bf16_model, coded_offload
from test_expert_cache import CACHED, inputs_like, restores_true_state

import weightstream as ws
from weightstream.engine.expert_cache import CachedTensor, ExpertCopy, _runs
from weightstream.errors import ArgumentError
from weightstream.placement.plan import placement_of, plan, predict_placement
from weightstream.placement.prepare import prepare


def copies_offload(model, skip_first: bool = False):
    """Offload with every block's routed experts copied (the first such block read in place instead,
    with `skip_first`)."""
    cost = prepare(model, gpu_memory=2**40, device="cpu").cost
    apart = tuple(i for i in range(len(cost.block_bytes)) if cost.experts_apart(i))
    placement = placement_of(cost, (), 0, apart, uva_experts=apart,
                             expert_copies=apart[1:] if skip_first else apart)
    return ws.offload(model, gpu_memory=placement.gpu_bytes, device="cpu", placement=placement), cost


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 10).flatmap(lambda experts: st.tuples(
    st.just(experts),
    st.lists(st.lists(st.integers(-2, experts + 2), min_size=1, max_size=8), min_size=1, max_size=6))))
def test_a_call_copies_exactly_the_rows_of_the_experts_it_routes_to(drawn):
    """Under drawn routings (indices outside the experts, as expert parallelism marks foreign ones,
    included): after each call the work rows of the routed experts hold the host's bytes and every
    other row what it held before."""
    experts, calls = drawn
    gen = torch.Generator().manual_seed(experts)
    host = [torch.randint(0, 256, (experts, w), generator=gen, dtype=torch.uint8) for w in (6, 3)]
    tensors = [CachedTensor(None, h, h[:0], torch.zeros_like(h)) for h in host]
    layer = ExpertCopy(torch.nn.Identity(), tensors, experts)
    for chosen in calls:
        before = [t.work.clone() for t in tensors]
        for t in tensors:
            t.work.add_(1)  # rows not copied keep this mark
        layer.gather(torch.tensor(chosen).view(-1, 1))
        routed = {e for e in chosen if 0 <= e < experts}
        for t, h, b in zip(tensors, host, before, strict=True):
            for e in range(experts):
                assert torch.equal(t.work[e], h[e] if e in routed else b[e] + 1)


@given(st.sets(st.integers(0, 40)))
def test_runs_cover_the_ids_in_the_fewest_ranges(ids):
    runs = _runs(sorted(ids))
    assert [i for a, b in runs for i in range(a, b)] == sorted(ids)
    assert all(b1 < a2 for (_, b1), (a2, _) in zip(runs, runs[1:], strict=False))  # no two touch


@pytest.mark.parametrize("skip_first", [False, True])
@pytest.mark.parametrize("name", CACHED)
def test_offloaded_with_expert_copies_is_exact(name, skip_first):
    model, inputs = ZOO[name]()
    model = model.eval().requires_grad_(False)
    ref = copy.deepcopy(model)
    handle, _ = copies_offload(model, skip_first)
    caches = handle.expert_caches
    assert caches.copies and caches.pool_bytes == 0
    assert handle.stats.cache_bytes == caches.work_bytes == handle.placement.cache_bytes > 0
    assert handle.stats.expert_hit_rate is None
    for seed in range(4):
        batch = inputs_like(inputs, seed)
        assert same(call(model, batch), call(ref, batch)), seed
    decode = dict(inputs, input_ids=inputs["input_ids"][:, :1])
    assert same(call(model, decode), call(ref, decode))
    restores_true_state(handle, model, ref, inputs)


def test_the_experts_read_only_rows_copied_for_the_call():
    """Poisoning every work buffer (NaN) before each layer's copies changes nothing: each row the experts
    read was copied for this call."""
    model, inputs = ZOO["gpt_oss"]()
    model = model.eval().requires_grad_(False)
    ref = copy.deepcopy(model)
    handle, _ = copies_offload(model)
    caches = handle.expert_caches

    def poison(module, args):
        for buffers in caches.work.values():
            for w in buffers:
                w.view(torch.float32).fill_(float("nan"))

    hooks = [c.module.register_forward_pre_hook(poison, prepend=True) for c in caches.caches]
    for seed in range(3):
        batch = inputs_like(inputs, seed)
        assert same(call(model, batch), call(ref, batch))
    for h in hooks:
        h.remove()
    handle.restore()


@pytest.mark.parametrize("coded", [False, True], ids=["raw", "coded"])
def test_compiled_fullgraph_runs_the_copies_as_an_opaque_op(coded):
    """Traced with aot_eager and fullgraph: raw copies, and copies held coded (bf16, the reference decoder
    inside the op)."""
    if coded:
        model, inputs = bf16_model("mixtral")
        ref = copy.deepcopy(model)
        handle, _ = coded_offload(model)
    else:
        model, inputs = ZOO["mixtral"]()
        model = model.eval().requires_grad_(False)
        ref = copy.deepcopy(model)
        handle, _ = copies_offload(model)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for seed in range(2):
        batch = inputs_like(inputs, seed)
        assert same(call(compiled, batch), call(ref, batch))
    torch._dynamo.reset()
    handle.restore()


@pytest.mark.parametrize("coded", [False, True], ids=["raw", "coded"])
def test_expert_bytes_per_token_count_the_copied_experts(coded):
    """The routers' counters count copied experts as experts read in place: the experts reached, raw or
    (held coded) at their blobs' mean size."""
    if coded:
        model, inputs = bf16_model("qwen3_moe")
        handle, cost = coded_offload(model)
    else:
        model, inputs = ZOO["qwen3_moe"]()
        handle, cost = copies_offload(model.eval().requires_grad_(False))
    handle.count_experts()
    for seed in range(2):
        call(model, inputs_like(inputs, seed))
    reached = handle._experts.counts[:, 0]  # per copied block, in block order
    copies = handle.expert_caches.caches
    assert len(copies) == len(reached) and reached.sum() > 0
    per_expert = [(c.wire_bytes if coded else cost.routed_bytes[b]) / cost.experts
                  for c, b in zip(copies, handle.placement.expert_copies, strict=True)]
    tokens = inputs["input_ids"].numel() * 2
    want = sum(n * size for n, size in zip(reached.tolist(), per_expert, strict=True)) / tokens
    assert handle.stats.expert_bytes_per_token == pytest.approx(want)
    if coded:  # below the raw bytes of the experts reached
        raw = reached.sum().item() * cost.routed_bytes[handle.placement.expert_copies[0]] / cost.experts
        assert want < 0.95 * raw / tokens
    handle.restore()


def test_the_cost_model_moves_the_same_bytes_as_in_place_at_the_copy_rate_plus_a_wait_per_layer():
    model, _ = ZOO["mixtral"]()
    cost = prepare(model.eval(), gpu_memory=2**40, device="cpu").cost
    apart = tuple(range(len(cost.block_bytes)))
    profile = ws.REFERENCE_PROFILE
    in_place = placement_of(cost, (), 0, apart, uva_experts=apart, profile=profile)
    copied = placement_of(cost, (), 0, apart, uva_experts=apart, expert_copies=apart, profile=profile)
    assert copied.prediction.link_bytes == pytest.approx(in_place.prediction.link_bytes)
    assert copied.cache_bytes == cost.cache_bytes(apart, 0) and copied.gpu_bytes == \
        in_place.gpu_bytes + copied.cache_bytes
    slower = dataclasses.replace(profile, expert_sync_seconds=profile.expert_sync_seconds + 1e-3)
    later = predict_placement(cost, copied, 1, slower)
    assert later.ms == pytest.approx(copied.prediction.ms + len(apart))  # 1 ms more per copied layer
    with pytest.raises(ArgumentError, match="expert_copies"):
        placement_of(cost, (), 0, apart, uva_experts=apart[1:], expert_copies=apart)
    with pytest.raises(ArgumentError, match="expert_copies"):
        placement_of(cost, (), 0, apart, uva_experts=apart, expert_cache=apart, expert_slots=1,
                     expert_copies=apart[:1])


def test_the_planner_copies_the_experts_of_every_block_it_reads_for_them_where_asked():
    """GPT-OSS-20B's shape at 8 GiB on the reference profile: with `expert_copies=True` every block read
    for its routed experts copies them (their work buffers in the budget, no cache), without it none."""
    from weightstream.placement.shapes import meta_model

    cost = prepare(meta_model("gpt-oss-20b", torch.bfloat16), gpu_memory=2**40, device="cpu",
                   allow_meta=True).cost
    budget = 8 << 30
    copied = plan(cost, budget, profile=ws.REFERENCE_PROFILE, expert_copies=True)
    in_place = plan(cost, budget, profile=ws.REFERENCE_PROFILE)
    assert copied.uva_experts and copied.expert_copies == copied.uva_experts and not copied.expert_cache
    assert copied.gpu_bytes <= budget and copied.cache_bytes == cost.cache_bytes(copied.expert_copies, 0)
    assert in_place.uva_experts and not in_place.expert_copies


def test_offload_expert_copies_are_taken_wherever_they_fit_warned_where_not_and_refuse_a_non_bool():
    """The zoo's tiny Mixtral has 4 experts: a work buffer costs a whole layer of experts and a copied
    layer waits 50 us for the host, so the cost model predicts copies slower than reading in place. Asked
    for (`expert_copies=True`), copies are still taken wherever their work buffers fit (the placement
    moves what it must off the GPU), as `compress=True` takes compression; where a layer's work buffers
    cannot fit beside the weights outside the blocks, the experts are read in place and a warning says
    no expert is copied. A value other than a bool is refused."""
    model, inputs = ZOO["mixtral"]()
    model = model.eval().requires_grad_(False)
    cost = prepare(model, gpu_memory=2**40, device="cpu").cost
    dense = cost.fixed_bytes + sum(b - r for b, r in zip(cost.block_bytes, cost.routed_bytes, strict=True))
    roomy = dense + int(0.3 * sum(cost.routed_bytes))
    faster = plan(cost, roomy, profile=ws.REFERENCE_PROFILE, strategy="uva")
    assert faster.uva_experts and not faster.expert_copies  # predicted faster without copies
    ref = copy.deepcopy(model)
    expected = call(ref, inputs)
    for budget, copies in ((roomy, True), (cost.fixed_bytes + max(cost.routed_bytes) // 2, False)):
        offloaded = copy.deepcopy(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            handle = ws.offload(offloaded, budget, device="cpu", strategy="uva", expert_copies=True,
                                profile=ws.REFERENCE_PROFILE)
        assert handle.placement.uva and bool(handle.placement.expert_copies) == copies
        assert any("copies no expert" in str(w.message) for w in caught) == (not copies)
        assert handle.placement.gpu_bytes <= budget
        assert same(call(offloaded, inputs), expected)
        handle.restore()
    with pytest.raises(ws.ArgumentError, match="expert_copies=1: give True"):
        ws.offload(copy.deepcopy(model), roomy, device="cpu", expert_copies=1)


def test_the_command_line_plans_expert_copies_and_refuses_them_with_cuda_graphs(capsys, tmp_path):
    from weightstream.cli import main

    assert main(["plan", "gpt-oss-20b", "--gpu-memory", "8GiB", "--expert-copies"]) == 0
    out = capsys.readouterr().out
    assert "expert copies" in out and "no CUDA graphs" in out and "held compressed" not in out
    assert main(["plan", "gpt-oss-20b", "--gpu-memory", "8GiB", "--expert-copies", "--compress", "true"]) == 0
    assert "held compressed (ratio 0.7" in capsys.readouterr().out
    assert main(["generate", str(tmp_path), "--prompt", "x", "--gpu-memory", "1GiB", "--expert-copies",
                 "--compile", "graphs"]) == 2
    assert "--expert-copies and --compile graphs" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["copies", "cache"])
def test_a_write_to_an_expert_weight_viewing_a_work_buffer_is_refused_once_and_discarded(kind):
    """A routed expert weight behind copies or a cache views a work buffer the next gather overwrites:
    an in-place write to it between forwards is refused at the next forward (it never reached the
    weights), and the forwards after it equal the resident model that was never written."""
    from test_expert_cache import cached_offload

    from weightstream.errors import OffloadStateError

    model, inputs = ZOO["mixtral"]()
    model = model.eval().requires_grad_(False)
    ref = copy.deepcopy(model)
    handle = copies_offload(model)[0] if kind == "copies" else cached_offload(model, slots=2)[0]
    call(model, inputs)
    experts = handle.expert_caches.caches[0].module
    with torch.no_grad():
        experts.gate_up_proj.mul_(2)
    with pytest.raises(OffloadStateError, match="gate_up_proj was written in place outside"):
        call(model, inputs)
    for seed in range(2):
        batch = inputs_like(inputs, seed)
        assert same(call(model, batch), call(ref, batch))
    restores_true_state(handle, model, ref, inputs)
