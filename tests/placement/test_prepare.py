"""What `prepare` tells about the placement the planner chose for a real model: compress=True that
moves raw bytes over the link says so, and why."""

from __future__ import annotations

import warnings

import pytest
import torch
from model_zoo import ZOO

import weightstream as ws
from weightstream.placement.prepare import prepare


def qwen3(dtype=torch.bfloat16):
    model, _ = ZOO["qwen3"]()
    return model.to(dtype).eval().requires_grad_(False)


def block_bytes(model) -> int:
    return sum(prepare(model, gpu_memory=2**40, device="cpu", compress=False).cost.block_bytes)


def warned(model, share: float, compress) -> tuple[list[str], ws.Placement]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        budget = int(block_bytes(model) * share)
        handle = ws.offload(model, gpu_memory=budget, device="cpu", compress=compress)
    placement = handle.placement
    handle.restore()
    return [str(w.message) for w in caught if "compress=True" in str(w.message)], placement


@pytest.mark.parametrize("share", [0.3, 0.6])
def test_compress_true_that_moves_raw_bytes_says_so_and_what_to_change(share):
    """On the reference profile this model's budget of 30% fits only zero copy, 60% only raw streaming
    (not the landing buffers beside it): both move every byte raw, and offload says so."""
    messages, placement = warned(qwen3(), share, True)
    assert placement.kind != "resident" and not placement.compressed
    assert len(messages) == 1 and "fits the budget beside its landing buffers" in messages[0]
    assert "Give more gpu_memory" in messages[0]
    assert not warned(qwen3(), share, "auto")[0]  # auto chose raw as it may: nothing to say


def test_compress_true_where_it_compresses_or_nothing_moves_says_nothing():
    messages, placement = warned(qwen3(), 0.7, True)
    assert placement.compressed and not messages
    messages, placement = warned(qwen3(), 20.0, True)
    assert placement.kind == "resident" and not messages


def test_compress_true_on_weights_that_would_not_shrink_says_compress_false():
    messages, placement = warned(qwen3(torch.float32), 0.6, True)
    assert not placement.compressed
    assert len(messages) == 1 and "would not shrink" in messages[0] and "compress=False" in messages[0]


@pytest.mark.parametrize("asked", [dict(compress=True), dict(expert_copies=True),
                                   dict(expert_copies=True, compress=True)])
def test_compression_or_copies_asked_for_keep_a_model_that_fits_resident(asked):
    """Asked for, compression and expert copies are taken wherever they fit among placements that move
    bytes over the link; a budget that holds every block keeps them resident (streaming them to compress
    or copy them would only be slower)."""
    model, _ = ZOO["qwen3_moe"]()
    model = model.to(torch.bfloat16).eval().requires_grad_(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = ws.offload(model, gpu_memory=int(block_bytes(model) * 20), device="cpu", **asked)
    assert handle.placement.kind == "resident" and not caught
    handle.restore()


@pytest.mark.parametrize("asked, named", [(dict(expert_copies=True), "expert_copies=True"),
                                          (dict(routing_skew=1.5), "routing_skew=1.5"),
                                          (dict(routing_skew=0, expert_copies=True),
                                           "routing_skew=0 and expert_copies=True")])
def test_expert_options_on_a_model_without_routed_experts_say_they_are_ignored(asked, named):
    """A dense model has no routed experts to copy or cache: the options are named as ignored (from the
    place that called offload), and a mixture of experts given them says nothing of the kind."""
    budget = int(block_bytes(qwen3()) * 0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ws.offload(qwen3(), gpu_memory=budget, device="cpu", **asked).restore()
    ours = [w for w in caught if "not a mixture of experts" in str(w.message)]
    assert len(ours) == 1 and f"{named} ignored: Qwen3ForCausalLM" in str(ours[0].message)
    assert ours[0].filename == __file__
    moe, _ = ZOO["qwen3_moe"]()
    moe = moe.to(torch.bfloat16).eval().requires_grad_(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ws.offload(moe, gpu_memory=int(block_bytes(moe) * 0.5), device="cpu", **asked).restore()
    assert not [w for w in caught if "not a mixture of experts" in str(w.message)]
