"""Tree shapes, tries of drafted chains, masks, positions and KV moves: pure logic."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightstream.errors import ArgumentError
from weightstream.speculative.tree import (
    TreeShape,
    causal_mask,
    chain_tree,
    path_moves,
    tree_from_chains,
    tree_mask,
    tree_positions,
)


def test_a_shape_has_a_root_and_width_slots_per_level():
    shape = TreeShape(3, 2)
    assert shape.tokens == 7
    assert shape.level(0) == slice(0, 1) and shape.level(1) == slice(1, 4) and shape.level(2) == slice(4, 7)
    assert shape.depths().tolist() == [0, 1, 1, 1, 2, 2, 2]
    assert tree_positions(shape, 10).tolist() == [10, 11, 11, 11, 12, 12, 12]
    assert TreeShape(1, 0).tokens == 1  # no draft: one token per pass


@pytest.mark.parametrize("width, depth", [(0, 2), (2, -1), (1.5, 2), (True, 2), (2, "3")])
def test_a_shape_refuses_what_is_not_a_count(width, depth):
    with pytest.raises(ArgumentError, match="give an integer"):
        TreeShape(width, depth)


def test_chains_share_prefixes_and_stop_at_the_width_of_a_level():
    shape = TreeShape(2, 3)
    tree = tree_from_chains(9, [[1, 2, 3], [1, 4], [5, 6, 7, 8], [7]], shape)
    # root 9 -> 1 -> 2 -> 3 and 1 -> 4; then 5 takes the last slot of level 1, and its 6 finds level 2
    # full (2 and 4), so the chain stops there; 7 finds level 1 full
    assert tree.tokens.tolist() == [9, 1, 5, 2, 4, 3, 0]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 3, -1]
    assert tree.valid.tolist() == [True, True, True, True, True, True, False]
    assert tree.children(0) == [1, 2] and tree.children(1) == [3, 4] and tree.children(2) == []
    assert tree.valid_nodes() == 5


def test_a_level_that_is_full_cuts_the_rest_of_a_chain():
    shape = TreeShape(2, 3)
    tree = tree_from_chains(0, [[1, 2, 3], [1, 4, 5], [6, 7, 8]], shape)
    # level 2 holds 2 and 4 (both under 1): the third chain's 7 finds no slot, so 8 is dropped too
    assert tree.tokens[shape.level(2)].tolist() == [2, 4]
    assert tree.tokens[shape.level(3)].tolist() == [3, 5]
    assert tree.children(2) == []  # 6 kept its slot at level 1 but nothing below it


def test_the_mask_lets_each_node_see_the_prefix_and_its_ancestors():
    shape = TreeShape(2, 2)
    tree = tree_from_chains(7, [[1, 2], [3, 4]], shape)
    mask = tree_mask(tree, 3, 10)
    anc = tree.ancestors()
    assert mask[:, :3].all() and not mask[:, 3 + shape.tokens:].any()
    assert torch.equal(mask[:, 3:3 + shape.tokens], anc)
    # node 3 (token 2) sees the root, node 1 and itself; not node 2's branch
    assert anc[3].nonzero().flatten().tolist() == [0, 1, 3]
    assert anc[4].nonzero().flatten().tolist() == [0, 2, 4]
    with pytest.raises(ArgumentError, match="needs a cache of"):
        tree_mask(tree, 6, 10)


def test_padding_attends_to_the_prefix_and_itself_only():
    shape = TreeShape(2, 2)
    tree = chain_tree(5, shape)
    assert tree.valid.tolist() == [True] + [False] * 4
    anc = tree.ancestors()
    assert torch.equal(anc, torch.eye(shape.tokens, dtype=torch.bool))


def test_a_causal_mask_is_a_prefill_at_an_offset():
    mask = causal_mask(2, 3, 6)
    assert mask.tolist() == [[True, True, True, False, False, False],
                             [True, True, True, True, False, False],
                             [True, True, True, True, True, False]]


def test_path_moves_put_the_path_after_the_prefix_and_leave_the_rest():
    src, dst = path_moves([0, 2, 5], start=10, depth=3)
    assert dst.tolist() == [10, 11, 12, 13]
    assert src.tolist() == [10, 12, 15, 13]


chains = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=5), max_size=6)


@settings(max_examples=200, deadline=None)
@given(width=st.integers(1, 4), depth=st.integers(1, 4), chains=chains)
def test_any_trie_is_a_well_formed_tree(width, depth, chains):
    shape = TreeShape(width, depth)
    tree = tree_from_chains(9, chains, shape)
    depths = shape.depths()
    anc = tree.ancestors()
    for node in range(1, shape.tokens):
        parent = int(tree.parents[node])
        if not tree.valid[node]:
            assert parent == -1 and anc[node].sum() == 1
            continue
        assert tree.valid[parent] and depths[parent] == depths[node] - 1  # one level up, a real node
        assert torch.equal(anc[node], anc[parent] | (torch.arange(shape.tokens) == node))
    # siblings are distinct tokens, and each chain's kept prefix is a path of the tree
    for node in range(shape.tokens):
        kids = tree.children(node)
        assert len({int(tree.tokens[k]) for k in kids}) == len(kids)
    if chains:  # the best chain always finds its slots, up to the depth
        node = 0
        for token in chains[0][:depth]:
            node = next(k for k in tree.children(node) if int(tree.tokens[k]) == token)
