"""Coded expert copies: routed experts held compressed in host memory, copied and decoded per call.

With `Placement.copy_landing_bytes`, each block of `expert_copies` keeps its routed experts in the
pinned arena as one record per expert: the expert's rows of every routed tensor coded by the wire
codec (`wire/codec.py`) into one blob whose segments decode straight to the rows' places in the
layer's work buffer, or, where coding would not shrink them (or the blob would not fit a landing
buffer), the rows raw, one after another. The work buffer of a layer has the zero-copy group's own
layout (its routed tensors packed one after another, `layout.pack`), so a decode's destination offsets
are the group's, and decoding every record of a group gives the group's raw bytes back (`raw_group`:
what `state_dict()` and `restore()` read).

Each call (`CodedCopy.gather`), once the host has read which experts are routed (as `ExpertCopy`
does), each routed coded expert's blob is copied by the copy engine into one of two landing buffers on
a copy stream, and decoded on the current stream once it has landed (`triton_decoder.decode`), so the
next expert's copy overlaps this one's decode; raw records are copied into their rows on the current
stream. A landing buffer is copied into again only after its last decode (an event). Off CUDA the same
records are decoded by the reference decoder (`codec.decode_group`), which the GPU kernel matches bit
for bit.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from ..wire import codec
from .experts import routed_on_host

_ALIGN = 16


@dataclass(frozen=True)
class Record:
    """One expert's bytes in its group's arena region: at `offset`, `nbytes` long; `chunks` > 0: a
    codec blob of that many decoder programs; 0: its rows raw, tensor after tensor."""

    offset: int
    nbytes: int
    chunks: int


def sources(group: list[tuple]) -> list[tuple[torch.Tensor, int]]:
    """A zero-copy group's routed tensors as `size_groups` and `fill_groups` read them: (the tensor,
    experts first, its byte offset in the group's layout)."""
    return [(entry.tensor.detach(), sl.offset) for entry, sl in group]


def _row_bytes(t: torch.Tensor) -> int:
    return t[0].numel() * t.element_size()


def _rows(group: list[tuple[torch.Tensor, int]], expert: int) -> list[tuple[torch.Tensor, int]]:
    """(expert `expert`'s rows of each routed tensor of `group` (`sources`), their byte offset in the
    group's layout)."""
    return [(t[expert], offset + expert * _row_bytes(t)) for t, offset in group]


def _raw_bytes(group: list[tuple[torch.Tensor, int]]) -> int:
    """One expert's raw bytes in every routed tensor of `group`."""
    return sum(_row_bytes(t) for t, _ in group)


def _encode(group: list[tuple[torch.Tensor, int]], expert: int, group_bytes: int, landing_bytes: int,
            device: torch.device | None) -> codec.EncodedGroup | None:
    """Expert `expert`'s blob, or None where it is copied raw: a row at an offset the decoder cannot
    write (not a multiple of 16 bytes), coding that would not shrink it, or a blob over `landing_bytes`."""
    rows = _rows(group, expert)
    if any(dst % _ALIGN or (t.numel() * t.element_size()) % _ALIGN for t, dst in rows):
        return None
    enc = codec.encode_group(rows, group_bytes, device)
    if enc is None or enc.wire_bytes > min(landing_bytes, codec.MAX_RATIO * _raw_bytes(group)):
        return None
    return enc


def size_groups(groups: Iterable[list[tuple[torch.Tensor, int]]], group_bytes: list[int], landing_bytes: int,
                device: torch.device, progress: bool | None = None) -> list[list[Record]]:
    """Code every expert of each group (`sources`, one group at a time: an iterable may read each from
    a checkpoint) on `device` when it is a GPU, to learn its record's size; the blobs are not kept, so
    the arena can be allocated exactly before `fill_groups` writes them. Shows a progress bar over groups
    (tqdm; `progress` None: on a terminal). Warns where experts are copied raw."""
    where = device if device.type == "cuda" else None
    layouts, raw_count, total = [], 0, 0
    bar = tqdm(zip(groups, group_bytes, strict=True), total=len(group_bytes), unit="layer",
               desc="weightstream: compressing routed experts",
               disable=False if progress else None if progress is None else True)
    for group, nbytes in bar:
        experts = group[0][0].shape[0]
        records, cursor = [], 0
        for e in range(experts):
            enc = _encode(group, e, nbytes, landing_bytes, where)
            size = enc.wire_bytes if enc is not None else -(-_raw_bytes(group) // _ALIGN) * _ALIGN
            records.append(Record(cursor, size, enc.chunks if enc is not None else 0))
            cursor += size
            raw_count += enc is None
            total += 1
        layouts.append(records)
    if raw_count:
        warnings.warn(f"weightstream: {raw_count} of {total} routed experts placed for coded copies are "
                      "copied raw: their rows would not shrink, sit at offsets the GPU decoder cannot write, "
                      "or code larger than the planned landing buffer (those cross the link at full size)",
                      stacklevel=4)
    return layouts


def fill_groups(regions: list[torch.Tensor], groups: Iterable[list[tuple[torch.Tensor, int]]],
                group_bytes: list[int], layouts: list[list[Record]], landing_bytes: int,
                device: torch.device) -> None:
    """Write each expert's record into its group's arena region (`regions`, host bytes), coding it
    again (the codec is deterministic: a different size is a bug, raised). `groups` as `size_groups`
    read them."""
    where = device if device.type == "cuda" else None
    for region, group, nbytes, records in zip(regions, groups, group_bytes, layouts, strict=True):
        for e, rec in enumerate(records):
            out = region[rec.offset : rec.offset + rec.nbytes]
            if rec.chunks:
                enc = _encode(group, e, nbytes, landing_bytes, where)
                if enc is None or enc.wire_bytes != rec.nbytes:
                    raise RuntimeError(f"weightstream: expert {e} of a coded layer encoded to a different "
                                       "size the second time")
                out.copy_(enc.blob)
                continue
            cursor = 0
            for t, _ in _rows(group, e):
                n = t.numel() * t.element_size()
                out[cursor : cursor + n].copy_(t.reshape(-1).view(torch.uint8))
                cursor += n


def raw_group(region: torch.Tensor, group: list[tuple], group_bytes: int,
              records: list[Record]) -> torch.Tensor:
    """The group's raw bytes in its layout (a new CPU tensor), decoded from its records in `region`
    (host bytes) by the reference decoder."""
    out = torch.zeros(group_bytes, dtype=torch.uint8)
    for e, rec in enumerate(records):
        src = region[rec.offset : rec.offset + rec.nbytes]
        if rec.chunks:
            codec.decode_group(src, out)
            continue
        cursor = 0
        for entry, sl in group:
            row = entry.nbytes // entry.shape[0]
            out[sl.offset + e * row : sl.offset + (e + 1) * row].copy_(src[cursor : cursor + row])
            cursor += row
    return out


class Landing:
    """Two device buffers that coded experts' blobs land in, a copy stream, and each buffer's events
    (`landed`: its last copy; `decoded`: its last decode), shared by every coded layer of a model."""

    def __init__(self, nbytes: int, device: torch.device, n: int = 2) -> None:
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(n)]
        self.next = 0
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
            self.landed = [torch.cuda.Event() for _ in range(n)]
            self.decoded = [torch.cuda.Event() for _ in range(n)]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def decode(self, blob: torch.Tensor, out: torch.Tensor, chunks: int) -> None:
        """Copy `blob` (pinned host bytes) into the next landing buffer once its last decode is done, and
        decode it into `out` (the work buffer, flat bytes) on the current stream once it has landed."""
        i = self.next
        self.next = (i + 1) % len(self.buffers)
        buf = self.buffers[i][: blob.numel()]
        if not self.cuda:
            buf.copy_(blob)
            codec.decode_group(buf, out)
            return
        from ..wire import triton_decoder

        current = torch.cuda.current_stream(buf.device)
        self.stream.wait_event(self.decoded[i])
        with torch.cuda.stream(self.stream):
            buf.copy_(blob, non_blocking=True)
            self.landed[i].record(self.stream)
        current.wait_event(self.landed[i])
        triton_decoder.decode(buf, out, chunks)
        self.decoded[i].record(current)


class CodedCopy:
    """One experts module whose routed experts are held coded (`Record`s in `host`, its group's pinned
    arena region as the host addresses it) and decoded into `flat`, the layer's work buffer in the
    group's layout, every call. `tensors` (engine/expert_cache.CachedTensor) give each routed tensor's
    work rows, into which raw records are copied."""

    pool_bytes = 0

    def __init__(self, module, tensors: list, experts: int, host: torch.Tensor, flat: torch.Tensor,
                 records: list[Record], landing: Landing) -> None:
        self.module, self.tensors, self.experts = module, tensors, experts
        self.row_bytes = sum(t.host.shape[1] for t in tensors)
        self.host, self.flat, self.records, self.landing = host, flat, records, landing
        self.wire_bytes = sum(r.nbytes for r in records)

    def gather(self, top_k_index: torch.Tensor) -> None:
        """Decode (or copy, where raw) every expert some token of `top_k_index` is routed to into the
        work buffer (indices outside 0..experts-1 are skipped)."""
        for e in routed_on_host(top_k_index, self.experts):
            rec = self.records[e]
            src = self.host[rec.offset : rec.offset + rec.nbytes]
            if rec.chunks:
                self.landing.decode(src, self.flat, rec.chunks)
                continue
            cursor = 0
            for t in self.tensors:
                n = t.work.shape[1]
                t.work[e].copy_(src[cursor : cursor + n], non_blocking=True)
                cursor += n
