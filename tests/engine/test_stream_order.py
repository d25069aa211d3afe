"""The CUDA transfers' stream ordering, checked on the CPU: the real `StreamEngine.wait` / `release`,
`CudaTransfer`, `CodedCudaTransfer` and `Landings` drive fake streams and events that keep vector
clocks, so every write into a slot or landing buffer must be ordered after every earlier write and read
of it, and every read (a block's compute, a decode) after the write it reads, with the group it expects.

The synchronous CPU backend cannot see such races: its copies happen at once. This found one on the
CPU before any GPU did (2026-12-05): where a model streams some groups raw and some compressed, a raw
copy (copy stream) and a decode (decode stream) into the same slot were ordered only through compute,
so a new pass started while the last forward's copies were in flight could read a slot the other
stream was still writing (`CudaTransfer.after_last_write` orders them).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import types
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import weightstream.engine.transfer as transfer_module
import weightstream.wire.groups as wire_module
from weightstream.engine.engine import StreamEngine
from weightstream.engine.schedule import Schedule
from weightstream.engine.watch import TensorWatch


class Race(AssertionError):
    """Two accesses to one buffer not ordered on the GPU, or a read of the wrong group."""


class Stream:
    """A stream: a vector clock that ticks at each access enqueued on it."""

    names = itertools.count()

    def __init__(self, name: str | None = None) -> None:
        self.name = name or f"side{next(Stream.names)}"
        self.clock = {self.name: 0}

    def tick(self) -> dict:
        self.clock[self.name] += 1
        return dict(self.clock)

    def merge(self, clock: dict) -> None:
        for k, v in clock.items():
            self.clock[k] = max(self.clock.get(k, 0), v)

    def wait_stream(self, other: Stream) -> None:
        self.merge(other.clock)

    def wait_event(self, event: Event) -> None:
        if event.clock is None:  # an event never recorded: nothing to wait for, as in CUDA
            return
        if event.capture != FAKE.capture:  # CUDA forbids it (merging captures, or eager on captured)
            def where(capture):
                return f"in capture {capture}" if capture else "eagerly"

            raise Race(f"{self.name} waits {where(FAKE.capture)} on an event recorded {where(event.capture)}")
        self.merge(event.clock)

    def synchronize(self) -> None:
        pass


class Event:
    def __init__(self, *args, **kwargs) -> None:
        self.clock: dict | None = None
        self.capture: int | None = None  # the capture it was recorded in, None: eagerly

    def record(self, stream: Stream | None = None) -> None:
        self.clock = dict((stream or FAKE.current).clock)
        self.capture = FAKE.capture


def before(stream: Stream, clock: dict, later: dict) -> bool:
    """Whether an access at `clock` on `stream` happens before one whose clock is `later`."""
    return clock[stream.name] <= later.get(stream.name, -1)


class Buffer:
    """A GPU buffer's accesses: its writes (what, stream, clock) and the reads since the last write."""

    def __init__(self, name: str) -> None:
        self.name, self.writes, self.reads = name, [], []

    def __getitem__(self, _):  # buffer[: n] is the buffer itself here
        return self

    def copy_(self, src, non_blocking=False) -> None:
        write(self, src.content)

    def record_stream(self, stream) -> None:
        pass


def write(buf: Buffer, what) -> None:
    FAKE.record(write, buf, what)
    stream = FAKE.current
    clock = stream.tick()
    for _, s, c in buf.writes + buf.reads:
        if not before(s, c, clock):
            raise Race(f"{buf.name}: writing {what} on {stream.name} is not ordered after {s.name}")
    buf.writes, buf.reads = [(what, stream, clock)], []


def read(buf: Buffer, want) -> None:
    FAKE.record(read, buf, want)
    stream = FAKE.current
    clock = stream.tick()
    if not buf.writes:
        raise Race(f"{buf.name}: read before any write")
    what, s, c = buf.writes[-1]
    if not before(s, c, clock):
        raise Race(f"{buf.name}: read for {want} on {stream.name} not ordered after the write on {s.name}")
    if what != want:
        raise Race(f"{buf.name}: holds {what}, read expects {want} (stale)")
    buf.reads.append((want, stream, clock))


class FakeCuda:
    """What the transfers use of torch.cuda: streams, events, the current stream, capture state."""

    Event = Event

    def __init__(self) -> None:
        self.compute = self.current = Stream("compute")
        self.capture: int | None = None  # the capture under way (all streams join it), None: eager
        self.captures = itertools.count(1)
        self.graph: list = []  # the accesses the last capture recorded, in the order they were enqueued

    def record(self, access, buf: Buffer, what) -> None:
        """Keep an access made inside a capture: a replay makes it again."""
        if self.capture is not None:
            self.graph.append((access, buf, what))

    def replay(self) -> None:
        """Replay the last captured graph: its accesses run again, in the order they were captured, all
        after the work enqueued on the current (compute) stream before the replay and before the work
        enqueued on it after. Running them one after another on that stream orders them more than the
        graph does; that they are ordered among themselves was checked when they were captured."""
        for access, buf, what in self.graph:
            access(buf, what)

    def Stream(self, *args, **kwargs) -> Stream:  # noqa: N802 (torch's name)
        return Stream()

    def current_stream(self, device=None) -> Stream:
        return self.current

    @contextlib.contextmanager
    def stream(self, s: Stream):
        old, self.current = self.current, s
        try:
            yield
        finally:
            self.current = old

    def is_current_stream_capturing(self) -> bool:
        return self.capture is not None

    def synchronize(self, *args) -> None:
        pass


FAKE = FakeCuda()


class Blob:
    def __init__(self, content) -> None:
        self.content = content

    def numel(self) -> int:
        return 1


class Arena:
    nbytes = pinned_bytes = 1

    def region(self, group: int) -> Blob:
        return Blob(group)


class Decoder:
    """Reads the landing buffer (expecting the group's blob), writes the group into the slot."""

    @staticmethod
    def decode(landing: Buffer, slot: Buffer, group) -> None:
        read(landing, ("blob", group))
        write(slot, group)


class Coded:
    def __init__(self, group: int) -> None:
        self.chunks, self.wire_bytes, self.blob = group, 1, Blob(("blob", group))


@pytest.fixture
def fake_cuda(monkeypatch):
    """The transfer modules see FAKE as torch.cuda (everything else of torch as it is)."""
    FAKE.__init__()
    proxy = types.ModuleType("torch")
    proxy.__getattr__ = lambda name: getattr(torch, name)
    proxy.cuda = FAKE
    monkeypatch.setattr(transfer_module, "torch", proxy)
    monkeypatch.setattr(wire_module, "torch", proxy)
    return FAKE


def engine(n_groups: int, n_slots: int, coded: list[bool], n_landing: int):
    """A StreamEngine with only what wait/release use, over a CUDA transfer of fake buffers."""
    slots = [Buffer(f"slot{s}") for s in range(n_slots)]
    if any(coded):
        transfer = wire_module.CodedCudaTransfer.__new__(wire_module.CodedCudaTransfer)
        transfer_module.SyncTransfer.__init__(transfer, Arena(), slots, None)
        transfer.wire = [Coded(g) if c else None for g, c in enumerate(coded)]
        transfer.decoder = Decoder
        transfer.decode_stream = Stream("decode")
        transfer.landing = [Buffer(f"landing{i}") for i in range(n_landing)]
        transfer.landings = wire_module.Landings(n_landing, transfer.wire, transfer.on_disk)
        transfer.landed = [Event() for _ in range(n_landing)]
        transfer.decoded = [Event() for _ in range(n_landing)]
        transfer.landed_in_capture = [False] * n_landing
        transfer.decoded_in_capture = [False] * n_landing
    else:
        transfer = transfer_module.CudaTransfer.__new__(transfer_module.CudaTransfer)
        transfer_module.SyncTransfer.__init__(transfer, Arena(), slots, None)
    transfer.prefetcher, transfer.device, transfer.stream = None, "cuda", Stream("copy")
    transfer.ready = [Event() for _ in slots]
    transfer.ready_in_capture = [False] * n_slots
    engine = StreamEngine.__new__(StreamEngine)
    engine.schedule = Schedule(n_groups, n_slots)
    engine.transfer, engine.capturing, engine.warned = transfer, False, True
    engine.lock, engine.owner = threading.Lock(), None
    engine.names = [f"block{g}" for g in range(n_groups)]
    engine.watch, engine.check, engine.peft = TensorWatch([[] for _ in range(n_groups)]), False, {}
    engine.arena, engine.guards, engine.refused = types.SimpleNamespace(buffer=torch.empty(0)), None, None
    engine.rebound = []
    engine.arena_version = engine.arena.buffer._version
    return engine


def capture(handle, groups) -> None:
    """A CUDA graph capture of `groups`' blocks, with the engine told as `replay.py` tells it: before it
    begins (and waits on the host for its copies), before it ends (inside it) and after it ends."""
    handle.on_graph_event(synchronize=True)
    FAKE.capture = next(FAKE.captures)
    FAKE.graph = []
    for g in groups:
        run_block(handle, g)
    handle.on_graph_event()
    FAKE.capture = None
    handle.on_graph_event()


def replay(handle) -> None:
    """A replay of the last capture, the engine told before it as `replay.py` tells it."""
    handle.on_graph_event()
    FAKE.replay()


def run_block(handle, group: int, abort: bool = False) -> None:
    """A streamed block: wait, compute reading its slot on the compute stream, release (or raise)."""
    handle.wait(group)
    read(handle.transfer.slots[handle.schedule.slot(group)], group)
    handle.abort() if abort else handle.release(group)


@st.composite
def cases(draw):
    n = draw(st.integers(1, 9))
    k = draw(st.integers(1, min(3, n)))
    coded = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    landing = draw(st.sampled_from([1, 2])) if k == 1 else k
    order = draw(st.permutations(range(n)))
    calls = draw(st.lists(st.one_of(
        st.just("forward"), st.just("in order"), st.just("notify"), st.just("replay"),
        st.tuples(st.sampled_from(["part", "capture"]), st.integers(0, n - 1), st.integers(0, n)),
        st.tuples(st.just("block"), st.integers(0, n - 1), st.booleans())), min_size=1, max_size=10))
    return n, k, coded, landing, list(order), calls


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_every_access_to_a_slot_or_landing_buffer_is_ordered_and_reads_its_group(fake_cuda, case):
    """Whole forwards in a learned order or module order, parts of them, blocks called alone (some
    raising), notices of a replay alone (the engine told, nothing run), captures of a forward or part
    of one and replays of the last capture (its copies, decodes and reads made again, after the engine
    was told), with any mix of raw and compressed groups: no unordered access, no stale read, and no
    wait on an event of another capture (or, eagerly, of a capture)."""
    n, k, coded, landing, order, calls = case
    handle = engine(n, k, coded, landing)
    FAKE.graph = []  # the fixture runs once for all examples: no replay of another example's capture
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for call in calls:
            if call == "notify":
                handle.on_graph_event()
                continue
            if call == "replay":
                replay(handle)
                continue
            if call in ("forward", "in order"):
                groups = order if call == "forward" else range(n)
            elif call[0] == "capture":
                capture(handle, order[call[1]:call[2]])
                continue
            elif call[0] == "part":
                groups = order[call[1]:call[2]]
            else:
                run_block(handle, call[1], abort=call[2])
                continue
            for g in groups:
                run_block(handle, g)


def test_a_raw_copy_and_a_decode_into_one_slot_are_ordered(fake_cuda):
    """A case the property test finds without `after_last_write`: groups 0-3 raw, group 4 compressed,
    two slots, one forward run out of module order (0, 2, 1, 4, 3), so waits miss and start copies
    and decodes into slots whose last write came from the other stream."""
    order, coded = [0, 2, 1, 4, 3], [False, False, False, False, True]
    handle = engine(5, 2, coded, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for g in order:
            run_block(handle, g)
        handle = engine(5, 2, coded, 2)
        handle.transfer.after_last_write = lambda stream, slot: None  # the ordering left out
        with pytest.raises(Race, match="slot0: writing 4 on decode is not ordered after copy"):
            for g in order:
                run_block(handle, g)


def test_two_captures_in_a_row_never_wait_on_each_others_events(fake_cuda):
    """A second capture right after a first (another batch size), no eager call between: without
    `forget_events` its first copy would wait on the slot's event recorded in the first capture."""
    for coded in ([False] * 4, [True] * 4, [False, True, False, True]):
        handle = engine(4, 2, coded, 2)
        for g in range(4):
            run_block(handle, g)
        capture(handle, range(4))
        capture(handle, range(4))
        for g in range(4):
            run_block(handle, g)
    handle = engine(4, 2, [False] * 4, 2)
    handle.transfer.forget_events = lambda: None  # left out: the second capture waits on the first's
    capture(handle, range(4))
    with pytest.raises(Race, match=r"waits in capture \d+ on an event recorded in capture \d+"):
        capture(handle, range(4))


def test_a_replay_is_ordered_after_the_copies_in_flight_before_it(fake_cuda):
    """An eager forward's last releases start the next forward's first copies; a replay right after
    it rewrites the same slots. Without `join_for_graph` (the current stream waits for the copy and
    decode streams when the engine is told of the replay) the replay's first copy races them."""
    for coded in ([False] * 4, [True] * 4, [False, True, False, True]):
        handle = engine(4, 2, coded, 2)
        capture(handle, range(4))
        for g in range(4):
            run_block(handle, g)
        replay(handle)
        for g in range(4):
            run_block(handle, g)
        replay(handle)
    handle = engine(4, 2, [False] * 4, 2)
    capture(handle, range(4))
    for g in range(4):
        run_block(handle, g)
    handle.transfer.join_for_graph = lambda: None  # left out: the copies in flight are not joined
    with pytest.raises(Race, match="slot0: writing 0 on compute is not ordered after copy"):
        replay(handle)
