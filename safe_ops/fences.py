"""Event-gated keep-alive for tensors a GPU kernel may still be reading.

The contract (PyTorch CUDA semantics): the caching allocator only knows that a
tensor is used on the stream it was allocated on. When a kernel reads it from
another stream -- SageAttention 2.x launches its CUDA kernels on the legacy
default stream, ComfyUI's dynamic VRAM streams weights on offload streams --
dropping the last Python reference lets the allocator hand the memory to the
next allocation while that kernel still runs.

A :class:`FenceBook` holds such tensors until an event recorded *after their
last consumer* has completed. It never blocks on the hot path: completion is
polled with ``event.query()`` on every new hold, and only :meth:`drain` (end of
a sampling run, or on demand) and the caps (held count, held bytes) wait -- on
each event, never with a device-wide synchronize.

Events are created through an ``event_factory`` so tests can drive completion
deterministically without a GPU.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a fenced tensor accounts for: its own elements, not the whole storage.

    A view into a large persistent buffer (a ComfyUI cast buffer, an aimdo
    VRAM range) keeps that buffer alive anyway; counting its whole storage
    would overstate what the fence holds back.
    """
    return t.numel() * t.element_size()


@dataclass
class FenceStats:
    holds: int = 0            # fences created
    released: int = 0         # fences released after their event completed
    waits: int = 0            # fences that had to be waited for (drain / limit)
    pending: int = 0          # fences not yet released
    fenced_bytes: int = 0     # bytes currently held
    peak_fenced_bytes: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Fence:
    event: Any
    tensors: tuple
    nbytes: int
    label: str = ""


# Held bytes above which hold() waits for the oldest fences (per event, never a device sync).
DEFAULT_MAX_PENDING_BYTES = 4 * 2**30


def _cuda_event_factory() -> Any:
    return torch.cuda.Event()


class FenceBook:
    """Keep tensors alive until an event recorded after their last use completes.

    ``hold(tensors, stream)`` records an event on ``stream`` (default: the
    current stream of the tensors' device) *now*, i.e. after every kernel the
    caller has already enqueued on it, and keeps the tensors until that event
    reports completion.
    """

    def __init__(self, event_factory: Callable[[], Any] | None = None,
                 max_pending: int = 4096, max_pending_bytes: int | None = DEFAULT_MAX_PENDING_BYTES):
        self._event_factory = event_factory or _cuda_event_factory
        self._fences: list[_Fence] = []
        self._lock = threading.Lock()
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        self.stats = FenceStats()

    # -- core -------------------------------------------------------------
    def hold(self, tensors: Iterable[Any], stream: Any = None, label: str = "") -> Any:
        """Fence ``tensors`` behind an event recorded on ``stream``; returns the event.

        Non-tensors and CPU tensors are ignored (CPU ops are synchronous). If
        nothing is left to hold, no event is recorded and ``None`` is returned.
        """
        kept = tuple(t for t in tensors if isinstance(t, torch.Tensor) and t.device.type != "cpu")
        if not kept:
            self.poll()
            return None
        # Bytes of the union of the held extents per storage (views of one tensor count once).
        spans: dict[int, list[tuple[int, int]]] = {}
        for t in kept:
            try:
                base = t.untyped_storage().data_ptr()
                start = t.storage_offset() * t.element_size()
            except Exception:  # pragma: no cover - tensors without storage
                base, start = id(t), 0
            spans.setdefault(base, []).append((start, start + tensor_bytes(t)))
        nbytes = 0
        for ranges in spans.values():
            end = -1
            for a, b in sorted(ranges):
                if b > end:
                    nbytes += b - max(a, end)
                    end = b
        event = self._event_factory()
        if stream is None and kept[0].device.type == "cuda":
            stream = torch.cuda.current_stream(kept[0].device)
        event.record(stream) if stream is not None else event.record()
        with self._lock:
            self._release_completed_locked()
            self._fences.append(_Fence(event, kept, nbytes, label))
            s = self.stats
            s.holds += 1
            s.pending = len(self._fences)
            s.fenced_bytes += nbytes
            s.peak_fenced_bytes = max(s.peak_fenced_bytes, s.fenced_bytes)
        # Bounded memory even if nobody drains: wait for the oldest fences (each on its own
        # event) until both the count and the held bytes are under their caps.
        while self._over_cap():
            self._wait_oldest()
        return event

    def _over_cap(self) -> bool:
        with self._lock:
            if len(self._fences) <= 1:
                return False         # the newest fence is always kept: its work was just enqueued
            return (len(self._fences) > self.max_pending or
                    (self.max_pending_bytes is not None and self.stats.fenced_bytes > self.max_pending_bytes))

    def poll(self) -> int:
        """Release every fence whose event has completed; returns how many were released."""
        with self._lock:
            return self._release_completed_locked()

    def drain(self) -> int:
        """Wait for and release every pending fence (per event, no device-wide sync)."""
        n = 0
        while True:
            with self._lock:
                if not self._fences:
                    self.stats.pending = 0
                    return n
                fence = self._fences[0]
            if not fence.event.query():
                fence.event.synchronize()
                self.stats.waits += 1
            with self._lock:
                n += self._release_completed_locked()

    @property
    def pending(self) -> int:
        return len(self._fences)

    # -- internals --------------------------------------------------------
    def _wait_oldest(self) -> None:
        with self._lock:
            fence = self._fences[0] if self._fences else None
        if fence is None:
            return
        if not fence.event.query():
            fence.event.synchronize()
            self.stats.waits += 1
        self.poll()

    def _release_completed_locked(self) -> int:
        # Events on one stream complete in order, but fences may come from several
        # streams: check each one rather than stopping at the first pending fence.
        keep: list[_Fence] = []
        released = 0
        for f in self._fences:
            if f.event.query():
                released += 1
                self.stats.fenced_bytes -= f.nbytes
            else:
                keep.append(f)
        self._fences = keep
        self.stats.released += released
        self.stats.pending = len(keep)
        return released


@dataclass
class StreamHop:
    """Run work on ``target`` stream ordered after ``origin``, and back.

    ``enter()`` makes ``target`` wait for everything already enqueued on
    ``origin``; ``exit()`` makes ``origin`` wait for everything enqueued on
    ``target`` since. Both are event waits enqueued on the device: the host
    never blocks.
    """
    origin: Any
    target: Any
    event_factory: Callable[[], Any] = field(default=_cuda_event_factory)

    def enter(self) -> None:
        ev = self.event_factory()
        ev.record(self.origin)
        self.target.wait_event(ev)

    def exit(self) -> Any:
        ev = self.event_factory()
        ev.record(self.target)
        self.origin.wait_event(ev)
        return ev


# Process-wide book used by the attention override and the MLP patch; polled after every
# diffusion-model forward and drained when sampling ends (patch.py's wrappers).
GLOBAL_FENCES = FenceBook()
