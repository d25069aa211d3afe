"""A model that another offloader manages is refused with what to do, not offloaded into a fight over
its weights: diffusers' group offloading and accelerate's hooks (what `enable_model_cpu_offload` and
`enable_sequential_cpu_offload` install). Found on 2026-12-05: a pipeline whose transformer had group
offloading was offloaded without a word and its generation then failed deep inside diffusers' hooks."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import weight_bytes
from model_zoo import ZOO, call, same

import weightstream as ws
from weightstream.errors import OffloadStateError


def tiny_flux():
    model, inputs = ZOO["flux"]()
    return model.eval().requires_grad_(False), inputs


@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
def test_diffusers_group_offloading_is_refused_naming_where_it_is(offload_type):
    """Refused, naming the module the hooks are on (block level: the model; leaf level: its first leaf),
    and nothing offloaded: the model still runs under diffusers' hooks as before."""
    from diffusers.hooks import apply_group_offloading

    ref, inputs = tiny_flux()
    model = copy.deepcopy(ref)
    cpu = torch.device("cpu")
    apply_group_offloading(model, onload_device=cpu, offload_device=cpu, offload_type=offload_type,
                           **({"num_blocks_per_group": 1} if offload_type == "block_level" else {}))
    with pytest.raises(OffloadStateError, match="diffusers' group offloading") as raised:
        ws.offload(model, gpu_memory=weight_bytes(ref) // 2, device="cpu")
    where = "the model (FluxTransformer2DModel)" if offload_type == "block_level" else "module '"
    assert where in str(raised.value)
    assert same(call(model, inputs), call(ref, inputs))


@pytest.mark.parametrize("how", ["cpu_offload", "cpu_offload_with_hook"])
def test_accelerate_hooks_are_refused_with_how_to_remove_them(how):
    import accelerate
    from accelerate.hooks import remove_hook_from_module

    ref, inputs = tiny_flux()
    model = copy.deepcopy(ref)
    cpu = torch.device("cpu")
    if how == "cpu_offload":  # enable_sequential_cpu_offload's: every leaf's weights moved per forward
        accelerate.cpu_offload(model, execution_device=cpu)
    else:  # enable_model_cpu_offload's: the whole model moved to the device when called
        accelerate.cpu_offload_with_hook(model, execution_device=cpu)
    with pytest.raises(OffloadStateError, match="accelerate hooks") as raised:
        ws.offload(model, gpu_memory=weight_bytes(ref) // 2, device="cpu")
    assert "remove_hook_from_module(model, recurse=True)" in str(raised.value)
    if how == "cpu_offload_with_hook":  # its weights never left the model: removing the hook is enough
        remove_hook_from_module(model, recurse=True)
        ws.offload(model, gpu_memory=weight_bytes(ref) // 2, device="cpu")
        assert same(call(model, inputs), call(ref, inputs))


def test_a_pipeline_names_the_component_another_offloader_manages():
    """`ws.offload(pipe)` says which component: the error a diffusers user gets after
    `pipe.transformer.enable_group_offload(...)`."""
    from test_pipeline import tiny_flux_pipeline

    pipe = tiny_flux_pipeline()
    cpu = torch.device("cpu")
    pipe.transformer.enable_group_offload(onload_device=cpu, offload_device=cpu, offload_type="block_level",
                                          num_blocks_per_group=1)
    with pytest.raises(OffloadStateError, match=r"^pipe\.transformer: .*group offloading"):
        ws.offload(pipe, gpu_memory="1MB", device="cpu")


def test_a_block_whose_forward_is_replaced_on_the_module_is_refused():
    """An instance-level `forward` (diffusers' caching hooks, or code assigning it) calls the block's
    class forward and would bypass the streaming forward: found on 2026-12-05, such a Flux model
    offloaded silently gave wrong outputs (its blocks computed from whatever the slots held)."""
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache

    ref, inputs = tiny_flux()
    cached = copy.deepcopy(ref)
    apply_first_block_cache(cached, FirstBlockCacheConfig(threshold=0.0))
    with pytest.raises(OffloadStateError, match=r"block 'transformer_blocks\.0'.*diffusers hooks \(fbc"):
        ws.offload(cached, gpu_memory=weight_bytes(ref) // 2, device="cpu")

    assigned = copy.deepcopy(ref)
    block = assigned.single_transformer_blocks[1]
    original = block.forward
    block.forward = lambda *args, **kwargs: original(*args, **kwargs)
    with pytest.raises(OffloadStateError, match=r"block 'single_transformer_blocks\.1'.*assignment"):
        ws.offload(assigned, gpu_memory=weight_bytes(ref) // 2, device="cpu")


def test_a_replaced_forward_outside_the_blocks_is_kept_and_exact():
    """Only the blocks' own forward matters: one replaced on a module inside a block, or on the model,
    still runs (the block's streaming forward calls it) and the output is exact."""
    ref, inputs = tiny_flux()
    model = copy.deepcopy(ref)
    calls = []
    for module in (model.transformer_blocks[0].ff, model.norm_out):
        original = module.forward
        module.forward = lambda *args, _f=original, **kwargs: calls.append(1) or _f(*args, **kwargs)
    handle = ws.offload(model, gpu_memory=weight_bytes(ref) // 2, device="cpu", strategy="stream")
    assert 0 in handle.placement.streamed  # the block holding the replaced `ff` streams
    assert same(call(model, inputs), call(ref, inputs)) and len(calls) == 2


def test_diffusers_layerwise_casting_is_refused():
    """enable_layerwise_casting keeps the weights in a storage dtype and recasts them in every forward
    (`module.to`), which would rewrite the streamed weights: refused when offloading, naming it."""
    ref, inputs = tiny_flux()
    model = copy.deepcopy(ref)
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    with pytest.raises(OffloadStateError, match=r"layerwise casting .*\(layerwise_casting hooks\)"):
        ws.offload(model, gpu_memory=weight_bytes(ref) // 2, device="cpu")
