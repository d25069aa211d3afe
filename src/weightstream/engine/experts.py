"""Counting the expert bytes a mixture of experts reads over the link, from its routers' choices.

Installed only on request (`OffloadHandle.count_experts()`): a forward hook on each router of a block
whose routed experts are off the GPU adds, on the device, how many distinct experts the call's tokens
reached, the call's tokens and one call. No host synchronization and nothing Python-side per call that
a CUDA graph replay would skip: the counts are device tensors, read (synchronizing) only when asked.
Zero-copy experts cost the bytes of the experts reached; streamed ones the whole group's expert bytes
per call, since a copy moves every expert before the router has run; experts behind a GPU expert cache
(`expert_cache.py`) the rows their cache read from host memory, which it counts itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import OffloadStateError
from ..placement.experts import routers


@dataclass(frozen=True)
class RoutedBlock:
    """A block whose routed experts are off the GPU, in bytes: `in_place_bytes` read in place (zero
    copy; each expert is in_place_bytes / experts of them), `streamed_bytes` copied every call."""

    module: nn.Module
    experts: int
    in_place_bytes: int
    streamed_bytes: int


class RouterHooks:
    """Forward hooks on routers (`self.hooks`); `remove()` takes them off."""

    hooks: list

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []


class ExpertCounter(RouterHooks):
    """Forward hooks on the routers of `blocks` and the device counters they add to (see the module
    docstring); `remove()` takes the hooks off."""

    def __init__(self, blocks: list[RoutedBlock], device: torch.device, caches=None) -> None:
        self.caches = caches  # the model's ExpertCaches: they count the bytes of their own blocks
        self.sites: list[tuple[nn.Module, RoutedBlock]] = [
            (router, block) for block in blocks for _, router in routers(block.module)]
        # per router: experts reached (summed over calls), tokens, calls
        self.counts = torch.zeros(len(self.sites), 3, dtype=torch.float64, device=device)
        self.hooks = [router.register_forward_hook(self._hook(i)) for i, (router, _) in enumerate(self.sites)]

    def _hook(self, i: int):
        def count(module: nn.Module, args, output) -> None:
            indices = output[-1]
            reached = torch.zeros(module.num_experts, dtype=torch.float64, device=indices.device)
            reached.index_fill_(0, indices.reshape(-1), 1.0)
            tokens = indices.reshape(-1, indices.shape[-1]).shape[0]
            row = self.counts[i]  # python numbers go in as kernel arguments: no host->device copy
            row[0] += reached.sum()
            row[1] += tokens
            row[2] += 1.0
        return count

    def bytes_per_token(self) -> float | None:
        """Expert bytes read over the link per token since the hooks went on (zero-copy experts reached
        plus streamed expert groups per call, over the tokens of a forward counted once); None before
        any token."""
        counts = self.counts.tolist()  # the one synchronization: when asked
        tokens = max((t for _, t, _ in counts), default=0.0)
        total = sum(reached * block.in_place_bytes / block.experts + calls * block.streamed_bytes
                    for (reached, _, calls), (_, block) in zip(counts, self.sites, strict=True))
        if self.caches is not None:
            cached = self.caches.counts()
            tokens = max(tokens, cached["tokens"])
            total += cached["host_bytes"]
        return total / tokens if tokens else None


class ChoiceCounter(RouterHooks):
    """Forward hooks on `routers` (all of a model's blocks, offloaded or not) adding, on the device, how
    often each expert was chosen: the popularity `OffloadHandle.routing_skew` fits. No host
    synchronization per call; `remove()` takes the hooks off."""

    def __init__(self, found: list[nn.Module], device: torch.device) -> None:
        experts = max((r.num_experts for r in found), default=0)
        self.top_k = found[0].top_k if found else 0
        self.choices = torch.zeros(len(found), experts, dtype=torch.float64, device=device)
        self.hooks = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(found)]

    def _hook(self, i: int):
        def count(module: nn.Module, args, output) -> None:
            indices = output[-1].reshape(-1)
            self.choices[i].index_add_(0, indices, torch.ones_like(indices, dtype=torch.float64))
        return count

    def shares(self, least: int = 4) -> list[list[float]] | None:
        """Each router's share of the choices per expert since the hooks went on; None until the
        routers made `least` choices per expert on average (fewer say little of a popularity)."""
        rows = self.choices.tolist()  # the one synchronization: when asked
        totals = [sum(row) for row in rows]
        if not rows or sum(totals) < least * len(rows) * len(rows[0]):
            return None
        return [[c / total for c in row] for row, total in zip(rows, totals, strict=True) if total]


def routed_on_host(top_k_index: torch.Tensor, experts: int) -> list[int]:
    """The experts (sorted, distinct) some token of `top_k_index` is routed to, read on the host: the
    one synchronization of expert copies per layer. Indices outside 0..experts-1, as expert parallelism
    marks foreign ones, are skipped. Refused inside a CUDA graph capture, which cannot capture it."""
    if top_k_index.is_cuda and torch.cuda.is_current_stream_capturing():
        raise OffloadStateError(
            "weightstream: expert copies read each call's routing on the host, which a CUDA graph "
            "cannot capture: offload with expert_copies=False to decode from CUDA graphs (the routed "
            "experts are then read in place, or through a GPU expert cache)")
    flat = top_k_index.reshape(-1).to(torch.int64)
    hit = torch.zeros(experts + 1, dtype=torch.bool, device=flat.device)
    hit.index_fill_(0, torch.where((flat >= 0) & (flat < experts), flat, experts), True)
    return hit[:experts].nonzero().flatten().tolist()
