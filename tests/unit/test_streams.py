"""The legacy-stream hop orders both ways with events only, and a guarded call keeps nothing alive
after it returns (no fences: every copy is made on the stream that reads it). CPU, fake events."""
import gc
import weakref

import torch

from safe_ops.attention.streams import StreamHop

from test_attention import EnvelopeAssertingKernel, h3_like, make_attn, raw, reference


class FakeEvent:
    def __init__(self):
        self.recorded_on = None

    def record(self, stream=None):
        self.recorded_on = stream


class FakeStream:
    def __init__(self, name):
        self.name = name
        self.waits = []

    def wait_event(self, ev):
        self.waits.append(ev)


def test_stream_hop_orders_both_ways():
    origin, target = FakeStream("cur"), FakeStream("legacy")
    evs = []
    hop = StreamHop(origin, target, lambda: evs.append(FakeEvent()) or evs[-1])
    hop.enter()
    assert evs[0].recorded_on is origin and target.waits == [evs[0]]
    hop.exit()
    assert evs[1].recorded_on is target and origin.waits == [evs[1]]


def test_a_guarded_call_keeps_none_of_its_copies_alive():
    """Repacked copies and per-launch outputs die with the call (stream order protects them): the
    pack holds no tensor of a finished call, so nothing outlives a block under ComfyUI's compiler."""
    att, kern = make_attn()
    seen = []
    real = EnvelopeAssertingKernel.__call__

    def spy(self, q, k, v, layout, scale):
        seen.extend(weakref.ref(t) for t in (q, k, v))
        return real(self, q, k, v, layout, scale)
    kern.__class__ = type("Spy", (EnvelopeAssertingKernel,), {"__call__": spy})
    q, k, v = h3_like(700)                          # head groups + repack in the toy envelope
    out = att(raw, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    torch.testing.assert_close(out.double(), reference(q, k, v), rtol=1e-5, atol=1e-5)
    gc.collect()
    alive = [r() for r in seen if r() is not None]
    plan = next(iter(att._prepared.values())).plan
    assert plan.kind == "head_groups" and plan.repack and len(kern.launches) == plan.launches > 1
    assert len(seen) == 3 * plan.launches, "the spy saw every launch's q, k and v"
    assert not [t for t in alive if t.untyped_storage().data_ptr() != q.untyped_storage().data_ptr()]


# ------------------------------------------------- the executor's hop, on a fake CUDA (no GPU)
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402

import threading  # noqa: E402

from safe_ops.attention import streams  # noqa: E402
from safe_ops.ui import run_stats  # noqa: E402
from safe_ops.attention.executor import Executor  # noqa: E402
from safe_ops.families.family import Kernel  # noqa: E402

from test_attention import toy_envelope  # noqa: E402


class FakeCuda:
    """torch.cuda's stream API as the executor uses it, recording every ordering step in ``trace``:
    ("record", stream, event), ("wait", stream, event), ("stream", stream) / ("stream_end", stream)
    around ``torch.cuda.stream``, ("launch", the current stream), ("record_stream", stream)."""

    def __init__(self, current="caller"):
        self.trace = []
        self.legacy = self.stream_named("legacy")
        self.caller = self.legacy if current == "legacy" else self.stream_named("caller")
        self.current = self.caller
        self.fail_wait_on = None          # a stream whose wait_event raises

    def stream_named(self, name):
        fake = self

        class S:
            def wait_event(self, ev):
                if fake.fail_wait_on is self:
                    raise RuntimeError("CUDA error: emulated failure of cudaStreamWaitEvent")
                fake.trace.append(("wait", name, ev.n))

            def __repr__(self):
                return name
        s = S()
        s.name = name
        s.device_index = 0
        s.stream_id = 0 if name == "legacy" else 100 + len(name)
        return s

    def install(self, monkeypatch):
        fake = self
        events = self.events = []
        # the legacy stream and this thread's event pair are kept per device: fresh for each fake
        monkeypatch.setattr(streams, "_legacy", {})
        monkeypatch.setattr(streams, "_local", threading.local())

        class Event:
            def __init__(self):
                self.n = len(events)
                events.append(self)

            def record(self, stream=None):
                fake.trace.append(("record", (stream or fake.current).name, self.n))

        @contextlib.contextmanager
        def stream(s):
            prev, fake.current = fake.current, s
            fake.trace.append(("stream", s.name))
            try:
                yield
            finally:
                fake.current = prev
                fake.trace.append(("stream_end", s.name))

        self.stream_objects = 0         # torch.cuda.current_stream calls: a Stream object made each time

        def current_stream(device=None):
            fake.stream_objects += 1
            return fake.current
        monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
        monkeypatch.setattr(streams, "_current_stream_id", lambda idx: fake.current.stream_id, raising=False)
        monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: fake.legacy)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        return self

    def launch(self, raises=None):
        self.trace.append(("launch", self.current.name))
        if raises is not None:
            raise raises
        fake = self

        class Out:
            def record_stream(self, s):
                fake.trace.append(("record_stream", s.name))
        return Out()


def fake_executor(fake, legacy=True, raises=None):
    env = dataclasses.replace(toy_envelope(), launches_on_legacy_stream=legacy)
    ex = Executor({"fam": Kernel(env, lambda *a: None, 0.05)})
    ex._launch_all = ex._launch_one = lambda plan, kern, n: fake.launch(raises)
    q = SimpleNamespace(device=torch.device("cuda", 0), shape=(1, 2, 8, 16), is_cuda=True)
    plan = SimpleNamespace(kernel="fam", layout="HND", head_group=0, q_chunk=0, kv_chunk=0, repack=())
    return ex, plan, SimpleNamespace(q4=q, q=q, k=q, v=q, layout="NHD")   # a plan in another layout than the caller's


HOPPED = [("record", "caller", 0), ("wait", "legacy", 0),          # enter: legacy after the caller's work
          ("stream", "legacy"), ("launch", "legacy"), ("stream_end", "legacy"),
          ("record", "legacy", 1), ("wait", "caller", 1)]            # exit: the caller after the launch


@pytest.fixture
def fresh_report():
    run_stats.reset()
    yield
    run_stats.reset()


def test_executor_hops_a_legacy_stream_launch_and_back(monkeypatch, fresh_report):
    """From a side stream, a legacy-stream family runs on the legacy stream after an enter event,
    the caller's stream waits for an exit event, and the output is recorded for the caller's
    stream. Catches: never hopping, no ``hop.exit()``, no ``record_stream``."""
    fake = FakeCuda().install(monkeypatch)
    ex, plan, n = fake_executor(fake)
    ex.run(plan, n)
    assert fake.trace == HOPPED + [("record_stream", "caller")]
    assert run_stats.value("stream_hops") == 1 and fake.current is fake.caller


def test_hops_reuse_one_event_pair_per_device_and_thread(monkeypatch, fresh_report):
    """Every hop records the same two events (a wait already enqueued keeps the record it saw);
    another thread gets a pair of its own (two threads recording one event at once would make
    one's wait follow the other's record)."""
    fake = FakeCuda().install(monkeypatch)
    ex, plan, n = fake_executor(fake)
    for _ in range(3):
        ex.run(plan, n)
    assert len(fake.events) == 2 and fake.trace == 3 * (HOPPED + [("record_stream", "caller")])
    t = threading.Thread(target=lambda: ex.run(plan, n))
    t.start()
    t.join()
    second = [(t[0], t[1], t[2] + 2) if t[0] in ("record", "wait") else t for t in HOPPED]
    assert len(fake.events) == 4 and fake.trace[-8:] == second + [("record_stream", "caller")]


@pytest.mark.parametrize("current,legacy", [("legacy", True), ("caller", False)])
def test_executor_does_not_hop_when_not_needed(monkeypatch, fresh_report, current, legacy):
    """Already on the legacy stream, or a family that launches on the current stream (Triton):
    the launch runs where the caller is, with no events."""
    fake = FakeCuda(current).install(monkeypatch)
    ex, plan, n = fake_executor(fake, legacy=legacy)
    ex.run(plan, n)
    assert fake.trace == [("launch", current)] and run_stats.value("stream_hops") == 0


def test_no_stream_object_per_call_when_no_hop_is_needed(monkeypatch, fresh_report):
    """A caller already on the legacy stream (every sage 2.x call in ComfyUI's default set-up) pays
    an id read, not ``torch.cuda.current_stream`` (a Python Stream object: 7.5-8 us of host time
    per call on the H100 host); a hop still reads the caller's Stream once."""
    fake = FakeCuda("legacy").install(monkeypatch)
    ex, plan, n = fake_executor(fake)
    for _ in range(3):
        ex.run(plan, n)
    assert fake.stream_objects == 0 and run_stats.value("stream_hops") == 0
    fake.current = fake.caller = fake.stream_named("caller")
    ex.run(plan, n)
    assert fake.stream_objects == 1 and run_stats.value("stream_hops") == 1


def test_executor_hop_exits_also_when_the_kernel_raises(monkeypatch, fresh_report):
    """A launch that raised may have enqueued work reading the caller's tensors: the caller's
    stream still waits for the legacy stream; the kernel's error is raised unchanged."""
    fake = FakeCuda().install(monkeypatch)
    ex, plan, n = fake_executor(fake, raises=NotImplementedError("no variant for this shape"))
    with pytest.raises(NotImplementedError, match="no variant for this shape"):
        ex.run(plan, n)
    assert fake.trace == HOPPED and fake.current is fake.caller


def test_an_exit_that_raises_does_not_hide_the_kernels_error(monkeypatch, fresh_report, caplog):
    """The caller (attention.attend) decides from the kernel's error (build error, OOM, sticky CUDA
    error): an exit that fails too is logged, and the kernel's error is the one raised."""
    fake = FakeCuda().install(monkeypatch)
    fake.fail_wait_on = fake.caller
    ex, plan, n = fake_executor(fake, raises=MemoryError("kernel temporaries: out of memory"))
    with caplog.at_level("ERROR", logger="SafeSage"):
        with pytest.raises(MemoryError, match="out of memory"):
            ex.run(plan, n)
    assert fake.trace[:6] == HOPPED[:6], "the exit was attempted after the launch"
    assert "emulated failure of cudaStreamWaitEvent" in caplog.text
