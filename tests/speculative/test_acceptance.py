"""Acceptance: the greedy walk, and rejection sampling whose emitted token is distributed exactly as the
target's, computed analytically from the same step functions the sampler uses."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightstream.speculative.acceptance import (
    accept_probability,
    residual,
    target_probs,
    walk_greedy,
    walk_sampled,
)
from weightstream.speculative.tree import TreeShape, tree_from_chains

VOCAB = 5


def distributions(size: int = VOCAB):
    """Probability vectors over `size` tokens, some entries exactly 0."""
    weights = st.lists(st.sampled_from([0.0, 0.0, 0.05, 0.3, 1.0, 2.0, 7.0]), min_size=size, max_size=size)
    return weights.filter(lambda w: sum(w) > 0).map(
        lambda w: torch.tensor(w, dtype=torch.float64) / sum(w))


def outcome(p: torch.Tensor, drafted: list[int], qs: list[torch.Tensor | None]) -> torch.Tensor:
    """The exact distribution of the token that leaves a node with target p whose children, in order,
    are `drafted`, each drawn from qs[i]: the accepted child's token, or the final residual's draw."""
    out = torch.zeros_like(p)
    reach = 1.0  # probability that every earlier child was rejected
    for token, q in zip(drafted, qs, strict=True):
        a = accept_probability(p, token, q)
        out[token] += reach * a
        reach *= 1 - a
        p = residual(p, token, q)
    return out + reach * p


@settings(max_examples=300, deadline=None)
@given(p=distributions(), order=st.permutations(range(VOCAB)), m=st.integers(0, VOCAB))
def test_deterministic_children_keep_the_target_distribution(p, order, m):
    """Point-mass drafts (prompt lookup, a draft model's top-k): any distinct children, any order."""
    drafted = list(order[:m])
    assert torch.allclose(outcome(p, drafted, [None] * m), p, atol=1e-12)


@settings(max_examples=150, deadline=None)
@given(p=distributions(), q=distributions(), m=st.integers(1, 3))
def test_children_sampled_without_replacement_keep_the_target_distribution(p, q, m):
    """A draft that samples m distinct children from q, one after another (q renormalized without the
    tokens already drawn): averaged over every sequence it can draw, the emitted token is p."""
    total = torch.zeros_like(p)
    for drafted in itertools.permutations(range(VOCAB), m):
        chance, qs, left = 1.0, [], q.clone()
        for token in drafted:
            if left.sum() <= 0:
                chance = 0.0
                break
            qi = left / left.sum()
            chance *= float(qi[token])
            qs.append(qi)
            left = left.clone()
            left[token] = 0
        if chance > 0:
            total += chance * outcome(p, list(drafted), qs)
    # sequences of m distinct tokens exist only where q has m tokens of nonzero probability
    if int((q > 0).sum()) >= m:
        assert torch.allclose(total, p, atol=1e-12)


def test_the_sampler_follows_the_step_functions_from_a_seed():
    """walk_sampled at one node, many seeded draws: the frequencies of the first emitted token approach
    the exact outcome (a smoke check of the sampler's use of the steps; exactness is the tests above)."""
    p = torch.tensor([0.1, 0.4, 0.2, 0.3], dtype=torch.float64)
    tree = tree_from_chains(0, [[1], [3]], TreeShape(2, 1))
    generator = torch.Generator().manual_seed(0)
    draws = 20000
    counts = torch.zeros(4, dtype=torch.float64)
    for _ in range(draws):
        path, token = walk_sampled(tree, lambda node: p if node == 0 else torch.full((4,), 0.25,
                                                                                       dtype=torch.float64),
                                   generator)
        counts[int(tree.tokens[path[1]]) if len(path) > 1 else token] += 1
    sigma = (p * (1 - p) / draws).sqrt()
    assert ((counts / draws - p).abs() < 5 * sigma).all()


def test_the_greedy_walk_follows_the_target_argmax_down_the_tree():
    shape = TreeShape(2, 3)
    tree = tree_from_chains(9, [[1, 2, 3], [4, 5, 6]], shape)  # levels: [1, 4], [2, 5], [3, 6]
    best = torch.zeros(shape.tokens, dtype=torch.long)
    best[0], best[2], best[4], best[6] = 4, 5, 6, 8  # root -> 4 -> 5 -> 6, then the target says 8
    assert walk_greedy(tree, best) == ([0, 2, 4, 6], 8)
    best[0] = 7  # nothing drafted matches at the root
    assert walk_greedy(tree, best) == ([0], 7)
    best[0], best[1] = 1, 3  # 1 accepted, then 3 is not a child of 1 (2 is)
    assert walk_greedy(tree, best) == ([0, 1], 3)


def test_padding_is_never_accepted():
    shape = TreeShape(2, 1)
    tree = tree_from_chains(9, [[0]], shape)  # slot 2 is padding holding token 0 as well
    best = torch.zeros(shape.tokens, dtype=torch.long)
    assert walk_greedy(tree, best) == ([0, 1], 0)
    tree = tree_from_chains(9, [], shape)
    assert walk_greedy(tree, best) == ([0], 0)


def test_a_draft_token_q_could_not_draw_is_never_accepted():
    p = torch.tensor([0.5, 0.5], dtype=torch.float64)
    assert accept_probability(p, 1, torch.tensor([1.0, 0.0], dtype=torch.float64)) == 0.0
    assert accept_probability(p, 1) == 0.5


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, None, None), (0.7, None, None), (1.0, 3, None),
                                                        (1.0, None, 0.8), (0.5, 4, 0.9), (2.0, 50, 0.3),
                                                        (1.0, 0, None), (0.7, 0, 0.9), (1.0, None, 0.0)])
def test_target_probabilities_equal_transformers_sampling(temperature, top_k, top_p):
    """Temperature, then top-k, then top-p, as transformers' warpers; top_k 0 is no top-k, as transformers'
    generate leaves its warper out."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(3, 17, generator=torch.Generator().manual_seed(1))
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:  # transformers' generate: `top_k is not None and top_k != 0`
        warpers.append(TopKLogitsWarper(top_k))
    if top_p is not None:
        warpers.append(TopPLogitsWarper(top_p))
    want = warpers(None, logits.clone()).softmax(dim=-1)
    assert torch.equal(target_probs(logits, temperature, top_k, top_p), want)
