import torch

from weightstream.host import HostArena


def test_arena_is_exact_size_with_disjoint_group_regions():
    sizes = [1024, 4096, 256]
    arena = HostArena(sizes, pin=False)
    assert arena.nbytes == sum(sizes)
    assert arena.pinned_bytes == 0
    for g in range(len(sizes)):
        arena.region(g).fill_(g + 1)
    for g, size in enumerate(sizes):
        region = arena.region(g)
        assert region.numel() == size
        assert torch.all(region == g + 1)
    assert arena.buffer.data_ptr() % 4096 == 0
    arena.close()


def test_failed_pinning_names_the_pin_memory_opt_out(monkeypatch):
    import pytest

    from weightstream.errors import PinnedMemoryError

    class RefusingCudart:  # what cudaHostRegister answers under a container memlock limit
        @staticmethod
        def cudaHostRegister(ptr, size, flags):
            return 2  # cudaErrorMemoryAllocation

    monkeypatch.setattr(torch.cuda, "cudart", lambda: RefusingCudart)
    with pytest.raises(PinnedMemoryError, match="pin_memory=False"):
        HostArena([4096], pin=True)
