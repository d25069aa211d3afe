"""Find the repeated blocks of a model: the units weightstream streams as whole groups.

A block list is an `nn.ModuleList` (or `nn.Sequential`) of two or more modules of one class, such as a
transformer's decoder layers. Lists nested inside a chosen list (MoE experts inside a layer) are not
chosen separately: the outer block streams them with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .errors import WeightstreamError


@dataclass(frozen=True)
class Block:
    """One repeated block: its qualified name in the model and the module itself."""

    name: str
    module: nn.Module


def _tensor_bytes(module: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _is_block_list(module: nn.Module) -> bool:
    children = list(module.children())
    return (
        isinstance(module, (nn.ModuleList, nn.Sequential))
        and len(children) >= 2
        and len({type(c) for c in children}) == 1
        and _tensor_bytes(module) > 0
    )


def find_blocks(model: nn.Module, names: list[str] | None = None) -> list[Block]:
    """Return the model's repeated blocks in module order (the order a forward usually runs them).

    `names` picks the block lists by qualified name (e.g. ["model.layers"]); by default every
    outermost homogeneous `ModuleList` is taken, largest first, skipping lists nested in a chosen one.
    """
    modules = dict(model.named_modules())
    if names is not None:
        lists = []
        for name in names:
            if name not in modules:
                raise WeightstreamError(f"blocks={names!r}: the model has no submodule named {name!r}")
            if not isinstance(modules[name], (nn.ModuleList, nn.Sequential)):
                raise WeightstreamError(
                    f"blocks: {name!r} is a {type(modules[name]).__name__}, not a ModuleList of blocks"
                )
            lists.append(name)
    else:
        candidates = [n for n, m in modules.items() if n and _is_block_list(m)]
        candidates.sort(key=lambda n: -_tensor_bytes(modules[n]))
        lists = []
        for name in candidates:
            nested = any(name.startswith(c + ".") or c.startswith(name + ".") for c in lists)
            if not nested:
                lists.append(name)
    order = {name: i for i, name in enumerate(modules)}
    blocks = [
        Block(f"{lst}.{child}", module)
        for lst in lists
        for child, module in modules[lst].named_children()
    ]
    return sorted(blocks, key=lambda b: order[b.name])
