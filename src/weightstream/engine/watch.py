"""Tensors a model writes. A streamed tensor is a view of a staging slot that other groups share, so a
write through it would be lost at the next copy into the slot, or land in another group's bytes: state
a block keeps in a buffer (a running statistic, a step counter, a KV cache in registered buffers), a
weight edited in place (`w.mul_(s)`), a buffer the block rebinds to a new tensor.

So the engine watches every streamed tensor, without trusting names: its version counter (torch bumps
it at every in-place write through the tensor; each streamed tensor has its own, not its slot's), its
storage, and the module attributes that hold it. `TensorWatch` only reports what changed; the engine
(`offload.OffloadHandle`) decides: a write inside the block's own window (between its wait and its
release) is state and moves to resident storage; a rebinding is adopted; an in-place write from
outside every window is refused, because it landed in whichever group the slot held.

Writes through `.data` (`w.data += d`, as PEFT's `merge()` does) bump no counter: the one such writer
watched is PEFT's tuner layers, by their `merged_adapters` lists (`peft_layers`). The check mode
(`offload(check=True)`) compares bytes and so catches every writer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..placement.entries import Entry

WRITTEN = "written"  # the tensor was written in place (its version counter moved)
REBOUND = "rebound"  # a module attribute that held it holds another tensor, or its storage moved


def _at(site) -> torch.Tensor | None:
    table = site.module._parameters if site.is_param else site.module._buffers
    return table.get(site.name)


@dataclass(eq=False)  # compared by identity (`drop` removes this one): the fields hold tensors
class Watched:
    """One streamed tensor as it was installed: its entry, the object every site holds, its version
    and its storage address."""

    entry: Entry
    tensor: torch.Tensor
    version: int
    ptr: int
    view: torch.Tensor | None = None  # the installed memory (an alias of the tensor as installed)

    def change(self) -> str | None:
        """WRITTEN, REBOUND or None (nothing changed)."""
        t = self.tensor
        for site in self.entry.sites:
            if _at(site) is not t:
                return REBOUND
        if t.data_ptr() != self.ptr:  # `.data = other` keeps the object and moves its storage
            return REBOUND
        if t._version != self.version:
            return WRITTEN
        return None

    def bound(self) -> torch.Tensor | None:
        """What the model now holds in the tensor's first site (None: nothing)."""
        return _at(self.entry.sites[0])


class TensorWatch:
    """The watched tensors of each streamed group (plain tensors; a tensor subclass's inner tensors are
    not watched)."""

    def __init__(self, groups: list[list[tuple[Entry, object]]]) -> None:
        self.groups: list[list[Watched]] = [
            [Watched(e, e.tensor, e.tensor._version, e.tensor.data_ptr(), e.tensor.detach())
             for e, _ in group if e.flat is None]
            for group in groups
        ]

    def changes(self, group: int) -> list[tuple[Watched, str]]:
        """What changed in `group`'s tensors since they were installed (or last accepted)."""
        found = []
        for w in self.groups[group]:
            change = w.change()
            if change is not None:
                found.append((w, change))
        return found

    def all_changes(self) -> list[tuple[int, Watched, str]]:
        """What changed in every group's tensors."""
        return [(g, w, c) for g in range(len(self.groups)) for w, c in self.changes(g)]

    def accept(self, w: Watched) -> None:
        """Take `w`'s present version as its own again (after a refused write was discarded)."""
        w.version = w.tensor._version

    def revert(self, w: Watched) -> None:
        """Point `w`'s tensor back at its installed memory where `.data = other` moved it (a site that
        binds another object is left as it is), and take its present version as its own."""
        if w.tensor.data_ptr() != w.ptr and w.view is not None:
            w.tensor.data = w.view
        w.version = w.tensor._version

    def drop(self, group: int, w: Watched) -> None:
        """Stop watching `w`: its entry no longer streams."""
        self.groups[group].remove(w)

    def restore(self, group: int, w: Watched) -> None:
        """Watch `w` again (its entry streams again), from its present version."""
        w.version = w.tensor._version
        self.groups[group].append(w)


def holds_again(w: Watched) -> bool:
    """Whether every site of `w`'s entry holds `w`'s own tensor, on its own memory, again."""
    return all(_at(site) is w.tensor for site in w.entry.sites) and w.tensor.data_ptr() == w.ptr


def peft_layers(model: nn.Module, streamed: set[int]) -> dict[nn.Module, list]:
    """PEFT tuner layers (modules with a `merged_adapters` list) whose base layer's weight streams (its id
    in `streamed`), with a copy of their list of merged adapters now. Their `merge()`/`unmerge()` write
    the base weight through `.data` (in place, or `safe_merge` by rebinding it to a merged copy), which
    no version counter sees."""
    found = {}
    for module in model.modules():
        merged = getattr(module, "merged_adapters", None)
        base = getattr(module, "get_base_layer", None)
        if not isinstance(merged, list) or base is None:
            continue
        weight = getattr(base(), "weight", None)
        if weight is not None and id(weight) in streamed:
            found[module] = list(merged)
    return found
