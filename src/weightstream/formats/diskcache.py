"""The compressed cache of the disk tier: one file of encoded groups per offload.

With `compress=True`, a disk-tier group that shrinks is encoded once at load (`codec.encode_group`)
and its blob appended to this file; every forward then reads the blob (fewer bytes than the group's
safetensors bytes) instead of the raw tensors. The file lies in a folder the user chooses
(`from_pretrained(cache_dir=...)`), else in a new temp folder; it holds the blobs back to back
(`nbytes`, at most 0.95 of the coded groups' raw bytes) and is deleted, with the temp folder, when the
handle is restored or the cache is garbage collected.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from pathlib import Path

import torch

from ..errors import ArgumentError
from .checkpoint import StoredTensor


class DiskCache:
    """An append-only file of compressed group blobs in `folder` (None: a new temp folder)."""

    def __init__(self, folder: str | os.PathLike | None = None) -> None:
        self.own_folder = folder is None
        try:
            if folder is None:
                folder = tempfile.mkdtemp(prefix="weightstream-cache-")
            folder = Path(folder)
            folder.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix="weightstream-", suffix=".blobs", dir=folder)
        except OSError as err:
            raise ArgumentError(
                f"cache_dir={str(folder)!r}: cannot create the compressed disk-tier cache file there "
                f"({err.strerror or err}). Pass cache_dir= a folder you can write to, with room for the "
                "disk groups' compressed bytes, or compress=False"
            ) from None
        self.folder = folder
        self.path = Path(name)
        self.nbytes = 0
        self._file = os.fdopen(fd, "wb")
        self._remove = weakref.finalize(self, _remove, self._file, self.path,
                                        folder if self.own_folder else None)

    def append(self, blob: torch.Tensor) -> StoredTensor:
        """Write `blob` (uint8, any device) at the end of the file; where it lies (as a StoredTensor
        of uint8, so `checkpoint.read_into` reads it back)."""
        data = blob.detach().cpu().contiguous().numpy()
        try:
            self._file.write(memoryview(data))
            self._file.flush()
        except OSError as err:
            raise ArgumentError(
                f"cache_dir={str(self.folder)!r}: writing the compressed disk-tier cache {self.path.name} "
                f"failed after {self.nbytes} bytes ({err.strerror or err}). Free space there, pass "
                "cache_dir= another folder, or compress=False"
            ) from None
        stored = StoredTensor(self.path, self.nbytes, data.nbytes, torch.uint8, (data.nbytes,))
        self.nbytes += data.nbytes
        return stored

    def close(self) -> None:
        """Delete the file (and the temp folder it made)."""
        self._remove()


def _remove(file, path: Path, folder: Path | None) -> None:
    file.close()
    path.unlink(missing_ok=True)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
