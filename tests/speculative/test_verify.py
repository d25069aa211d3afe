"""The verify forward: one forward over a tree equals the model's own causal forward along each branch;
compiled with `fullgraph`, one graph per generation, offloaded equal to its resident reference."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from conftest import make_model, weight_bytes, with_boundaries

import weightstream as ws
from weightstream.speculative.cache import TreeCache
from weightstream.speculative.tree import TreeShape, tree_from_chains, tree_mask, tree_positions
from weightstream.speculative.verify import TreeForward, cache_keyword


def test_each_branch_of_a_tree_sees_what_a_causal_forward_of_that_branch_sees():
    model = make_model("llama")
    prefix = torch.tensor([5, 9, 33, 17, 2])
    branches = [[4, 8, 15], [4, 16], [23, 42, 7]]
    shape = TreeShape(3, 3)
    tree = tree_from_chains(11, branches, shape)
    cache = TreeCache(model.config.num_hidden_layers, 32)
    forward = TreeForward(model, cache, torch.device("cpu"), model.dtype)
    forward.prefill(prefix)
    logits = forward.run(tree.tokens, tree_positions(shape, 5), torch.arange(shape.tokens) + 5,
                         tree_mask(tree, 5, 32))
    assert_branches_match_causal_forwards(model, prefix, tree, 11, branches, logits)


def assert_branches_match_causal_forwards(model, prefix, tree, root: int, branches, logits) -> None:
    """Each branch's rows of a tree forward's `logits` (the root `root`, then the branch's tokens) are
    what a plain causal forward of prefix + root + branch gives at those positions."""
    for branch in branches:
        full = torch.cat([prefix, torch.tensor([root] + branch)])
        want = model(full[None]).logits[0, len(prefix):]
        node, rows = 0, [0]
        for token in branch:
            node = next(c for c in tree.children(node) if int(tree.tokens[c]) == token)
            rows.append(node)
        assert torch.allclose(logits[rows], want, atol=1e-5)
        assert torch.equal(logits[rows].argmax(-1), want.argmax(-1))


def test_the_cache_keyword_is_the_one_the_model_takes():
    model = make_model("llama")
    assert cache_keyword(model) in inspect.signature(model.forward).parameters


@pytest.mark.slow
def test_compiled_fullgraph_offloaded_equals_the_resident_reference_with_one_graph_per_generation():
    ref = make_model("llama")
    model = copy.deepcopy(ref)
    ws.offload(model, gpu_memory=int(weight_bytes(model) * 0.5), device="cpu", strategy="stream")
    reference = with_boundaries(copy.deepcopy(ref))  # docs/exactness.md: the rotary cos/sin of a static cache
    ids = torch.randint(0, 6, (1, 20), generator=torch.Generator().manual_seed(0))
    torch._dynamo.utils.counters.clear()
    runs = [ws.generate(m, ids, 12, draft="prompt-lookup", width=2, depth=3, compile=True, eos_token_id=[],
                        output_logits=True) for m in (reference, model)]
    assert not torch._dynamo.utils.counters["graph_break"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2 and runs[1].stats.passes > 1
    assert torch.equal(runs[0].tokens, runs[1].tokens) and torch.equal(runs[0].logits, runs[1].logits)
    eager = ws.generate(ref, ids, 12, draft="prompt-lookup", width=2, depth=3, eos_token_id=[])
    assert torch.equal(eager.tokens, runs[1].tokens)


@pytest.mark.slow
def test_compiled_generations_of_prompts_of_different_lengths_share_one_graph():
    model = make_model("llama")
    eager = copy.deepcopy(model)
    ws.offload(model, gpu_memory=int(weight_bytes(model) * 0.5), device="cpu", strategy="stream")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for length in (9, 40, 23):  # one cache bucket: one compiled verify forward for all three
        ids = torch.randint(0, 6, (1, length), generator=torch.Generator().manual_seed(length))
        run = ws.generate(model, ids, 10, draft="prompt-lookup", width=2, depth=2, compile=True,
                          eos_token_id=[])
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
        plain = ws.generate(eager, ids, 10, draft="prompt-lookup", width=2, depth=2, eos_token_id=[])
        assert torch.equal(run.tokens, plain.tokens)
