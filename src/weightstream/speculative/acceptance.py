"""Which drafted tokens a verify pass accepts: greedy, or rejection sampling that keeps the target's
distribution exactly.

Pure logic on the host (no CUDA calls). A walk starts at the root and moves to a child while the target
accepts it; where it stops, the target gives one more token of its own, so a pass emits the accepted
tokens plus one.

Sampling, at a node whose target distribution is p and whose children are x_1..x_m, each drawn from a
draft distribution q_i (the draft's q with the earlier siblings taken out, for a draft that samples
without replacement; a point mass on x_i for a draft that picks its tokens deterministically, as prompt
lookup and top-k drafts do): child i is accepted with probability min(1, p(x_i) / q_i(x_i)); after a
rejection p becomes the normalized max(0, p - q_i) and the next child is tried; after the last
rejection the token is drawn from what p has become. Every emitted token is then distributed exactly
as p (tests/speculative/test_acceptance.py computes the outcome distribution and compares it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .tree import Tree


def target_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None) -> torch.Tensor:
    """(n, vocab) float32 probabilities of sampling from `logits` (n, vocab) as transformers' generate
    does: divided by `temperature`, then kept to the `top_k` largest, then to the smallest set whose
    probability reaches `top_p`. top_k 0 or None, top_p 1 or None: not applied (as transformers)."""
    scores = logits.float() / temperature
    if top_k and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        ordered, order = torch.sort(scores, dim=-1, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - top_p
        drop[..., -1:] = False  # the most likely token always stays
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return scores.softmax(dim=-1)


def walk_greedy(tree: Tree, best: torch.Tensor) -> tuple[list[int], int]:
    """Greedy acceptance. best: (tree tokens,) the target's argmax at each node. Returns the accepted
    path (node indices, the root first) and the token the target gives after its last node."""
    best = best.tolist()
    path = [0]
    while True:
        node = path[-1]
        child = next((c for c in tree.children(node) if int(tree.tokens[c]) == best[node]), None)
        if child is None:
            return path, best[node]
        path.append(child)


def accept_probability(p: torch.Tensor, token: int, q: torch.Tensor | None = None) -> float:
    """min(1, p(token) / q(token)); q None is a point mass on `token` (a deterministic draft)."""
    drafted = 1.0 if q is None else float(q[token])
    if drafted <= 0.0:
        return 0.0  # the draft could not have drawn it: never accept what was not drawn from q
    return min(1.0, float(p[token]) / drafted)


def residual(p: torch.Tensor, token: int, q: torch.Tensor | None = None) -> torch.Tensor:
    """The target distribution after rejecting `token` drawn from q: normalized max(0, p - q); q None is
    a point mass on `token`. Where nothing is left (p <= q everywhere, reached only through rounding),
    p itself."""
    if q is None:
        q = torch.zeros_like(p)
        q[token] = 1.0
    rest = (p - q).clamp_min(0.0)
    total = rest.sum()
    return rest / total if total > 0 else p


def walk_sampled(tree: Tree, probs: Callable[[int], torch.Tensor], generator: torch.Generator,
                 draft_probs: Callable[[int], torch.Tensor | None] | None = None) -> tuple[list[int], int]:
    """Rejection sampling down the tree. probs(node): the target's distribution (vocab,) float64 after
    `node`; draft_probs(child): the distribution the draft drew `child` from, None for a point mass
    (the default for every child). generator: a CPU generator, the only source of randomness. Returns
    the accepted path (node indices, the root first) and the token sampled after its last node."""
    path = [0]
    while True:
        node = path[-1]
        p = probs(node)
        for child in tree.children(node):
            token = int(tree.tokens[child])
            q = draft_probs(child) if draft_probs is not None else None
            draw = float(torch.rand((), generator=generator, dtype=torch.float64))
            if draw < accept_probability(p, token, q):
                path.append(child)
                break
            p = residual(p, token, q)
        else:
            return path, int(torch.multinomial(p, 1, generator=generator))
