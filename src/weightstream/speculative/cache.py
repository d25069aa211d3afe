"""A static KV cache written at positions the caller chooses, so a tree can be verified in place.

transformers' own `StaticCache` writes each forward's keys right after the last ones it wrote; a verify
pass needs to write a whole tree, keep the accepted path and drop the rest. `TreeCache` answers the
calls transformers' attention layers make of a cache (`update`, `get_seq_length`), writes at
`write_at` (set before each forward) and hands back the whole static buffer; the 4-D mask passed with
the forward says which entries each token sees, so rejected entries are never read and are overwritten
by the next tree. Buffers are allocated once, at the first forward, and keep their addresses (marked
static for torch.compile and CUDA graphs).
"""

from __future__ import annotations

import torch


def kv_bytes(config, length: int, dtype: torch.dtype) -> int:
    """Bytes of the keys and values of `length` positions of a decoder with this transformers config."""
    layers = config.num_hidden_layers
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * layers * heads * head_dim * length * torch.empty((), dtype=dtype).element_size()


class TreeCache:
    """Keys and values of `layers` layers over `length` positions, batch 1.

    The model calls `update(keys, values, layer)` in every attention layer; the new entries go to the
    positions `write_at` holds (set by `set_write_positions`, one static buffer per count of tokens).
    """

    is_compileable = True

    def __init__(self, layers: int, length: int) -> None:
        self.length = length
        self.is_sliding = [False] * layers  # every layer attends to the whole cache (masks find a full layer)
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers
        self.write_at: torch.Tensor | None = None
        self.filled = 0  # positions [0, filled) hold committed tokens (host-side bookkeeping)
        # the position id of the token each slot holds (host side): a tree node's is its depth past the
        # root's, not its slot, and sliding-window masks measure distance in position ids
        self.slot_positions = torch.arange(length)
        self._positions: dict[int, torch.Tensor] = {}

    def set_write_positions(self, positions: torch.Tensor, device: torch.device) -> None:
        """Where the next forward's tokens go: (count,) int64 cache positions, copied into this count's
        static buffer."""
        count = positions.numel()
        buffer = self._positions.get(count)
        if buffer is None:
            buffer = self._positions[count] = torch.empty(count, dtype=torch.long, device=device)
            _mark_static(buffer)
        buffer.copy_(positions)
        self.write_at = buffer

    def record_positions(self, write_at: torch.Tensor, positions: torch.Tensor) -> None:
        """The next forward writes tokens of position ids `positions` at cache slots `write_at` (both
        (count,) int64)."""
        self.slot_positions[write_at.cpu()] = positions.cpu()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write the new entries (batch, heads, count, head dim) at `write_at`; return the whole buffers."""
        if self.keys[layer_idx] is None:
            self.keys[layer_idx] = self._allocate(key_states)
            self.values[layer_idx] = self._allocate(value_states)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, self.write_at, key_states)
        values.index_copy_(2, self.write_at, value_states)
        return keys, values

    def _allocate(self, like: torch.Tensor) -> torch.Tensor:
        batch, heads, _, dim = like.shape
        buffer = torch.zeros(batch, heads, self.length, dim, dtype=like.dtype, device=like.device)
        _mark_static(buffer)
        return buffer

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.filled

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.length

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the entries at positions `src` to positions `dst` in every layer (all read before any is
        written, so the two may overlap)."""
        self.slot_positions[dst.cpu()] = self.slot_positions[src.cpu()]
        for buffers in (self.keys, self.values):
            for buffer in buffers:
                if buffer is not None:
                    moved = buffer.index_select(2, src.to(buffer.device))
                    buffer.index_copy_(2, dst.to(buffer.device), moved)

    def nbytes(self) -> int:
        """Bytes allocated so far."""
        return sum(b.numel() * b.element_size() for b in self.keys + self.values if b is not None)


def _mark_static(tensor: torch.Tensor) -> None:
    """Tell torch.compile the tensor keeps its address (CUDA graphs then read it in place)."""
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(tensor)
