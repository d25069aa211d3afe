"""torch.compile(fullgraph=True) of mixtures of experts whose routed experts are copied (raw or coded) or
go through a GPU expert cache, on the CPU backend: graphs compiled for other models of the same classes
(the resident twin, the model itself before offload or after restore) are never reused for the
offloaded one, and with inductor the outputs equal the resident model compiled the same way."""

from __future__ import annotations

import copy

import pytest
import torch
from model_zoo import ZOO, call, same
from test_coded_copies import coded_offload
from test_expert_cache import cached_offload, inputs_like
from test_expert_copies import copies_offload


def offloaded(kind: str, model):
    if kind == "copies":
        return copies_offload(model)[0]
    if kind == "coded":
        return coded_offload(model)[0]
    return cached_offload(model, slots=2)[0]


def tiny(name: str, dtype: torch.dtype):
    model, inputs = ZOO[name]()
    return model.to(dtype).eval().requires_grad_(False), inputs


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


SLOW_KINDS = [pytest.param(kind, marks=pytest.mark.slow) for kind in ("coded", "cache")]


@pytest.mark.parametrize("kind", ["copies", *SLOW_KINDS])
def test_graphs_compiled_for_the_resident_twin_or_before_offload_are_not_reused(kind, fresh_dynamo):
    """The compiled model, compiled and called while resident, then offloaded, beside its resident twin
    compiled too (graphs are cached per function, shared by every model of a class): each call runs a
    graph compiled for what the model is now, so outputs equal the twin's, offloaded and after
    restore()."""
    model, inputs = tiny("mixtral", torch.bfloat16)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    twin = torch.compile(ref, backend="aot_eager", fullgraph=True)
    assert same(call(compiled, inputs), call(twin, inputs))  # compiled resident first
    handle = offloaded(kind, model)
    for seed in range(2):
        batch = inputs_like(inputs, seed)
        assert same(call(compiled, batch), call(twin, batch)), seed
    handle.restore()
    batch = inputs_like(inputs, 7)
    assert same(call(compiled, batch), call(twin, batch))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["copies", "coded", "cache"])
@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_inductor_output_equals_the_resident_model_compiled_the_same_way(name, kind, fresh_dynamo):
    """bf16 experts under inductor: the gather orders the experts after it through their hidden states
    and routing, and leaves the routing weights to be fused into the experts' weighting as resident
    (through the op they were stored in bf16 where the resident graph kept them in float32)."""
    model, inputs = tiny(name, torch.bfloat16)
    ref = copy.deepcopy(model)
    handle = offloaded(kind, model)
    compiled = torch.compile(model, fullgraph=True)
    twin = torch.compile(ref, fullgraph=True)
    for seed in range(2):
        batch = inputs_like(inputs, seed)
        assert same(call(compiled, batch), call(twin, batch)), seed
    handle.restore()
