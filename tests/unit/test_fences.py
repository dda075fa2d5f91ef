"""FenceBook semantics with a deterministic fake event (no GPU)."""
import gc
import weakref

import pytest
import torch

from safe_ops.fences import FenceBook, StreamHop


class FakeEvent:
    """An event that completes when the test says so."""
    log = []

    def __init__(self):
        self.done = False
        self.recorded_on = None
        self.waited = False

    def record(self, stream=None):
        self.recorded_on = stream
        FakeEvent.log.append(("record", stream))

    def query(self):
        return self.done

    def synchronize(self):
        self.waited = True
        self.done = True


class FakeStream:
    def __init__(self, name):
        self.name = name
        self.waits = []

    def wait_event(self, ev):
        self.waits.append(ev)


def gpu_like(n):
    """A non-CPU tensor without memory (CPU tensors are not fenced: CPU ops are synchronous)."""
    return torch.empty(n, dtype=torch.uint8, device="meta")


class Recorder:
    """An event factory that remembers every event it made."""

    def __init__(self):
        self.events = []

    def __call__(self):
        e = FakeEvent()
        self.events.append(e)
        return e


def make_book(**kw):
    rec = Recorder()
    b = FenceBook(event_factory=rec, **kw)
    b.events = rec.events
    return b


@pytest.fixture
def book():
    return make_book()


def test_tensor_kept_alive_until_event_completes(book):
    t = gpu_like(1000)
    ref = weakref.ref(t)
    book.hold([t], stream="s1")
    del t
    gc.collect()
    assert ref() is not None, "fenced tensor must stay alive while its event is pending"
    assert book.stats.pending == 1 and book.stats.fenced_bytes == 1000
    assert book.poll() == 0 and ref() is not None
    book.events[0].done = True
    assert book.poll() == 1
    gc.collect()
    assert ref() is None and book.stats.fenced_bytes == 0 and book.stats.released == 1


def test_event_recorded_on_given_stream_after_consumer(book):
    book.hold([gpu_like(10)], stream="side")
    assert book.events[0].recorded_on == "side"


def test_fences_release_out_of_order_across_streams(book):
    a, b = gpu_like(10), gpu_like(20)
    book.hold([a], stream="s1")
    book.hold([b], stream="s2")
    book.events[1].done = True           # the later fence completes first
    assert book.poll() == 1
    assert book.stats.pending == 1 and book.stats.fenced_bytes == 10


def test_drain_waits_per_event_and_counts(book):
    for n in (10, 20, 30):
        book.hold([gpu_like(n)])
    book.events[0].done = True
    assert book.stats.peak_fenced_bytes == 60
    assert book.drain() == 3
    assert book.stats.pending == 0 and book.stats.waits == 2
    assert all(e.done for e in book.events)


def test_cpu_tensors_and_non_tensors_are_not_fenced(book):
    assert book.hold([torch.zeros(3), "x", None]) is None
    assert not book.events and book.stats.holds == 0


def test_shared_storage_counted_once(book):
    t = gpu_like(100)
    book.hold([t, t[:10], t[50:]])
    assert book.stats.fenced_bytes == 100


def test_bounded_pending_waits_for_oldest():
    b = make_book(max_pending=2)
    for _ in range(3):
        b.hold([gpu_like(1)])
    assert b.events[0].waited and b.stats.waits == 1 and b.stats.pending == 2


def test_stream_hop_orders_both_ways():
    origin, target = FakeStream("cur"), FakeStream("legacy")
    rec = Recorder()
    evs = rec.events
    hop = StreamHop(origin, target, rec)
    hop.enter()
    assert evs[0].recorded_on is origin and target.waits == [evs[0]]
    hop.exit()
    assert evs[1].recorded_on is target and origin.waits == [evs[1]]


def test_held_bytes_are_capped_by_waiting_for_the_oldest():
    b = make_book(max_pending_bytes=250)
    for _ in range(3):
        b.hold([gpu_like(100)])
    # 300 bytes > 250: the oldest fence was waited for and released; the newest is never waited on
    assert b.events[0].waited and not b.events[2].waited
    assert b.stats.fenced_bytes == 200 and b.stats.pending == 2 and b.stats.waits == 1


def test_a_single_fence_over_the_byte_cap_is_kept_not_waited_on():
    b = make_book(max_pending_bytes=10)
    b.hold([gpu_like(100)])
    assert not b.events[0].waited and b.stats.pending == 1
