"""Prompt lookup: drafts copied from the context itself, where its last tokens appeared before.

No weights and no forward: the last n tokens (n from `max_ngram` down to `min_ngram`) are searched for
in the context, and what followed each earlier occurrence (most recent first, distinct continuations
only) becomes a chain of the tree. Strong wherever the output repeats the input: code edits, quoting,
summaries, extraction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import Tree, TreeShape, tree_from_chains


def lookup_chains(context: torch.Tensor, width: int, depth: int, max_ngram: int = 3,
                  min_ngram: int = 1) -> list[list[int]]:
    """Up to `width` distinct continuations of at most `depth` tokens, each following an earlier
    occurrence of the last n tokens of `context` (1-D int64), longer matches first, then the most
    recent."""
    chains: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    length = context.numel()
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        tail = context[length - n:]
        windows = context[: length - 1].unfold(0, n, 1)  # every earlier n-gram with a token after it
        starts = torch.nonzero((windows == tail).all(dim=1)).flatten().tolist()
        for start in reversed(starts):
            follow = context[start + n: start + n + depth].tolist()
            key = tuple(follow)
            if follow and key not in seen:
                seen.add(key)
                chains.append(follow)
                if len(chains) == width:
                    return chains
    return chains


@dataclass
class PromptLookup:
    """The prompt-lookup draft: n-grams of `min_ngram`..`max_ngram` tokens matched in the context."""

    max_ngram: int = 3
    min_ngram: int = 1
    name: str = "prompt-lookup"

    def begin(self, prompt: torch.Tensor, length: int, device: torch.device) -> None: ...

    def propose(self, context: torch.Tensor, shape: TreeShape) -> Tree:
        chains = lookup_chains(context, shape.width, shape.depth, self.max_ngram, self.min_ngram)
        return tree_from_chains(int(context[-1]), chains, shape)

    def accept(self, path: list[int], start: int) -> None: ...
