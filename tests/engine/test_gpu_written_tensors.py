"""Tensors a model writes, weights edited in place, hooks that read weights and the check mode on a real
GPU (tests/engine/test_written_tensors.py on the CPU backend): copies on a side stream make a lost write show
differently, so each behaviour runs here too, with placements forced (every block streams)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from test_written_tensors import D, KVBlock, Plain, chain, linear_chain, same_state, steering, steering_pre
from torch import nn

import weightstream as ws
from weightstream.errors import OffloadStateError
from weightstream.placement.plan import placement_of
from weightstream.placement.prepare import prepare
from weightstream.placement.timing import capture_graph

pytestmark = pytest.mark.gpu
HEADROOM = 1 << 20


def on_gpu(ref: nn.Module, n_slots: int, **kwargs):
    """`ref` moved to the GPU (resident reference) and a copy with every block streaming."""
    ref = ref.cuda()
    model = copy.deepcopy(ref).cpu()
    cost = prepare(model, gpu_memory=2**40, device="cuda").cost
    placement = placement_of(cost, tuple(range(len(model.layers))), n_slots)
    before = torch.cuda.memory_allocated()
    handle = ws.offload(model, gpu_memory=placement.gpu_bytes + HEADROOM, device="cuda",
                        placement=placement, **kwargs)
    # what streams is not on the GPU: at most the staging slots and the resident rest were added
    assert torch.cuda.memory_allocated() - before <= placement.gpu_bytes + 4096
    assert handle.stats.streamed_bytes > 0
    return ref, model, handle


@pytest.mark.parametrize("n_slots", [1, 2])
def test_a_kv_cache_in_buffers_is_exact_over_prefill_and_decode_on_the_gpu(n_slots):
    ref, model, handle = on_gpu(chain(KVBlock), n_slots)
    prompt = torch.randn(4, D, device="cuda")
    pos = torch.arange(4, device="cuda")
    with pytest.warns(UserWarning, match="is written in place by block"):
        assert torch.equal(model(prompt, pos), ref(prompt, pos))
    for step in range(4, 8):
        x, p = torch.randn(1, D, device="cuda"), torch.tensor([step], device="cuda")
        assert torch.equal(model(x, p), ref(x, p))
    assert handle.stats.resident_bytes == 4 * 8 * D * 4
    assert same_state(model, ref)
    handle.restore()
    assert same_state(model, ref)


def test_state_then_compile_and_a_cuda_graph_are_exact():
    ref, model, _ = on_gpu(chain(KVBlock), 2)
    x, pos = torch.randn(2, D, device="cuda"), torch.arange(2, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(model(x, pos), ref(x, pos))  # the caches move to resident storage here
    torch._dynamo.reset()
    compiled, compiled_ref = torch.compile(model, fullgraph=True), torch.compile(ref, fullgraph=True)
    for _ in range(2):
        assert torch.equal(compiled(x, pos), compiled_ref(x, pos))
    with torch.no_grad():
        replay = capture_graph(lambda t: model(t, pos), x)
        replay_ref = capture_graph(lambda t: ref(t, pos), x)
        for _ in range(2):
            assert torch.equal(replay(), replay_ref())
    torch.cuda.synchronize()
    assert same_state(model, ref)


def test_an_outside_write_is_refused_and_discarded_on_the_gpu():
    ref, model, _ = on_gpu(linear_chain(), 2)
    x = torch.randn(3, D, device="cuda")
    assert torch.equal(model(x), ref(x))
    with torch.no_grad():
        model.layers[3][0].weight.mul_(2)
    with pytest.raises(OffloadStateError, match=r"layers\.3\.0\.weight was written in place"):
        model(x)
    for _ in range(2):
        assert torch.equal(model(x), ref(x))


def test_peft_merge_inside_edit_equals_the_resident_model_merged_on_the_cpu():
    """edit() runs the merge on the CPU, where offloaded weights live: the reference merges there too."""
    from test_written_tensors import lora_twins

    ref, model, _ = lora_twins(2)  # offloaded on the CPU backend there: offload this one on the GPU
    ws.handle_of(model).restore()
    cost = prepare(model, gpu_memory=2**40, device="cuda").cost
    placement = placement_of(cost, tuple(range(4)), 2)
    handle = ws.offload(model, gpu_memory=placement.gpu_bytes, device="cuda", placement=placement)
    ids = torch.randint(0, 128, (1, 8))
    with handle.edit():
        model.merge_adapter()
    ref.merge_adapter()
    ref = ref.cuda()
    assert handle.stats.streamed_bytes > 0
    assert torch.equal(model(ids.cuda()).logits, ref(ids.cuda()).logits)
    assert same_state(model, ref)


@pytest.mark.parametrize("compiled", [False, True])
def test_hooks_see_their_blocks_weights_on_the_gpu(compiled):
    ref, model, _ = on_gpu(chain(Plain), 2)
    log, ref_log = [], []
    for m, out in ((model, log), (ref, ref_log)):
        for layer in m.layers:
            layer.register_forward_pre_hook(steering_pre, with_kwargs=True)
            layer.register_forward_hook(steering)
            if not compiled:
                layer.register_forward_hook(lambda mod, a, o, out=out: out.append(mod.lin.weight.clone()))
    x = torch.randn(3, D, device="cuda")
    if compiled:
        torch._dynamo.reset()
        model, ref = torch.compile(model, fullgraph=True), torch.compile(ref, fullgraph=True)
    for _ in range(2):
        assert torch.equal(model(x), ref(x))
    assert len(log) == len(ref_log) and all(torch.equal(a, b) for a, b in zip(log, ref_log, strict=True))


def test_check_mode_catches_a_write_through_data_on_the_gpu():
    ref, model, _ = on_gpu(linear_chain(), 2, check=True)
    x = torch.randn(3, D, device="cuda")
    assert torch.equal(model(x), ref(x))
    torch.cuda.synchronize()  # the next forward's first copies are in flight: let them land first
    model.layers[1][0].weight.data.add_(1)
    with pytest.raises(OffloadStateError, match=r"check: before block layers\.1 ran"):
        model(x)
