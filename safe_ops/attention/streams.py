"""Run work on another stream, ordered after the caller's stream and back, with events only.

SageAttention 2.x launches its CUDA kernels on the legacy default stream, whatever stream is
current. When the caller's stream is another one, the executor hops there (executor.py): every
copy and temporary of the call is then allocated on the stream that reads it, so PyTorch's
stream-ordered caching allocator protects each of them, and no tensor needs to be held past the
call. Events are made through ``event_factory`` so tests can drive them without a GPU.

One pair of events per device and thread, reused by every hop: a wait enqueued with
``wait_event`` waits for the event's record *at the time of that call*, so recording the event
again for the next hop cannot change what an earlier wait waits for. Per thread, because two
threads hopping at once would otherwise record over each other's event between its record and its
wait.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

log = logging.getLogger("SafeSage")


def _cuda_event_factory() -> Any:
    return torch.cuda.Event()


@dataclass
class StreamHop:
    """Run work on ``target`` stream ordered after ``origin``, and back.

    ``enter()`` makes ``target`` wait for everything already enqueued on
    ``origin``; ``exit()`` makes ``origin`` wait for everything enqueued on
    ``target`` since. Both are event waits enqueued on the device: the host
    never blocks. ``events``: the (enter, exit) pair to record (reused across hops, see the
    module docstring); when not given, each is made by ``event_factory``.
    """
    origin: Any
    target: Any
    event_factory: Callable[[], Any] = field(default=_cuda_event_factory)
    events: tuple | None = None

    def enter(self) -> None:
        ev = self.event_factory() if self.events is None else self.events[0]
        ev.record(self.origin)
        self.target.wait_event(ev)

    def exit(self) -> Any:
        ev = self.event_factory() if self.events is None else self.events[1]
        ev.record(self.target)
        self.origin.wait_event(ev)
        return ev


_local = threading.local()       # .events: device index -> this thread's (enter, exit) event pair
_legacy: dict = {}               # device index -> its legacy default stream


def _current_stream_id(idx: int) -> int:
    """The id of this thread's current stream on device ``idx``, read without making a Python
    ``torch.cuda.Stream`` (``torch.cuda.current_stream`` builds one: 7.5-8 us on the H100 host,
    bench/results/logs/host_profile_h100_977d02d.txt, on every sage 2.x call, hop or not)."""
    get = getattr(torch._C, "_cuda_getCurrentStream", None)
    if get is None:                    # a torch without it: the public call
        return torch.cuda.current_stream(idx).stream_id
    return get(idx)[0]


def legacy_hop(device: torch.device) -> StreamHop | None:
    """The hop from the caller's current stream of ``device`` to its legacy default stream (where
    sage 2.x launches), or None when the caller already runs there. Its events are this thread's
    pair for the device (made at its first hop). The common case -- the caller already on the
    legacy stream -- costs one id read and a dict look-up; the caller's Stream object is made only
    when there is a hop to make."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    legacy = _legacy.get(idx)
    if legacy is None:
        legacy = _legacy[idx] = torch.cuda.default_stream(device)
    if _current_stream_id(idx) == legacy.stream_id:
        return None
    cur = torch.cuda.current_stream(device)
    pairs = getattr(_local, "events", None)
    if pairs is None:
        pairs = _local.events = {}
    events = pairs.get(idx)
    if events is None:
        events = pairs[idx] = (_cuda_event_factory(), _cuda_event_factory())
    return StreamHop(cur, legacy, events=events)


def run_hopped(hop: StreamHop, launch: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``launch()`` on ``hop.target``, ordered after everything already enqueued on the caller's
    stream (``enter`` before the launch) and before anything the caller enqueues next (``exit``,
    also when the launch raised: what it enqueued before raising still reads the caller's
    tensors). The result, allocated on the target stream and read on the caller's, gets
    ``record_stream`` for the caller's, so its memory is not reused before the caller is done.

    When the launch raised, its error is the one raised (an ``exit`` that fails as well is logged,
    not raised in its place: the caller decides from the kernel's error what to do)."""
    hop.enter()
    try:
        with torch.cuda.stream(hop.target):
            out = launch()
    except BaseException as e:
        try:
            hop.exit()
        except Exception as x:  # noqa: BLE001 - the kernel's error is the one that matters
            log.error("SafeSage: ordering the caller's stream after the failed launch failed too: %s: %s "
                      "(the launch's error follows)", type(x).__name__, x)
            if hasattr(e, "add_note"):
                e.add_note(f"SafeSage: the stream hop's exit failed too: {type(x).__name__}: {x}")
        raise
    hop.exit()
    out.record_stream(hop.origin)
    return out
