"""A small causal LM with the model's tokenizer as the draft: a beam of its likeliest continuations.

The draft keeps its own `TreeCache`, laid out as the target's: committed tokens at [0, start), the tree
at [start, start + tree tokens). Each proposal runs one forward of 2 tokens (the last committed token,
rewritten in case the previous tree's deepest accepted node never went through the draft, and the
root), then one forward per level of `width` tokens: every node of a level takes its `width` likeliest
next tokens, and the `width` children of highest cumulative draft log-probability over the level make
the next one. Shapes are static (2 and `width` tokens), so compiled steps replay. Children are picked
deterministically, so acceptance treats each as a point mass (exact for sampling too).
"""

from __future__ import annotations

import torch
from torch import nn

from .cache import TreeCache
from .tree import Tree, TreeShape, causal_mask, path_moves, tree_mask
from .verify import TreeForward


class DraftModel:
    """A draft model (an `nn.Module` causal LM, resident). compile: as `generate`'s, for its steps."""

    name = "model"

    def __init__(self, model: nn.Module, compile: bool | str = False) -> None:
        self.model, self.compile = model, compile
        self.forward: TreeForward | None = None

    def begin(self, prompt: torch.Tensor, length: int, device: torch.device) -> None:
        """A fresh cache of `length` positions, filled with the prompt (one eager forward)."""
        if self.forward is None or self.forward.cache.length != length:
            cache = TreeCache(self.model.config.num_hidden_layers, length)
            self.forward = TreeForward(self.model, cache, device, self.model.dtype, self.compile)
        self.forward.prefill(prompt)

    def propose(self, context: torch.Tensor, shape: TreeShape) -> Tree:
        start = context.numel() - 1  # the root's position
        if shape.depth == 0:
            return grow_beam(self.forward, None, context, shape)
        pair = torch.arange(start - 1, start + 1)
        mask = causal_mask(start - 1, 2, self.forward.cache.length)
        logits = self.forward.run(context[-2:], pair, pair, mask)
        return grow_beam(self.forward, logits[1:], context, shape)

    def accept(self, path: list[int], start: int) -> None:
        """Keep the accepted path's keys and values, as the target's cache does."""
        src, dst = path_moves(path, start, len(path) - 1)
        self.forward.cache.move(src, dst)

    def weight_bytes(self) -> int:
        """Bytes of the draft model's parameters and buffers (a tensor shared by two modules once)."""
        seen = {id(t): t for t in (*self.model.parameters(), *self.model.buffers())}
        return sum(t.numel() * t.element_size() for t in seen.values())

    def device_bytes(self) -> int:
        """Bytes the draft holds on its device: the model's weights and its KV cache so far."""
        cache = self.forward.cache.nbytes() if self.forward is not None else 0
        return self.weight_bytes() + cache


def grow_beam(forward: TreeForward, logits: torch.Tensor | None, context: torch.Tensor,
              shape: TreeShape) -> Tree:
    """The beam tree of `shape` rooted at `context[-1]` (at position len(context) - 1): `logits` (1,
    vocab) are the draft's at the root (None for depth 0); each level runs one forward of `width` tokens
    through `forward`, written at the level's tree slots."""
    length = forward.cache.length
    start = context.numel() - 1
    tokens = torch.zeros(shape.tokens, dtype=torch.long)
    parents = torch.full((shape.tokens,), -1, dtype=torch.long)
    valid = torch.zeros(shape.tokens, dtype=torch.bool)
    tokens[0], valid[0] = context[-1], True
    scores = torch.zeros(1, dtype=torch.float64)  # cumulative log-probability of each fed node
    fed = slice(0, 1)
    for depth in range(1, shape.depth + 1):
        level = shape.level(depth)
        logp = torch.log_softmax(logits.double(), dim=-1).cpu() + scores[:, None]
        logp[~valid[fed]] = float("-inf")
        best, flat = torch.topk(logp.flatten(), shape.width)
        vocab = logp.shape[-1]
        tokens[level] = flat % vocab
        parents[level] = flat // vocab + fed.start
        valid[level] = best > float("-inf")
        parents[level][~valid[level]] = -1
        if depth == shape.depth:
            break
        tree = Tree(shape, tokens, parents, valid)
        positions = torch.full((shape.width,), start + depth, dtype=torch.long)
        write_at = torch.arange(level.start, level.stop) + start
        logits = forward.run(tokens[level], positions, write_at, tree_mask(tree, start, length)[level])
        scores, fed = best, level
    return Tree(shape, tokens, parents, valid)
