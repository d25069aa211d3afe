"""Sliding-window layers (Gemma-3's alternating layers, Mistral's and Mixtral's windows, Qwen2's upper
layers): the sliding mask hides exactly the keys transformers' own mask function hides, measured in
position ids; each branch of a tree sees what a causal forward of that branch sees; greedy speculative
equals plain greedy for every draft; offloaded equals resident. Windows of 3-6 positions, so they cut
inside short generations."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import transformers as tf
from conftest import make_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_loop import off_gpu_blocks, offloaded, plain_greedy, repetitive_prompt, speculate_both
from test_verify import assert_branches_match_causal_forwards
from transformers.masking_utils import sliding_window_causal_mask_function

import weightstream as ws
from weightstream.speculative import SelfDraft
from weightstream.speculative.cache import TreeCache
from weightstream.speculative.checks import attention_masks
from weightstream.speculative.tree import (
    TreeShape,
    path_moves,
    sliding_mask,
    tree_from_chains,
    tree_mask,
    tree_positions,
)
from weightstream.speculative.verify import TreeForward

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
ARCHS = ["gemma3", "mistral", "qwen2", "mixtral"]


def sliding_config(arch: str, window: int):
    """A tiny config whose layers attend over `window` positions (Gemma-3 and Qwen2: half of them)."""
    if arch == "gemma3":
        return tf.Gemma3TextConfig(**COMMON, head_dim=16, query_pre_attn_scalar=16, sliding_window=window,
                                   layer_types=["sliding_attention", "full_attention"] * 2)
    if arch == "mistral":
        return tf.MistralConfig(**COMMON, sliding_window=window)
    if arch == "qwen2":
        return tf.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=window, max_window_layers=2)
    if arch == "mixtral":
        return tf.MixtralConfig(**COMMON, sliding_window=window, num_local_experts=4, num_experts_per_tok=2)
    raise ValueError(arch)


def sliding_model(arch: str, window: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(sliding_config(arch, window))
    return model.eval().requires_grad_(False)


@pytest.mark.parametrize("arch, kind", [("gemma3", "per-layer-type"), ("mistral", "sliding"),
                                        ("qwen2", "per-layer-type"), ("mixtral", "sliding")])
def test_each_architecture_gets_the_masks_its_forward_takes(arch, kind):
    masks = attention_masks(sliding_model(arch, 5))
    assert masks.kind == kind and masks.window == 5
    assert attention_masks(make_model("mistral")).kind == "full"  # sliding_window=None
    assert attention_masks(make_model("llama")).kind == "full"


@settings(max_examples=200, deadline=None)
@given(window=st.integers(1, 10), prefix=st.integers(0, 14), width=st.integers(1, 3), depth=st.integers(0, 5),
       chains=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=5), max_size=6),
       accepted=st.integers(0, 5))
def test_the_sliding_mask_hides_exactly_what_transformers_mask_function_hides(window, prefix, width, depth,
                                                                              chains, accepted):
    shape = TreeShape(width, depth)
    tree = tree_from_chains(7, chains, shape)
    length = prefix + shape.tokens + 3
    cache = TreeCache(1, length)
    cache.record_positions(torch.arange(prefix), torch.arange(prefix))
    slots = torch.arange(shape.tokens) + prefix
    queries = tree_positions(shape, prefix)
    cache.record_positions(slots, queries)
    got = sliding_mask(tree_mask(tree, prefix, length), queries, cache.slot_positions, window)

    allow = sliding_window_causal_mask_function(window)
    parents = tree.parents.tolist()
    for node in range(shape.tokens):
        if not tree.valid[node]:  # padding: never accepted, sees itself (no row of the mask is empty)
            assert got[node, prefix + node]
            continue
        branch, at = [], node  # the node's ancestors, root first: the sequence a causal forward sees
        while at >= 0:
            branch.insert(0, prefix + at)
            at = parents[at]
        sequence = list(range(prefix)) + branch  # sequence index = position id
        want = torch.zeros(length, dtype=torch.bool)
        q = len(sequence) - 1
        for k, slot in enumerate(sequence):
            want[slot] = bool(allow(0, 0, torch.tensor(q), torch.tensor(k)))
        assert torch.equal(got[node], want), (node, sequence)

    # the accepted path moved into place: committed slots hold their own positions again
    walk, at = [0], 0
    while len(walk) <= accepted and tree.children(at):
        at = tree.children(at)[0]
        walk.append(at)
    cache.move(*path_moves(walk, prefix, depth))
    assert torch.equal(cache.slot_positions[:prefix + len(walk)], torch.arange(prefix + len(walk)))


@pytest.mark.parametrize("arch", ARCHS)
def test_each_branch_of_a_tree_sees_what_a_causal_forward_of_that_branch_sees(arch):
    model = sliding_model(arch, window=4)
    prefix = torch.tensor([5, 9, 33, 17, 2, 60, 61, 3, 8])
    branches = [[4, 8, 15, 1], [4, 16], [23, 42, 7, 9]]
    shape = TreeShape(3, 4)
    tree = tree_from_chains(11, branches, shape)
    start = prefix.numel()
    cache = TreeCache(model.config.num_hidden_layers, 40)
    forward = TreeForward(model, cache, torch.device("cpu"), model.dtype)
    forward.prefill(prefix)
    logits = forward.run(tree.tokens, tree_positions(shape, start), torch.arange(shape.tokens) + start,
                         tree_mask(tree, start, 40))
    assert_branches_match_causal_forwards(model, prefix, tree, 11, branches, logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_window_cuts_inside_these_generations(arch):
    model = sliding_model(arch, window=4)
    wide = copy.deepcopy(model)
    wide.config.sliding_window = 1000
    for module in wide.modules():
        if getattr(module, "sliding_window", None):
            module.sliding_window = 1000
    ids = repetitive_prompt(3)
    assert not torch.equal(plain_greedy(model, ids, 16), plain_greedy(wide, ids, 16))


@pytest.mark.parametrize("arch, draft", [(arch, draft) for arch in ARCHS
                                         for draft in ("prompt-lookup", "copy", "self", None)]
                         + [("gemma3", "other")])  # a draft accepting nothing: many passes, one arch
def test_greedy_speculative_equals_plain_greedy(arch, draft):
    model = sliding_model(arch, window=4)
    drafts = {"copy": copy.deepcopy(model), "other": sliding_model(arch, window=4, seed=7)}
    ids = repetitive_prompt(3)
    out = ws.generate(model, ids, 16, draft=drafts.get(draft, draft), width=2, depth=4, eos_token_id=[])
    assert torch.equal(out.tokens, plain_greedy(model, ids, 16))
    if draft in ("copy", "self"):
        assert sum(out.stats.accepted) > 0


@pytest.fixture(scope="module")
def gemma3_models():
    return {"copy": sliding_model("gemma3", window=3), "other": sliding_model("gemma3", window=3, seed=7)}


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), length=st.integers(1, 20), alphabet=st.integers(2, 128),
       width=st.integers(1, 3), depth=st.integers(1, 5),
       draft=st.sampled_from(["prompt-lookup", "copy", "other", "self"]))
def test_gemma3_greedy_speculative_equals_plain_greedy_over_prompts_and_trees(gemma3_models, seed, length,
                                                                              alphabet, width, depth, draft):
    model = gemma3_models["copy"]
    ids = repetitive_prompt(seed, length, alphabet)
    draft = SelfDraft(group=64) if draft == "self" else gemma3_models.get(draft, draft)
    out = ws.generate(model, ids, 10, draft=draft, width=width, depth=depth, eos_token_id=[])
    assert torch.equal(out.tokens, plain_greedy(model, ids, 10))


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("draft", ["prompt-lookup", "model", "self"])
@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_offloaded_equals_resident(arch, draft, do_sample):
    ref = sliding_model(arch, window=4)
    model = offloaded(copy.deepcopy(ref))

    def draft_for(target):
        return {"model": lambda: sliding_model(arch, window=4, seed=0 if do_sample else 1),
                "self": lambda: SelfDraft(bits=4, group=64, blocks=off_gpu_blocks(model))}.get(
                    draft, lambda: draft)()

    speculate_both(ref, model, draft_for, do_sample)


@pytest.mark.slow
def test_compiled_fullgraph_gemma3_has_no_graph_break_and_equals_eager():
    model = sliding_model("gemma3", window=4)
    ids = repetitive_prompt(0, 20)
    gc.collect()  # earlier tests' dropped engines go now, not in the middle of the trace
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = ws.generate(model, ids, 12, draft=copy.deepcopy(model), width=2, depth=3, compile=True,
                           eos_token_id=[])
    assert not torch._dynamo.utils.counters["graph_break"]
    assert torch.equal(compiled.tokens, plain_greedy(model, ids, 12))
