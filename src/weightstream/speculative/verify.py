"""One forward of a causal LM over tokens at chosen positions, with a 4-D mask, into a `TreeCache`.

Every forward of the generation loop goes through `TreeForward`: the prefill (a causal mask), the
verify pass over a tree (the tree's ancestor mask) and a draft model's steps. Inputs are copied into
static buffers, one set per token count, so a compiled forward (`fullgraph=True`) sees the same tensors
every pass and replays from a CUDA graph; the prefill, whose length is the prompt's, always runs eagerly.
A 4-D float mask (0 where a token may attend, the dtype's minimum elsewhere) is what transformers 5
passes through to eager and SDPA attention unchanged, for every decoder built on its masking utilities.
Sliding-window layers get a second mask that also hides the keys `sliding_window` or more positions
behind each query (position ids, which the cache records per slot), given as the one mask where every
layer slides, or beside the full one in a dict keyed by layer type where the two kinds alternate.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ..errors import ArgumentError, WeightstreamError
from .cache import TreeCache
from .checks import attention_masks
from .tree import causal_mask, sliding_mask


def cache_keyword(model: nn.Module) -> str:
    """The name `model.forward` takes its KV cache by: `cache` (transformers >= 5.2x) or `past_key_values`."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


class TreeForward:
    """`model` over `cache`: call it with tokens, positions, cache positions and a bool mask; get the
    logits (count, vocab). compile: False, True (`torch.compile(fullgraph=True)`) or a compile mode
    such as "reduce-overhead" (CUDA graphs); it applies to `step`, never to `prefill`."""

    def __init__(self, model: nn.Module, cache: TreeCache, device: torch.device, dtype: torch.dtype,
                 compile: bool | str = False) -> None:
        self.model, self.cache, self.device, self.dtype = model, cache, device, dtype
        self.keyword = cache_keyword(model)
        self.masks = attention_masks(model)
        self._buffers: dict[int, tuple[torch.Tensor, ...]] = {}
        self._step = self._forward
        if compile:
            mode = compile if isinstance(compile, str) else None
            # static shapes: a second token count (a draft model's two steps, a tree shape chosen again)
            # compiles a graph of its own instead of one with dynamic sizes
            self._step = torch.compile(self._forward, fullgraph=True, mode=mode, dynamic=False)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, *masks: torch.Tensor) -> torch.Tensor:
        mask = masks[0] if len(masks) == 1 else {"full_attention": masks[0], "sliding_attention": masks[1]}
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         **{self.keyword: self.cache})
        return out.logits[0]

    def _layer_masks(self, positions: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
        """The bool masks the forward takes, in `_forward`'s order: the full one and/or the sliding one."""
        if self.masks.kind == "full":
            return [mask]
        window = sliding_mask(mask, positions.cpu(), self.cache.slot_positions, self.masks.window)
        return [window] if self.masks.kind == "sliding" else [mask, window]

    def _inputs(self, tokens: torch.Tensor, positions: torch.Tensor, masks: list[torch.Tensor]):
        count, length = masks[0].shape
        buffers = self._buffers.get(count)
        if buffers is None:  # one set per token count, each mask at the static (count, cache length)
            buffers = self._buffers[count] = (
                torch.empty(1, count, dtype=torch.long, device=self.device),
                torch.empty(1, count, dtype=torch.long, device=self.device),
                *(torch.empty(1, 1, count, length, dtype=self.dtype, device=self.device) for _ in masks),
            )
        ids, pos, *additive = buffers
        ids.copy_(tokens.view(1, count))
        pos.copy_(positions.view(1, count))
        for buffer, mask in zip(additive, masks, strict=True):
            # the bool mask crosses (a byte per entry) and becomes 0 / the dtype's minimum on the device
            allowed = mask.to(self.device, non_blocking=True).view(1, 1, count, length)
            buffer.fill_(torch.finfo(self.dtype).min).masked_fill_(allowed, 0.0)
        return buffers

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, write_at: torch.Tensor, mask: torch.Tensor,
            compiled: bool = True) -> torch.Tensor:
        """Logits (count, vocab) of `tokens` (count,) at position ids `positions` (count,), their keys and
        values written at cache positions `write_at` (count,), each attending where `mask` (count, cache
        length) is True (sliding-window layers: and within their window of position ids). compiled: use the
        compiled forward where one was asked for."""
        with torch.no_grad():
            self.cache.set_write_positions(write_at, self.device)
            self.cache.record_positions(write_at, positions)
            inputs = self._inputs(tokens, positions, self._layer_masks(positions, mask))
            forward = self._step if compiled else self._forward
            return forward(*inputs).clone()  # a CUDA graph's output is overwritten by its next replay

    def captured(self, tokens: torch.Tensor, positions: torch.Tensor, write_at: torch.Tensor,
                 mask: torch.Tensor):
        """A function replaying, from a CUDA graph, the eager forward of `run(tokens, positions, write_at,
        mask)`: `run` once eagerly fills the static input buffers and the cache's write positions, then
        the eager forward over those buffers is captured (no compile). Each replay writes the same cache
        entries and returns the same static logits (count, vocab), overwritten by the next replay. CUDA
        only; for timing a pass without compiling it (`weightstream bench --kind speculative --modes
        graph-eager`)."""
        from ..placement.timing import capture_graph

        self.run(tokens, positions, write_at, mask, compiled=False)
        ids, *rest = self._buffers[tokens.numel()]
        with torch.no_grad():
            return capture_graph(lambda static_ids: self._forward(static_ids, *rest), ids)

    def prefill(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Logits of `tokens` (count,) written at [start, start + count) with a causal mask, eagerly."""
        count = tokens.numel()
        positions = torch.arange(count) + start
        try:
            return self.run(tokens, positions, positions, causal_mask(start, count, self.cache.length),
                            compiled=False)
        except Exception as err:  # the model's own forward, eagerly: say which and what it was given
            if isinstance(err, (WeightstreamError, torch.OutOfMemoryError)):
                raise
            first = (str(err).splitlines() or [""])[0][:160]  # a bare assert has no message
            what = f"{type(err).__name__}: {first}" if first else type(err).__name__
            raise ArgumentError(
                f"{type(self.model).__name__}'s forward failed over the static KV cache and 4-D attention "
                f"mask that speculative generation gives it ({what}): its transformers implementation does "
                "not run that way (transformers' DeepSeek-V2 does not); generate with model.generate "
                "instead") from err
