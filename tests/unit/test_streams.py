"""The legacy-stream hop orders both ways with events only, and a guarded call keeps nothing alive
after it returns (no fences: every copy is made on the stream that reads it). CPU, fake events."""
import gc
import weakref

import torch

from safe_ops.streams import StreamHop

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
