"""Zero-copy blocks of a mixture of experts that read only their routed experts in place, the rest of
each block (attention, norms, router, shared experts) resident: through the real engine on the CPU
(synchronous backend), on the model zoo's mixtures of experts, outputs `torch.equal` to the resident
model's; exactly the routed expert tensors live in the host arena."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import weight_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_zoo import ZOO, call, same

import weightstream as ws
from weightstream.placement.plan import placement_of
from weightstream.placement.prepare import prepare

pytest.importorskip("transformers")

# the zoo's mixtures of experts whose experts transformers fuses into 3-D tensors (Jamba's are too,
# but its blocks are not all alike: it is covered by the planner's own choice below)
MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "gpt_oss"]


def build(name: str):
    model, inputs = ZOO[name]()
    model = model.eval().requires_grad_(False)
    return model, copy.deepcopy(model), inputs


def routed_names(model) -> set[str]:
    """Names of the model's fused expert tensors (3-D, first dimension the expert count)."""
    cfg = model.config
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) or \
        getattr(cfg, "n_routed_experts", None)
    return {n for n, p in model.named_parameters() if p.dim() == 3 and p.shape[0] == experts}


def arena_ptrs(handle) -> list[tuple[int, int]]:
    """(start, end) of each host group's region in the arena."""
    groups = len(handle.engine.groups) + len(handle.engine.uva_groups)
    regions = [handle.engine.arena.region(g) for g in range(groups)]
    return [(r.data_ptr(), r.data_ptr() + r.numel()) for r in regions]


def in_arena(t: torch.Tensor, ranges) -> bool:
    return any(lo <= t.data_ptr() < hi for lo, hi in ranges)


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("name", MOE)
def test_experts_read_in_place_with_the_rest_resident_is_exact(name, streamed):
    """Every block with routed experts reads them in place; with `streamed`, the first such block
    streams instead, so zero-copy and streamed blocks mix in one forward."""
    ref, model, inputs = build(name)
    cost = prepare(model, gpu_memory=2**40, device="cpu").cost
    apart = tuple(i for i in range(len(cost.block_bytes)) if cost.experts_apart(i))
    assert apart, "the zoo model's experts are not recognized as routed"
    stream = apart[:1] if streamed else ()
    uva = tuple(i for i in apart if i not in stream)
    placement = placement_of(cost, stream, len(stream), uva, uva_experts=uva)
    assert placement.uva_bytes == sum(cost.routed_bytes[i] for i in uva)
    handle = ws.offload(model, gpu_memory=placement.gpu_bytes, device="cpu", placement=placement)
    assert handle.placement.uva_experts == uva
    stats = handle.stats
    assert stats.uva_bytes == placement.uva_bytes
    assert stats.resident_bytes + stats.streamed_bytes + stats.uva_bytes == weight_bytes(ref)
    ranges = arena_ptrs(handle)
    routed = routed_names(ref)
    for pname, _ in ref.named_parameters():
        if any(pname.startswith(block + ".") for block in handle.uva_blocks):
            # in the arena (read in place) exactly when it is a routed expert tensor
            assert in_arena(_live(model, pname), ranges) == (pname in routed), pname
    for _ in range(2):
        assert same(call(model, inputs), call(ref, inputs))
    assert stats.misses == 0
    handle.restore()
    assert same(call(model, inputs), call(ref, inputs))


def _live(model, name: str) -> torch.Tensor:
    """The tensor the kernels read for parameter `name` (its attribute, not `named_parameters`' true
    copy)."""
    *path, attr = name.split(".")
    module = model
    for part in path:
        module = getattr(module, part)
    return module._parameters[attr]


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v2", "gpt_oss"])
def test_the_planner_reads_experts_in_place_at_decode_and_stays_exact(name):
    """The planner's own choice at a budget between the dense bytes and the whole model: at one token
    it keeps dense tensors resident and reads routed experts in place."""
    ref, model, inputs = build(name)
    cost = prepare(model, gpu_memory=2**40, device="cpu").cost
    dense = cost.fixed_bytes + sum(b - r for b, r in zip(cost.block_bytes, cost.routed_bytes, strict=True))
    budget = dense + max(cost.routed_bytes) // 2  # room for every dense tensor, not for a whole block more
    handle = ws.offload(model, gpu_memory=budget, device="cpu", strategy="uva", tokens=1)
    assert handle.placement.uva_experts, handle.placement
    assert handle.placement.gpu_bytes <= budget
    for _ in range(2):
        assert same(call(model, inputs), call(ref, inputs))


def reached_per_router(model, inputs) -> list[tuple[int, int]]:
    """(distinct experts reached, tokens) of each router call in one forward of `model`, from hooks of
    the test's own on the routers' outputs."""
    seen = []
    hooks = [m.register_forward_hook(lambda m, a, out: seen.append((out[-1].unique().numel(),
                                                                     out[-1].shape[0])))
             for m in model.modules() if type(m).__name__.lower().endswith("router")]
    call(model, inputs)
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v2", "gpt_oss"])
def test_stats_count_expert_bytes_read_per_token_only_when_asked(name):
    """Zero-copy experts cost the experts the tokens reached; a streamed block's experts all of them,
    every call. Nothing is counted (no hooks) until count_experts(), nor after count_experts(False)."""
    ref, model, inputs = build(name)
    cost = prepare(model, gpu_memory=2**40, device="cpu").cost
    apart = tuple(i for i in range(len(cost.block_bytes)) if cost.experts_apart(i))
    stream, uva = apart[:1], apart[1:]
    placement = placement_of(cost, stream, 1, uva, uva_experts=uva)
    handle = ws.offload(model, gpu_memory=placement.gpu_bytes, device="cpu", placement=placement)
    routers = [m for m in model.modules() if type(m).__name__.lower().endswith("router")]
    call(model, inputs)
    assert handle.stats.expert_bytes_per_token is None
    assert not any(r._forward_hooks for r in routers)
    handle.count_experts()
    for _ in range(2):
        assert same(call(model, inputs), call(ref, inputs))
    reached = reached_per_router(ref, inputs)  # the routers of blocks apart, in order
    tokens = reached[0][1]
    moe_blocks = list(apart)
    expected = 0.0
    for block, (distinct, _) in zip(moe_blocks, reached, strict=True):
        per_expert = cost.routed_bytes[block] / cost.experts
        expected += cost.routed_bytes[block] if block in stream else distinct * per_expert
    assert handle.stats.expert_bytes_per_token == pytest.approx(expected / tokens)
    handle.count_experts(False)
    assert handle.stats.expert_bytes_per_token is None and not any(r._forward_hooks for r in routers)
    handle.count_experts()
    handle.restore()
    assert not any(r._forward_hooks for r in routers)


_BUILT: dict[str, tuple] = {}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(["mixtral", "deepseek_v2", "gpt_oss"]), fraction=st.floats(0.05, 1.0),
       tokens=st.sampled_from([1, 8, 2048]), strategy=st.sampled_from(["auto", "uva"]))
def test_every_placement_the_planner_returns_for_a_moe_is_exact(name, fraction, tokens, strategy):
    """Over budgets, tokens and strategies: whatever the planner returns (experts apart or not, mixes
    with streamed blocks) fits the budget, places every tensor once, and is exact."""
    if name not in _BUILT:
        _BUILT[name] = build(name)[::2]  # (reference, inputs)
    ref, inputs = _BUILT[name]
    model = copy.deepcopy(ref)
    budget = int(weight_bytes(ref) * fraction)
    try:
        handle = ws.offload(model, gpu_memory=budget, device="cpu", strategy=strategy, tokens=tokens)
    except ws.BudgetError:
        return
    p, stats = handle.placement, handle.stats
    assert p.gpu_bytes <= budget and set(p.uva_experts) <= set(p.uva)
    assert stats.resident_bytes + stats.streamed_bytes + stats.uva_bytes == weight_bytes(ref)
    assert stats.uva_bytes == p.uva_bytes
    assert same(call(model, inputs), call(ref, inputs))
    handle.restore()
