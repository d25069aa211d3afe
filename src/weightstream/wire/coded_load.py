"""Compressed groups for `from_pretrained`: each streamed group encoded from its checkpoint tensors.

`from_pretrained` reads tensors straight into their final places, so a compressed group is built one
group at a time: its tensors are read from the shards into a pageable buffer of the group's size (the
only host memory beyond the final places), coded (on the GPU when the target device is one, as
`wire.encode_groups` does), and the blob goes where the group lives. A disk-tier group's blob is
appended to the compressed cache file once (`diskcache.py`); a host group's blob is measured first, so
the arena can be allocated exactly, and coded again into its arena region (`fill_host`; the codec is
deterministic). Groups that do not shrink stay raw: in the arena, or read from the safetensors as
before. Routed experts held coded for expert copies are read the same way, one zero-copy group at a
time (`read_group`), and coded per expert by `engine/coded_experts.py`.
"""

from __future__ import annotations

import os

import torch

from ..engine.host import HostArena
from ..formats.checkpoint import StoredTensor
from ..formats.convert import Source
from ..formats.disk import DiskTier
from ..formats.diskcache import DiskCache
from ..placement.prepare import Prepared, _plain
from . import codec
from .groups import place, sized


def read_group(group: list[tuple], nbytes: int,
               source_of: dict[int, Source]) -> list[tuple[torch.Tensor, int]]:
    """A group's tensors read from their checkpoint tensors (converted to the model's dtype and layout)
    into a new pageable buffer of `nbytes` in the group's layout: (each tensor's view, its offset)."""
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    tensors = []
    for entry, sl in group:
        view = entry.view_of(buf[sl.offset : sl.offset + sl.nbytes])
        source = source_of.get(id(entry))
        if source is None:  # a buffer computed at construction, not stored
            view.copy_(entry.tensor)
        else:
            source.fill(view)
        tensors.append((view, sl.offset))
    return tensors


def _coded(prep: Prepared, source_of: dict[int, Source], g: int) -> codec.EncodedGroup | None:
    """Group `g` read from its checkpoint tensors and encoded; None when it does not shrink or would
    not fit a landing buffer."""
    nbytes = prep.group_bytes[g]
    tensors = read_group(prep.groups[g], nbytes, source_of)
    where = prep.device if prep.device.type == "cuda" else None
    enc = codec.encode_group(tensors, nbytes, where)
    return enc if enc is not None and enc.wire_bytes <= prep.placement.landing_bytes else None


def encode(prep: Prepared, pairs, disk: DiskTier | None, cache_dir: str | os.PathLike | None,
           progress: bool) -> tuple[list[codec.EncodedGroup | None], DiskTier | None]:
    """Encode every streamed group of `prep` (a compressed placement) once; `pairs` are the (entry,
    `formats.convert.Source`) pairs of the checkpoint. Disk groups' blobs are written to a new cache file in
    `cache_dir` (None: a temp folder); returns each group's encoding (its blob a meta tensor of the
    blob's size; None: raw) and the disk tier reading the blobs. Shows a progress bar over groups."""
    from tqdm import tqdm

    source_of = {id(entry): source for entry, source in pairs}
    cache = DiskCache(cache_dir) if disk is not None else None
    wire: list[codec.EncodedGroup | None] = []
    blobs: dict[int, StoredTensor] = {}
    try:
        for g in tqdm(range(len(prep.groups)), desc="weightstream: compressing groups", unit="group",
                      disable=not progress):
            enc = _coded(prep, source_of, g) if all(_plain(e) for e, _ in prep.groups[g]) else None
            if enc is not None:
                if disk is not None and disk.holds(g):
                    blobs[g] = cache.append(enc.blob)
                enc = sized(enc)
            wire.append(enc)
    except BaseException:
        if cache is not None:
            cache.close()
        raise
    if disk is None:
        return wire, None
    if not blobs:  # nothing on disk shrank: no cache to keep
        cache.close()
        cache = None
    return wire, DiskTier(disk.groups, disk.group_bytes, blobs, cache)


def fill_host(arena: HostArena, prep: Prepared, pairs, wire: list[codec.EncodedGroup | None],
              disk: DiskTier | None) -> list[codec.EncodedGroup | None]:
    """Code each compressed host group again straight into its arena region; returns the encodings,
    host ones pointing at the arena (disk ones keep their meta blob: they are read from the cache)."""
    source_of = {id(entry): source for entry, source in pairs}
    placed = []
    for g, enc in enumerate(wire):
        if enc is not None and not (disk is not None and disk.holds(g)):
            enc = place(arena, g, enc, _coded(prep, source_of, g))
        placed.append(enc)
    return placed
