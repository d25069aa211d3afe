"""What a draft is to the generation loop, and how `generate(draft=...)` names one.

A draft proposes a tree of tokens that may follow the context; the target verifies it. A draft that
keeps state (a draft model's KV cache) hears the start of a generation and each accepted path. Kinds:
`"prompt-lookup"` (n-gram matches in the context, no weights: `PromptLookup`), `"self"` (the model's own
resident modules plus int4 copies of the blocks it keeps off the GPU, groups of 128: `SelfDraft`, which
also takes other bits and groups), any small causal LM with the model's tokenizer (an `nn.Module`,
wrapped in `DraftModel`), None (no draft: one token per pass), or any object with the methods of
`Draft`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from ..errors import ArgumentError
from .tree import Tree, TreeShape, chain_tree

DRAFT_NAMES = ("prompt-lookup", "self")


@runtime_checkable
class Draft(Protocol):
    """A source of drafted trees. Token tensors are int64 on the CPU."""

    name: str

    def begin(self, prompt: torch.Tensor, length: int, device: torch.device) -> None:
        """A generation starts from `prompt` (prompt length,), with room for `length` positions."""

    def propose(self, context: torch.Tensor, shape: TreeShape) -> Tree:
        """A tree of `shape` whose root is `context[-1]` (the last token emitted, at position
        len(context) - 1; the tokens before it are committed)."""

    def accept(self, path: list[int], start: int) -> None:
        """The target accepted `path` (node indices of the last tree, the root first), whose root was at
        position `start`."""


class NoDraft:
    """No draft: every tree is the root alone, so a pass emits one token (plain decoding)."""

    name = "none"

    def begin(self, prompt: torch.Tensor, length: int, device: torch.device) -> None: ...

    def propose(self, context: torch.Tensor, shape: TreeShape) -> Tree:
        return chain_tree(int(context[-1]), shape)

    def accept(self, path: list[int], start: int) -> None: ...


def resolve_draft(draft, compile: bool | str = False) -> Draft:
    """The `Draft` that `generate(draft=...)` names: "prompt-lookup", "self", an `nn.Module` (a causal LM
    with the model's tokenizer), None, or a `Draft`. Raises ArgumentError for anything else."""
    from .draft_model import DraftModel
    from .prompt_lookup import PromptLookup
    from .self_draft import SelfDraft

    if draft is None:
        return NoDraft()
    if isinstance(draft, str):
        if draft == "prompt-lookup":
            return PromptLookup()
        if draft == "self":
            return SelfDraft()
        raise ArgumentError(f"draft={draft!r}: give 'prompt-lookup', 'self', a small causal LM with the "
                            "model's tokenizer (an nn.Module), or None for plain decoding")
    if isinstance(draft, nn.Module):
        return DraftModel(draft, compile=compile)
    if isinstance(draft, Draft):
        return draft
    raise ArgumentError(f"draft of type {type(draft).__name__}: give 'prompt-lookup', 'self', a small "
                        "causal LM with the model's tokenizer (an nn.Module), or None for plain decoding")
