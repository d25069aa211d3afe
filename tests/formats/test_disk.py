"""The disk reader ring, on the CPU: order, refills, and the restart after an out-of-order request."""

import torch
from safetensors.torch import save_file

from weightstream.formats.checkpoint import read_index
from weightstream.formats.disk import DiskPrefetcher, DiskTier
from weightstream.formats.diskcache import DiskCache
from weightstream.placement.layout import pack


class Done:  # stands in for a CUDA event that has already fired
    def synchronize(self):
        pass


def make_tier(tmp_path, n_groups=5):
    tensors = {f"g{g}.w": torch.full((16,), float(g)) for g in range(n_groups)}
    save_file(tensors, tmp_path / "model.safetensors")
    index = read_index(tmp_path)
    slices, size = pack([64])
    groups = {g: [(index[f"g{g}.w"], slices[0])] for g in range(n_groups)}
    return DiskTier(groups, {g: size for g in range(n_groups)})


def value_in(buffer):
    return buffer[:64].view(torch.float32)[0].item()


def test_reader_serves_groups_in_order_and_cycles(tmp_path):
    reader = DiskPrefetcher(make_tier(tmp_path), n_buffers=2, nbytes=256, pin=False)
    for g in [0, 1, 2, 3, 4, 0, 1]:
        buffer, index = reader.take(g)
        assert value_in(buffer) == g
        reader.give_back(index, Done())
    reader.close()


def test_out_of_order_request_restarts_the_ring_after_it(tmp_path):
    reader = DiskPrefetcher(make_tier(tmp_path), n_buffers=2, nbytes=256, pin=False)
    assert reader.take(3) is None  # the caller reads group 3 itself
    buffer, index = reader.take(4)
    assert value_in(buffer) == 4
    reader.give_back(index, Done())
    buffer, _ = reader.take(0)
    assert value_in(buffer) == 0
    reader.close()


def test_compressed_groups_are_read_from_the_cache_into_buffers_sized_for_them(tmp_path):
    raw = make_tier(tmp_path)
    cache = DiskCache(tmp_path / "cache")
    blobs = {g: cache.append(torch.full((8 + g,), g, dtype=torch.uint8)) for g in (1, 3)}  # stand-in blobs
    tier = DiskTier(raw.groups, raw.group_bytes, blobs, cache)
    assert tier.max_read_bytes == raw.group_bytes[0] and tier.wire_bytes == 3 * 64 + 9 + 11  # layout, tensors
    reader = DiskPrefetcher(tier, n_buffers=2, nbytes=tier.max_read_bytes, pin=False)
    for g in range(5):
        buffer, index = reader.take(g)
        if g in blobs:
            assert torch.equal(buffer, torch.full((8 + g,), g, dtype=torch.uint8))
        else:
            assert value_in(buffer) == g
        reader.give_back(index, Done())
    reader.close()
    assert tier.bytes_read >= tier.wire_bytes
    path = cache.path
    tier.close()
    assert not path.exists() and (tmp_path / "cache").is_dir()
