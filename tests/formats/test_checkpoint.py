"""Reading safetensors shards ourselves: headers, truncation, direct reads."""

import pytest
import torch
from safetensors.torch import save_file

from weightstream.formats.checkpoint import CheckpointError, read_index, read_into


def test_read_index_and_read_into_give_the_saved_bytes(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64),
               "c": torch.randn(4).to(torch.bfloat16)}
    save_file(tensors, tmp_path / "model.safetensors")
    index = read_index(tmp_path)
    assert set(index) == {"a", "b", "c"}
    for name, t in tensors.items():
        assert index[name].shape == tuple(t.shape) and index[name].dtype == t.dtype
        out = torch.empty_like(t)
        read_into(index[name], out)
        assert torch.equal(out, t)


def test_truncated_shard_is_caught_before_reading(tmp_path):
    save_file({"a": torch.randn(64, 64)}, tmp_path / "model.safetensors")
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        read_index(tmp_path)


def test_folder_without_safetensors_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="safetensors"):
        read_index(tmp_path)
