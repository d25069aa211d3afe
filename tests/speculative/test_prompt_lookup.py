"""Prompt lookup: continuations of earlier occurrences of the context's last n-grams."""

from __future__ import annotations

import torch

from weightstream.speculative.prompt_lookup import PromptLookup, lookup_chains
from weightstream.speculative.tree import TreeShape


def t(*tokens: int) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.long)


def test_the_longest_match_comes_first_then_the_most_recent():
    context = t(1, 2, 3, 9, 8, 5, 2, 3, 7, 7, 2, 3)
    # (7, 2, 3) never occurred before; (2, 3) did at 6 and 1; (3) at 7 and 2 repeats what follows those
    assert lookup_chains(context, width=4, depth=2, max_ngram=3) == [[7, 7], [9, 8]]


def test_distinct_continuations_only_and_at_most_width():
    context = t(4, 5, 4, 5, 4, 5, 4)
    # (4, 5, 4) at 2 (then 5, 4: the context ends) and at 0; shorter n-grams repeat those continuations
    assert lookup_chains(context, width=3, depth=3) == [[5, 4], [5, 4, 5]]
    assert lookup_chains(context, width=1, depth=3) == [[5, 4]]


def test_nothing_to_match_gives_no_chain():
    assert lookup_chains(t(1, 2, 3, 4), width=2, depth=3) == []
    assert lookup_chains(t(7), width=2, depth=3) == []


def test_the_draft_builds_a_tree_rooted_at_the_last_token():
    context = t(1, 2, 3, 1, 2, 4, 1, 2)
    tree = PromptLookup().propose(context, TreeShape(2, 2))
    assert int(tree.tokens[0]) == 2
    # (1, 2) occurred at 3 (followed by 4, 1) and at 0 (followed by 3, 1)
    assert tree.tokens[1:].tolist() == [4, 3, 1, 1] and tree.parents[1:].tolist() == [0, 0, 1, 2]
