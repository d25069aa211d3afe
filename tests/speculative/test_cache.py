"""KV rollback: after a verify pass, the accepted path's entries are moved into place, the prefix is
untouched, and nothing left of the rejected entries is ever read again."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightstream.speculative.cache import TreeCache, kv_bytes
from weightstream.speculative.tree import (
    TreeShape,
    chain_tree,
    path_moves,
    tree_from_chains,
    tree_mask,
    tree_positions,
)
from weightstream.speculative.verify import TreeForward

LENGTH = 48


@pytest.fixture(scope="module")
def model():
    return make_model("llama")


def verify(forward: TreeForward, tree, start: int) -> torch.Tensor:
    shape = tree.shape
    return forward.run(tree.tokens, tree_positions(shape, start), torch.arange(shape.tokens) + start,
                       tree_mask(tree, start, LENGTH))


def snapshot(cache: TreeCache) -> list[torch.Tensor]:
    return [t.clone() for t in cache.keys + cache.values]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data(), prompt=st.integers(1, 12), width=st.integers(1, 3), depth=st.integers(1, 4),
       chains=st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=4), max_size=4))
def test_the_accepted_path_is_moved_into_place_and_rejected_entries_are_never_read(model, data, prompt, width,
                                                                                   depth, chains):
    ids = torch.randint(0, 128, (prompt + 1,), generator=torch.Generator().manual_seed(prompt))
    shape = TreeShape(width, depth)
    tree = tree_from_chains(int(ids[-1]), chains, shape)
    cache = TreeCache(model.config.num_hidden_layers, LENGTH)
    forward = TreeForward(model, cache, torch.device("cpu"), model.dtype)
    forward.prefill(ids[:-1])
    verify(forward, tree, prompt)
    written = snapshot(cache)
    path = [0]  # any acceptance pattern: a random walk down valid children
    while (kids := tree.children(path[-1])) and data.draw(st.booleans()):
        path.append(data.draw(st.sampled_from(kids)))
    src, dst = path_moves(path, prompt, shape.depth)
    cache.move(src, dst)
    for before, after in zip(written, snapshot(cache), strict=True):
        assert torch.equal(after[:, :, :prompt], before[:, :, :prompt])  # the prefix is untouched
        for j, node in enumerate(path):
            assert torch.equal(after[:, :, prompt + j], before[:, :, prompt + node])
    # the next pass, with every entry past the committed ones overwritten by garbage, gives the same logits
    committed = prompt + len(path)
    nxt = chain_tree(3, TreeShape(2, 2))
    clean = snapshot(cache)
    want = verify(forward, nxt, committed)
    for buffer, kept in zip(cache.keys + cache.values, clean, strict=True):
        buffer.copy_(kept)
        buffer[:, :, committed:] = torch.randn_like(buffer[:, :, committed:]) * 1e3
    assert torch.equal(verify(forward, nxt, committed), want)


def test_a_rolled_back_cache_continues_as_a_fresh_prefill_of_the_committed_tokens(model):
    ids = torch.randint(0, 128, (10,), generator=torch.Generator().manual_seed(0))
    shape = TreeShape(2, 3)
    tree = tree_from_chains(int(ids[5]), [[1, 2, 3], ids[6:9].tolist()], shape)  # the second branch is true
    cache = TreeCache(model.config.num_hidden_layers, LENGTH)
    forward = TreeForward(model, cache, torch.device("cpu"), model.dtype)
    forward.prefill(ids[:5])
    verify(forward, tree, 5)
    path = [0, 2, 4, 6]  # root, then 6, 7, 8 of the second chain
    assert tree.tokens[path].tolist() == ids[5:9].tolist()
    cache.move(*path_moves(path, 5, shape.depth))
    one = tree_mask(chain_tree(0, TreeShape(1, 0)), 9, LENGTH)
    continued = forward.run(ids[9:10], torch.tensor([9]), torch.tensor([9]), one)
    fresh = model(ids[None]).logits[0, -1]
    assert torch.allclose(continued[0], fresh, atol=1e-5) and continued[0].argmax() == fresh.argmax()


def test_kv_bytes_count_both_keys_and_values_of_every_layer(model):
    cache = TreeCache(model.config.num_hidden_layers, LENGTH)
    TreeForward(model, cache, torch.device("cpu"), model.dtype).prefill(torch.tensor([1, 2, 3]))
    assert cache.nbytes() == kv_bytes(model.config, LENGTH, model.dtype)
