"""A local Hugging Face checkpoint folder: its safetensors shards, read straight into final places.

We parse the safetensors header ourselves (8-byte little-endian length, then JSON) so each tensor can
be read with one positional read straight into its destination (a pinned host region, or a bounce
buffer for the GPU), with no intermediate copy of a whole shard, and so a truncated shard is caught
before anything is read.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError

__all__ = ["CheckpointError", "StoredTensor", "read_index", "read_into"]

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes lie in a shard file."""

    path: Path
    offset: int  # absolute byte offset in the file
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def _read_header(path: Path) -> dict[str, StoredTensor]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path} is truncated: {size} bytes, not even a safetensors header")
        (length,) = struct.unpack("<Q", raw)
        if 8 + length > size:
            raise CheckpointError(
                f"{path} is truncated: its header says {length} bytes, the file has {size}"
            )
        try:
            header = json.loads(f.read(length))
        except ValueError as err:
            raise CheckpointError(f"{path} is not a safetensors file: {err}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is not a safetensors file: its header is not a JSON object")
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, (begin, end), shape = info["dtype"], info["data_offsets"], tuple(info["shape"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"{path}: the header entry of tensor {name} lacks dtype, shape or data_offsets: the file "
                "is not a valid safetensors file (re-save or re-download it)"
            ) from None
        if dtype not in _DTYPES:
            raise CheckpointError(
                f"{path}: tensor {name} has dtype {dtype}, which weightstream cannot read"
            )
        want = _DTYPES[dtype].itemsize * (int(torch.Size(shape).numel()) if shape else 1)
        if end - begin != want:
            raise CheckpointError(
                f"{path}: tensor {name} ({dtype}, shape {list(shape)}) needs {want} bytes but its header "
                f"gives it {end - begin} (data_offsets {begin}..{end}): the file is not a valid safetensors "
                "file (re-save or re-download it)"
            )
        if 8 + length + end > size:
            raise CheckpointError(
                f"{path} is truncated: tensor {name} ends at byte {8 + length + end}, the file has {size} "
                "(re-copy or re-download the shard)"
            )
        tensors[name] = StoredTensor(path, 8 + length + begin, end - begin, _DTYPES[dtype], shape)
    return tensors


# file stems of a checkpoint's weights: transformers' save_pretrained, then diffusers' (a pipeline's models)
WEIGHT_STEMS = ("model", "diffusion_pytorch_model")


def read_index(folder: str | os.PathLike) -> dict[str, StoredTensor]:
    """Every tensor of the checkpoint in `folder` (one `model.safetensors`, or shards listed in
    `model.safetensors.index.json`; diffusers names them `diffusion_pytorch_model.*`), by name. Raises
    CheckpointError for a missing or truncated shard."""
    folder = Path(folder)
    stem = next((s for s in WEIGHT_STEMS if (folder / f"{s}.safetensors.index.json").is_file()
                 or (folder / f"{s}.safetensors").is_file()), WEIGHT_STEMS[0])
    index = folder / f"{stem}.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(
                f"{index} has no weight_map (tensor name -> shard file): re-save the checkpoint"
            )
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise CheckpointError(
                f"{folder}: shard(s) listed in {index.name} are missing: {', '.join(missing)}"
            )
    elif (folder / f"{stem}.safetensors").is_file():
        weight_map, shards = None, [f"{stem}.safetensors"]
    else:
        raise CheckpointError(
            f"{folder} has no model.safetensors nor model.safetensors.index.json: weightstream loads "
            "safetensors checkpoints only"
        )
    tensors: dict[str, StoredTensor] = {}
    for shard in shards:
        tensors.update(_read_header(folder / shard))
    if weight_map is not None:
        absent = sorted(set(weight_map) - set(tensors))
        if absent:
            raise CheckpointError(f"{folder}: the index lists tensors no shard holds, e.g. {absent[:3]}")
    return tensors


def read_json(path: Path) -> dict:
    """The JSON object in `path`; raises CheckpointError naming the file when it is not one."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"{path} is not valid JSON ({err}): fix or re-save the file") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object: fix or re-save the file")
    return data


def read_into(stored: StoredTensor, dst: torch.Tensor) -> None:
    """Read `stored`'s bytes straight into `dst`, a contiguous CPU tensor of exactly that many bytes."""
    buf = memoryview(dst.view(-1).view(torch.uint8).numpy())
    if buf.nbytes != stored.nbytes:
        raise CheckpointError(
            f"{stored.path}: expected {buf.nbytes} bytes for a tensor, the file holds {stored.nbytes}"
        )
    with open(stored.path, "rb", buffering=0) as f:
        done = 0
        while done < stored.nbytes:
            n = os.preadv(f.fileno(), [buf[done:]], stored.offset + done)
            if n <= 0:
                raise CheckpointError(f"{stored.path}: unexpected end of file while reading")
            done += n

