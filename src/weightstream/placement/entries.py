"""The model's tensors as weightstream sees them: each distinct parameter or buffer (tied copies are one
`Entry`) with every place in the model that refers to it (`TensorSite`) and the block that owns it, and
the one way to point every site at a new value. Used by `prepare.py` (collect, plan), `offload.py`
(final places, restore) and `hf.py` (load into place).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..formats import subclass
from . import kinds


@dataclass(frozen=True)
class TensorSite:
    """Where a tensor lives in the model: `module.<name>` is a parameter or a buffer."""

    module: nn.Module
    name: str
    is_param: bool

    @property
    def persistent(self) -> bool:
        """True for a parameter or a buffer saved in the state dict (and so in checkpoints)."""
        return self.is_param or self.name not in self.module._non_persistent_buffers_set


@dataclass(eq=False)  # compared by identity: the fields hold tensors
class Entry:
    """One distinct tensor (tied copies share one entry) and every site that refers to it."""

    tensor: torch.Tensor
    sites: list[TensorSite]
    owner: int | None  # block index when only that block refers to it, else None (stays resident)
    name: str = ""  # qualified name of its first site, for messages

    def __post_init__(self) -> None:
        self.shape = tuple(self.tensor.shape)
        self.dtype = self.tensor.dtype
        # a wrapper subclass (torchao) is stored as its inner tensors' bytes (subclass.py); None: plain
        self.flat = kinds.check(self.tensor, self.name or "a tensor")
        self.nbytes = self.flat.nbytes if self.flat else self.tensor.numel() * self.tensor.element_size()
        self.bf16_bytes = kinds.bf16_bytes(self.tensor, self.nbytes)  # what a bf16 GEMM would read
        # a dense tensor laid out in another order (a transposed weight, channels_last) keeps its strides
        # where it is placed, since kernels choose their paths, and so their bits, by layout; None: rows
        t = self.tensor
        self.stride = (None if self.flat or t.is_contiguous() or not _dense(t) else tuple(t.stride()))

    def view_of(self, raw: torch.Tensor) -> torch.Tensor:
        """View `raw` (uint8 bytes of exactly this tensor) as this tensor: its dtype and shape, or its
        subclass rebuilt over views of `raw`."""
        if self.flat:
            return self.flat.view_of(raw)
        values = raw.view(self.dtype)
        if self.stride is None:
            return kinds.with_class_of(self.tensor, values.view(self.shape))
        return kinds.with_class_of(self.tensor, values.as_strided(self.shape, self.stride))

    def empty(self, device: torch.device) -> torch.Tensor:
        """A new uninitialized tensor like this one on `device`."""
        if self.flat:
            return self.flat.empty(device)
        shape, dtype = self.shape, self.dtype
        if self.stride is not None:
            return kinds.with_class_of(self.tensor, torch.empty_strided(shape, self.stride, dtype=dtype,
                                                                        device=device))
        return kinds.with_class_of(self.tensor, torch.empty(shape, dtype=dtype, device=device))

    def own(self) -> torch.Tensor:
        """This tensor as its own final place (it stays where it is)."""
        return self.tensor if self.flat else self.tensor.detach()

    def is_at(self, place: torch.Tensor) -> bool:
        """True when `place` is this tensor's own memory (nothing to copy)."""
        if self.flat:
            return place is self.tensor
        return place.device == self.tensor.device and place.data_ptr() == self.tensor.data_ptr()

    def copy_to(self, place: torch.Tensor) -> None:
        """Copy this tensor's values into `place` (one of `view_of` / `empty`), inner tensors included."""
        if self.flat:
            subclass.copy_leaves(place, self.tensor)
        else:
            place.copy_(self.tensor.detach())

    def copy_of(self, raw: torch.Tensor, device: torch.device) -> torch.Tensor:
        """This tensor rebuilt from its bytes `raw` into new memory on `device`."""
        if self.flat:
            return self.flat.copy_of(raw, device)
        return self.view_of(raw).to(device, copy=True)

    def moved(self, device: torch.device) -> torch.Tensor:
        """A copy of this tensor on `device`."""
        if not self.flat:
            return self.tensor.to(device)
        place = self.empty(device)
        self.copy_to(place)
        return place


def _dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill exactly `numel` consecutive places of its storage (any order)."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape, strict=True) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def module_blocks(blocks: list[nn.Module]) -> dict[int, int | None]:
    """The block index of every module inside `blocks`, by id; None for a module two blocks hold (one
    object registered in both, or the same block twice): its tensors stay resident."""
    block_of: dict[int, int | None] = {}
    for i, block in enumerate(blocks):
        for module in block.modules():
            block_of[id(module)] = i if block_of.get(id(module), i) == i else None
    return block_of


def _collect(model: nn.Module, blocks: list[nn.Module], keep: frozenset[str] = frozenset()) -> list[Entry]:
    """Every distinct parameter and buffer of the model, with its sites and owning block (none for a
    tensor whose qualified name is in `keep`: it stays resident)."""
    block_of = module_blocks(blocks)
    entries: dict[int, Entry] = {}
    for module_name, module in model.named_modules():
        owner = block_of.get(id(module))
        tensors = [(n, t, True) for n, t in module._parameters.items()]
        tensors += [(n, t, False) for n, t in module._buffers.items()]
        for name, tensor, is_param in tensors:
            if tensor is None:
                continue
            site = TensorSite(module, name, is_param)
            entry = entries.get(id(tensor))
            if entry is None:
                qualified = f"{module_name}.{name}" if module_name else name
                streamable = owner is not None and site.persistent and qualified not in keep
                entries[id(tensor)] = Entry(tensor, [site], owner if streamable else None, qualified)
            else:
                entry.sites.append(site)
                if entry.owner != owner:
                    entry.owner = None  # shared across blocks or with the rest: stays resident
    return list(entries.values())


def _set_tensor(entry: Entry, value: torch.Tensor) -> None:
    """Point every site of `entry` at `value` (parameters keep their identity, except meta ones, which
    are replaced at every site by one new parameter, as are wrapper subclasses: their inner tensors
    are Python attributes, which `.data =` would not move; and inference tensors, made under
    torch.inference_mode, which keep no version counter for the engine to watch)."""
    if entry.flat is not None and value is entry.tensor:
        return
    if (isinstance(entry.tensor, nn.Parameter) and not entry.tensor.is_meta and entry.flat is None
            and not (entry.tensor.is_inference() and not value.is_inference())):
        entry.tensor.data = value
        return
    if isinstance(entry.tensor, nn.Parameter):
        value = nn.Parameter(value, requires_grad=False)
        for site in entry.sites:
            site.module._parameters[site.name] = value
        entry.tensor = value
        return
    for site in entry.sites:
        site.module._buffers[site.name] = value
    entry.tensor = value

