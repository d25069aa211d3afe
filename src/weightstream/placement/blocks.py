"""Find the repeated blocks of a model: the units weightstream streams as whole groups.

A block list is an `nn.ModuleList` (or `nn.Sequential`) of two or more modules that each hold weights:
a transformer's decoder layers, a hybrid model's mix of attention and Mamba layers (Jamba), a UNet's
down blocks, or the model itself when it is such a list. Lists nested inside a chosen list (MoE
experts inside a layer) are not chosen separately: the outer block streams them with it. The order
blocks run in is learned by the schedule, so a list need not run in module order.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..errors import WeightstreamError


@dataclass(frozen=True)
class Block:
    """One repeated block: its qualified name in the model and the module itself."""

    name: str
    module: nn.Module


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's distinct parameters and buffers (meta tensors count their size)."""
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
        and all(module_bytes(c) > 0 for c in children)
    )


def _block_name(lst: str, child: str) -> str:
    return f"{lst}.{child}" if lst else child


def _container(name: str, modules: dict[str, nn.Module]) -> bool:
    """True for a list of unlike modules (e.g. [encoder, decoder]) whose weights lie mostly in longer
    block lists inside it: those are the blocks, not its few large children."""
    outer = modules[name]
    if len({type(c) for c in outer.children()}) == 1:
        return False
    size = len(list(outer.children()))
    inner = [n for n, m in modules.items() if _inside(n, name) and _is_block_list(m)]
    longer = [n for n in inner if len(list(modules[n].children())) > size]
    outermost = [n for n in longer if not any(_inside(n, o) for o in longer)]
    return bool(outermost) and 2 * sum(module_bytes(modules[n]) for n in outermost) >= module_bytes(outer)


def _inside(name: str, outer: str) -> bool:
    """True when module `name` lies inside module `outer` ("" is the root)."""
    return outer == "" and name != "" or name.startswith(outer + ".")


def find_blocks(model: nn.Module, names: list[str] | None = None) -> list[Block]:
    """Return the model's repeated blocks in module order (the order a forward usually runs them).

    `names` picks the block lists by qualified name (e.g. ["model.layers"]; "" is the model itself);
    by default every outermost block list is taken, largest first, skipping lists nested in a chosen
    one.
    """
    modules = dict(model.named_modules())
    if names is not None:
        lists = []
        for name in names:
            if not isinstance(name, str) or name not in modules:
                lists_here = [n or "(the model itself)" for n, m in modules.items() if _is_block_list(m)]
                raise WeightstreamError(
                    f"blocks={names!r}: the model has no submodule named {name!r}; its block lists are: "
                    + (", ".join(lists_here[:8]) or "none")
                )
            if not isinstance(modules[name], (nn.ModuleList, nn.Sequential)):
                raise WeightstreamError(
                    f"blocks: {name!r} is a {type(modules[name]).__name__}, not an nn.ModuleList or "
                    "nn.Sequential of blocks: name the list that holds the blocks"
                )
            lists.append(name)
    else:
        candidates = [n for n, m in modules.items() if _is_block_list(m) and not _container(n, modules)]
        candidates.sort(key=lambda n: -module_bytes(modules[n]))
        lists = []
        for name in candidates:
            nested = any(_inside(name, c) or _inside(c, name) for c in lists)
            if not nested:
                lists.append(name)
    order = {name: i for i, name in enumerate(modules)}
    blocks = [
        Block(_block_name(lst, child), module)
        for lst in lists
        for child, module in modules[lst].named_children()
    ]
    return sorted(blocks, key=lambda b: order[b.name])
