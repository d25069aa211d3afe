"""Models beyond decoder-only LLMs (tests/model_zoo.py): diffusion transformers whose blocks take and
return several streams, a UNet and a VAE whose blocks run out of module order, CLIP's two towers,
Jamba's mixed layer list, a root nn.Sequential. Every block streams; eager and
torch.compile(fullgraph=True) outputs are bit-identical to the resident model run the same way, with
no added graph breaks and no misses once the run order is learned."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import with_boundaries
from model_zoo import ZOO, call, same

import weightstream as ws
from weightstream.placement.blocks import find_blocks
from weightstream.placement.plan import placement_of
from weightstream.placement.prepare import prepare

pytest.importorskip("diffusers")


def build(name: str):
    model, inputs = ZOO[name]()
    model = model.eval().requires_grad_(False)
    return model, copy.deepcopy(model), inputs


def stream_every_block(model, n_slots: int = 2):
    cost = prepare(model, gpu_memory=2**40, device="cpu").cost
    n = len(cost.block_bytes)
    placement = placement_of(cost, tuple(range(n)), min(n_slots, n))
    return ws.offload(model, gpu_memory=placement.gpu_bytes, device="cpu", placement=placement)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ZOO))
def test_eager_exact_and_no_misses_once_the_order_is_learned(name):
    ref, model, inputs = build(name)
    handle = stream_every_block(model)
    assert handle.stats.groups == len(find_blocks(ref)) >= 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the first forward may learn the run order
        for _ in range(2):
            assert same(call(model, inputs), call(ref, inputs))
    misses, prologues = handle.stats.misses, handle.stats.prologues
    for _ in range(2):
        assert same(call(model, inputs), call(ref, inputs))
    assert handle.stats.misses == misses  # learned: every later forward prefetches in run order
    assert handle.stats.prologues == prologues  # and starts with what the forward before prefetched
    handle.restore()
    assert same(call(model, inputs), call(ref, inputs))


# (name, whether Inductor fuses across block edges in the resident model, so that only the reference
# with the ops at the same edges compiles to the same kernels). The decoders whose rotary cos/sin every
# layer takes: the resident graph recomputes them inside each layer's kernels, the ops make them a
# stored input (docs/exactness.md)
COMPILED = [("flux", False), ("sd3", False), ("wan", True), ("unet", True), ("vae", True), ("clip", False),
            ("t5_encoder", False), ("sequential", False)]
SLOW_COMPILED = [("qwen3", True), ("qwen3_moe", True), ("gemma3_text", True), ("falcon_h1", True),
                 ("llama_static_cache", True)]


@pytest.mark.parametrize("name, fuses",
                         COMPILED + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW_COMPILED])
@pytest.mark.slow
def test_compiled_fullgraph_exact_with_no_added_graph_breaks(name, fuses):
    ref, model, inputs = build(name)
    edges = with_boundaries(copy.deepcopy(ref))
    handle = stream_every_block(model)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cref, cedges = torch.compile(ref, fullgraph=True), torch.compile(edges, fullgraph=True)
    cmodel = torch.compile(model, fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            out = call(cmodel, inputs)
            assert same(out, call(cedges, inputs))
            assert same(out, call(cref, inputs)) != fuses  # where it differs, only the fusion does
    assert not torch._dynamo.utils.counters["graph_break"]
    misses = handle.stats.misses
    assert same(call(cmodel, inputs), call(cedges, inputs))
    assert handle.stats.misses == misses


@pytest.mark.parametrize("name", ["t5", "whisper"])
def test_encoder_decoder_generate_is_exact_and_decoder_steps_start_prefetched(name):
    """A generate enters two passes (prologues) and never misses: the encoder's, which runs on into
    the first decoder step, and the second step's (the last generate went from its last step into the
    encoder, so that is what the first step's last releases prefetched). Every later step starts with
    its first groups copied by the step before."""
    from model_zoo import SEQ2SEQ

    ref, inputs = SEQ2SEQ[name]()
    ref = ref.eval().requires_grad_(False)
    model = copy.deepcopy(ref)
    handle = stream_every_block(model)
    tokens = 6
    kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            prologues = handle.stats.prologues
            assert torch.equal(model.generate(inputs, **kwargs), ref.generate(inputs, **kwargs))
            assert handle.stats.prologues - prologues == 2
    assert handle.stats.misses == 0
