"""Token trees of a fixed size: the shape every verify pass has, and the masks and positions of one tree.

Pure logic, no CUDA calls. A tree of `TreeShape(width, depth)` always has `1 + width * depth` nodes laid
out by level: node 0 is the root (the last token emitted, not yet in the KV cache), then `width` slots
for each depth 1..depth. A draft fills the slots it can; the rest are padding (`valid` False), attend to
themselves only and are never accepted. Since the size never changes, the verify forward sees the same
shapes every pass (one compile, one CUDA graph), whatever the draft proposed. A chain is `width=1`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import ArgumentError


@dataclass(frozen=True)
class TreeShape:
    """The static budget of a verify pass: `width` nodes at each of `depth` levels below the root."""

    width: int
    depth: int

    def __post_init__(self) -> None:
        for name, value, least in (("width", self.width, 1), ("depth", self.depth, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ArgumentError(f"tree {name}={value!r}: give an integer of at least {least} "
                                    "(width=1 drafts a chain; depth is the most tokens accepted per pass, "
                                    "0 decodes one token per pass)")

    @property
    def tokens(self) -> int:
        """Tokens of one verify forward: the root and every slot."""
        return 1 + self.width * self.depth

    @property
    def dims(self) -> tuple[int, int]:
        """(width, depth)."""
        return self.width, self.depth

    def level(self, depth: int) -> slice:
        """The node indices of one level (depth 0 is the root)."""
        if depth == 0:
            return slice(0, 1)
        start = 1 + (depth - 1) * self.width
        return slice(start, start + self.width)

    def depths(self) -> torch.Tensor:
        """(tokens,) int64: each node's depth, the offset of its position from the root's."""
        return torch.cat([torch.zeros(1, dtype=torch.long),
                          torch.arange(self.width * self.depth) // self.width + 1])


@dataclass(frozen=True)
class Tree:
    """One drafted tree, laid out as its `shape` says. tokens, parents: (shape.tokens,) int64, a parent
    index before its child (-1 for the root and padding); valid: (shape.tokens,) bool."""

    shape: TreeShape
    tokens: torch.Tensor
    parents: torch.Tensor
    valid: torch.Tensor

    def children(self, node: int) -> list[int]:
        """The valid children of `node`, in slot order (the order a draft ranked them)."""
        return [int(i) for i in torch.nonzero((self.parents == node) & self.valid).flatten()]

    def ancestors(self) -> torch.Tensor:
        """(tokens, tokens) bool: [i, j] is True where node j is node i or one of its ancestors, the
        tokens node i attends to inside the tree."""
        n = self.shape.tokens
        anc = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):  # parents come first, so each row extends its parent's finished row
            parent = int(self.parents[i])
            if parent >= 0:
                anc[i] |= anc[parent]
        return anc

    def valid_nodes(self) -> int:
        """Drafted nodes below the root."""
        return int(self.valid[1:].sum())


def parse_tree(text: str) -> TreeShape:
    """A shape written "WIDTHxDEPTH" ("4x6": 1 + 4 * 6 tokens; "1x8" a chain of 8); ArgumentError
    otherwise."""
    width, sep, depth = text.lower().partition("x")
    if not sep or not width.isdigit() or not depth.isdigit() or int(width) < 1 or int(depth) < 1:
        raise ArgumentError(f"--tree {text}: give WIDTHxDEPTH with both at least 1, e.g. --tree 4x6 "
                            "(1xN drafts a chain of N tokens)")
    return TreeShape(int(width), int(depth))


def chain_tree(root: int, shape: TreeShape) -> Tree:
    """A tree of the root alone (every slot padding): a plain decode step at the tree's shape."""
    return tree_from_chains(root, [], shape)


def tree_from_chains(root: int, chains: Sequence[Sequence[int]], shape: TreeShape) -> Tree:
    """The trie of `chains` (token sequences that continue `root`, best first) in the slots of `shape`.
    Shared prefixes share nodes; each chain is cut at `shape.depth`; a chain whose node would need a
    slot past `shape.width` at its level is cut there (the earlier chains keep theirs)."""
    n = shape.tokens
    tokens = torch.zeros(n, dtype=torch.long)
    parents = torch.full((n,), -1, dtype=torch.long)
    valid = torch.zeros(n, dtype=torch.bool)
    tokens[0], valid[0] = root, True
    used = [0] * (shape.depth + 1)  # slots filled per level
    index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for chain in chains:
        node = 0
        for depth, token in enumerate(list(chain)[: shape.depth], start=1):
            key = (node, int(token))
            if key not in index:
                if used[depth] == shape.width:
                    break
                slot = shape.level(depth).start + used[depth]
                used[depth] += 1
                tokens[slot], parents[slot], valid[slot] = int(token), node, True
                index[key] = slot
            node = index[key]
    return Tree(shape, tokens, parents, valid)


def tree_positions(shape: TreeShape, start: int) -> torch.Tensor:
    """(tokens,) int64 position ids of a tree whose root sits at position `start`."""
    return shape.depths() + start


def tree_mask(tree: Tree, start: int, length: int) -> torch.Tensor:
    """(tokens, length) bool: what each node attends to in a KV cache of `length` positions when the
    committed tokens fill [0, start) and the tree is written at [start, start + tokens)."""
    n = tree.shape.tokens
    if start + n > length:
        raise ArgumentError(f"a tree of {n} tokens at position {start} needs a cache of {start + n} "
                            f"positions; it has {length}")
    mask = torch.zeros(n, length, dtype=torch.bool)
    mask[:, :start] = True
    mask[:, start:start + n] = tree.ancestors()
    return mask


def causal_mask(start: int, count: int, length: int) -> torch.Tensor:
    """(count, length) bool: `count` consecutive tokens written at [start, start + count) attending to
    everything before them and to themselves (a prefill)."""
    cols = torch.arange(length)
    rows = torch.arange(count) + start
    return cols[None, :] <= rows[:, None]


def sliding_mask(mask: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor,
                 window: int) -> torch.Tensor:
    """(count, length) bool: `mask` where each query also keeps only the keys whose position id is less
    than `window` behind its own (transformers' sliding window: key > query - window). Positions are
    logical (a tree node's is its root's plus its depth), not cache slots: query_positions (count,),
    key_positions (length,) int64, the position id each cache slot holds."""
    behind = query_positions[:, None] - key_positions[None, :]
    return mask & (behind < window)


def path_moves(path: Sequence[int], start: int, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the KV entries of an accepted path go: (source, destination) cache positions, each of
    `depth + 1` entries (static). The path (root first, as node indices) is moved to
    [start, start + len(path)); the rest of the entries move a position onto itself."""
    dst = torch.arange(depth + 1) + start
    src = dst.clone()
    src[: len(path)] = torch.as_tensor(list(path), dtype=torch.long) + start
    return src, dst
