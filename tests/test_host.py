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


def test_a_dropped_pinned_arena_is_unregistered_once(monkeypatch):
    import gc

    calls = []

    class CountingCudart:
        @staticmethod
        def cudaHostRegister(ptr, size, flags):
            calls.append(("register", ptr))
            return 0

        @staticmethod
        def cudaHostUnregister(ptr):
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: CountingCudart)
    arena = HostArena([4096], pin=True)
    ptr = calls[0][1]
    del arena
    gc.collect()
    assert calls == [("register", ptr), ("unregister", ptr)]
    closed = HostArena([4096], pin=True)
    closed.close()
    del closed
    gc.collect()
    assert [c[0] for c in calls[2:]] == ["register", "unregister"]  # close() then the drop: once
