import torch

from weightstream.engine import host, replay
from weightstream.engine.host import HostArena


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
    monkeypatch.setattr(host.resource, "getrlimit", lambda which: (64 * 1024, 64 * 1024))
    with pytest.raises(PinnedMemoryError, match=r"pin_memory=False") as refused:
        HostArena([4096], pin=True)
    # the numbers a user needs to choose: the limit and what is available
    assert "locked-memory limit (ulimit -l) 64.00 KiB" in str(refused.value)
    assert "of host memory available" in str(refused.value)
    monkeypatch.setattr(host.resource, "getrlimit", lambda which: (host.resource.RLIM_INFINITY,) * 2)
    with pytest.raises(PinnedMemoryError, match=r"ulimit -l\) unlimited"):
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

    capturing = [False]  # what is_current_stream_capturing says on this thread
    monkeypatch.setattr(torch.cuda, "cudart", lambda: CountingCudart)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("synchronize", device)))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    arena = HostArena([4096], pin=True, device=torch.device("cuda", 1))  # copies go to cuda:1
    ptr = calls[0][1]
    del arena
    gc.collect()
    # copies out of it may still run (the next forward's first groups): its device first, then unpin
    assert calls == [("register", ptr), ("synchronize", 1), ("unregister", ptr)]
    closed = HostArena([4096], pin=True)  # no device given: the current one
    closed.close()
    del closed
    gc.collect()
    # close() unpins, the drop then does nothing
    assert calls[3:] == [("register", calls[3][1]), ("synchronize", 3), ("unregister", calls[3][1])]
    for capture_here in (True, False):  # a capture on this thread, or on another one (counted)
        del calls[:]
        during = HostArena([4096], pin=True)  # dropped while a graph is captured: neither is allowed
        capturing[0] = capture_here
        host.capture_began()
        del during
        gc.collect()
        host.unpin_deferred()  # still capturing: nothing yet
        assert [c[0] for c in calls] == ["register"]
        capturing[0] = False
        host.capture_ended()
        replay.notify()  # the capture's end
        assert [c[0] for c in calls] == ["register", "synchronize", "unregister"]


def test_available_host_memory_is_read_from_meminfo(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384 kB\nMemFree:         1024 kB\nMemAvailable:    2048 kB\n")
    monkeypatch.setattr(host, "MEMINFO", str(meminfo))
    assert host.available_host_bytes() == 2048 * 1024
    monkeypatch.setattr(host, "MEMINFO", str(tmp_path / "absent"))
    assert host.available_host_bytes() is None  # unknown: nothing is checked
    HostArena([10**6], pin=False).close()


def test_host_memory_that_is_not_available_is_refused_before_anything_moves(tmp_path, monkeypatch):
    """Offload and from_pretrained check the host memory the streamed groups need before allocating
    it, and say how much and what to do; the model is untouched and still runs as before."""
    import pytest
    from conftest import make_model, weight_bytes

    import weightstream as ws

    model = make_model("llama", 0)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:      64 kB\n")  # far less than the streamed blocks
    monkeypatch.setattr(host, "MEMINFO", str(meminfo))
    with pytest.raises(ws.HostMemoryError, match=r"need .* of host memory, but 64.00 KiB is available: "
                                                 r"give more of the model to the GPU .*cpu_memory"):
        ws.offload(model, gpu_memory=weight_bytes(model) // 2, device="cpu", strategy="stream")
    assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())
    assert getattr(model, "_weightstream_handle", None) is None
    model.save_pretrained(tmp_path / "ckpt")
    with pytest.raises(ws.HostMemoryError, match="cpu_memory"):
        ws.from_pretrained(tmp_path / "ckpt", weight_bytes(model) // 2, device="cpu", strategy="stream",
                           progress=False)
    monkeypatch.undo()
    handle = ws.offload(model, gpu_memory=weight_bytes(model) // 2, device="cpu", strategy="stream")
    assert handle.stats.streamed_bytes > 0
    handle.restore()
