"""Editing an offloaded mixture of experts (`handle.edit()`): the placement kept across an edit that
changes block sizes (expert copies coded or raw, a GPU expert cache, compressed streamed blocks), and
weight writes to routed experts reaching every later forward, `state_dict()` and `restore()`, each
against the resident model edited the same way (`torch.equal`), on the CPU backend."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from model_zoo import call, same
from test_coded_copies import bf16_model
from test_expert_cache import inputs_like, restores_true_state

import weightstream as ws
from weightstream.engine.coded_experts import CodedCopy
from weightstream.engine.expert_cache import ExpertCache, ExpertCopy
from weightstream.placement.plan import placement_of, predict_placement
from weightstream.placement.prepare import prepare

HEADROOM = 1 << 16  # budget beyond the forced placement: room for the adapters an edit adds

# the placements kept across an edit: what each names beside the blocks read for their experts
KINDS = {
    "coded copies": dict(expert_copies=True, coded_copies=True),
    "raw copies": dict(expert_copies=True),
    "cache": dict(expert_cache=True, expert_slots=2),
    "compressed streamed": dict(streamed=True, compressed=True),
}


def forced(model, kind: str):
    """A placement of `kind` for the zoo model `model`: blocks 0 and 2 read for their routed experts,
    and (streamed kinds) blocks 1 and 3 streamed through one slot."""
    cost = prepare(model, gpu_memory=2**40, device="cpu", compress=True).cost
    args = dict(KINDS[kind])
    uva = (0, 2)
    streamed = (1, 3) if args.pop("streamed", False) else ()
    for key in ("expert_copies", "expert_cache"):
        if args.get(key):
            args[key] = uva
    return placement_of(cost, streamed, 1 if streamed else 0, uva, uva_experts=uva, **args)


def add_lora(model) -> None:
    """A LoRA adapter on the attention projections, drawn from a fixed seed (non-zero): every block
    grows, so the edit plans its placement again."""
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(3)
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
                            model)
    model.eval().requires_grad_(False)


def kept(p) -> tuple:
    """What a placement decides, its sizes aside."""
    return (p.streamed, p.n_slots, p.uva, p.part, p.uva_experts, p.expert_cache, p.expert_slots,
            p.expert_copies, bool(p.copy_landing_bytes), p.compressed, p.landing_buffers,
            p.requested_strategy)


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_edit_that_resizes_blocks_keeps_the_placement_and_stays_exact(kind):
    """An adapter added inside `edit()` resizes every block: the same blocks stay streamed, read in
    place, copied (coded copies still coded), cached or compressed, the slots and landing buffers
    resized, predicted for the tokens and profile the offload was given; outputs equal the resident
    model given the same adapter."""
    model, inputs = bf16_model("mixtral")
    placement = forced(model, kind)
    ref = copy.deepcopy(model)
    profile = dataclasses.replace(ws.REFERENCE_PROFILE, expert_sync_seconds=1e-3)
    handle = ws.offload(model, gpu_memory=placement.gpu_bytes + HEADROOM, device="cpu", placement=placement,
                        tokens=4, profile=profile)
    assert same(call(model, inputs), call(ref, inputs))
    with handle.edit():
        add_lora(model)
    add_lora(ref)
    after = handle.placement
    assert after.resident_bytes > placement.resident_bytes  # resized, not the same placement
    assert kept(after) == kept(placement)
    cost = prepare(ref, gpu_memory=2**40, device="cpu", compress=True).cost  # the edited blocks' sizes
    assert after.prediction == predict_placement(cost, after, 4, profile)
    caches = handle.expert_caches
    want = {"coded copies": CodedCopy, "raw copies": ExpertCopy, "cache": ExpertCache}.get(kind)
    assert (caches is None) if want is None else all(type(c) is want for c in caches.caches)
    if kind == "coded copies":
        assert handle.stats.expert_wire_ratio < 0.95
    for seed in range(3):
        batch = inputs_like(inputs, seed)
        assert same(call(model, batch), call(ref, batch)), seed
    restores_true_state(handle, model, ref, inputs)


def test_an_edit_whose_blocks_outgrow_the_placement_says_it_places_the_model_anew():
    """Without room in the budget for what the edit adds, the placement cannot be kept: a warning says
    the planner placed the model anew (it no longer copies experts), and outputs stay exact."""
    model, inputs = bf16_model("mixtral")
    placement = forced(model, "coded copies")
    ref = copy.deepcopy(model)
    handle = ws.offload(model, gpu_memory=placement.gpu_bytes, device="cpu", placement=placement)
    with pytest.warns(UserWarning, match="no longer fits gpu_memory=.*the planner places the model anew"):
        with handle.edit():
            add_lora(model)
    add_lora(ref)
    assert handle.placement.gpu_bytes <= placement.gpu_bytes
    assert same(call(model, inputs), call(ref, inputs))
    handle.restore()


@pytest.mark.parametrize("how", ["rebind", "data"])
@pytest.mark.parametrize("kind", ["coded copies", "raw copies", "cache"])
def test_an_expert_weight_given_new_memory_between_forwards_is_the_models_from_then_on(kind, how):
    """An expert weight rebound to a new parameter, or given new memory through `.data =` (the object
    kept), between forwards, as on the resident model: later forwards, `state_dict()` and the restored
    model all hold the new weight (restore() put the `.data` one back on its old host bytes)."""
    model, inputs = bf16_model("mixtral")
    placement = forced(model, kind)
    ref = copy.deepcopy(model)
    handle = ws.offload(model, gpu_memory=placement.gpu_bytes + HEADROOM, device="cpu", placement=placement)
    call(model, inputs)
    for m in (model, ref):
        experts = m.model.layers[2].mlp.experts
        new = torch.randn(experts.gate_up_proj.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
        if how == "rebind":
            experts.gate_up_proj = torch.nn.Parameter(new, requires_grad=False)
        else:
            experts.gate_up_proj.data = new
    for seed in range(2):
        batch = inputs_like(inputs, seed)
        assert same(call(model, batch), call(ref, batch)), seed
    restores_true_state(handle, model, ref, inputs)
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("via", ["parameters", "state_dict"])
@pytest.mark.parametrize("kind", ["cache", "raw copies"])
def test_a_write_through_the_true_weights_given_reaches_forwards_past_a_filled_cache(kind, via):
    """Raw routed experts' true weights (from parameters() or state_dict()) are views of their host
    bytes, so a write to them is the model's, as resident: the cache's slots, filled before it, are
    emptied and filled again (they served the old bytes), and copies read the new ones."""
    model, inputs = bf16_model("mixtral")
    placement = forced(model, kind)
    ref = copy.deepcopy(model)
    handle = ws.offload(model, gpu_memory=placement.gpu_bytes + HEADROOM, device="cpu", placement=placement)
    for seed in range(3):
        call(model, inputs_like(inputs, seed))  # the cache holds its experts
    name = "model.layers.2.mlp.experts.gate_up_proj"
    with torch.no_grad():
        for m in (model, ref):
            (dict(m.named_parameters()) if via == "parameters" else m.state_dict())[name].mul_(2)
    for seed in range(3):
        batch = inputs_like(inputs, seed)
        assert same(call(model, batch), call(ref, batch)), seed
    restores_true_state(handle, model, ref, inputs)


def test_a_write_to_a_coded_experts_true_weight_copy_is_refused_without_streamed_blocks():
    """Experts held coded give decoded copies: a write to one never reaches the weights. Refused at the
    next forward even where no block streams (the check ran at streamed blocks' waits only), and the
    forwards after it equal the resident model never written."""
    model, inputs = bf16_model("mixtral")
    placement = forced(model, "coded copies")
    assert not placement.streamed
    ref = copy.deepcopy(model)
    handle = ws.offload(model, gpu_memory=placement.gpu_bytes + HEADROOM, device="cpu", placement=placement)
    weight = dict(model.named_parameters())["model.layers.2.mlp.experts.gate_up_proj"]
    with torch.no_grad():
        weight.mul_(2)
    with pytest.raises(ws.OffloadStateError, match="gate_up_proj was written in place through the tensor"):
        call(model, inputs)
    for seed in range(2):
        batch = inputs_like(inputs, seed)
        assert same(call(model, batch), call(ref, batch)), seed
    restores_true_state(handle, model, ref, inputs)
