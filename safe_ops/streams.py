"""Run work on another stream, ordered after the caller's stream and back, with events only.

SageAttention 2.x launches its CUDA kernels on the legacy default stream, whatever stream is
current. When the caller's stream is another one, the executor hops there (executor.py): every
copy and temporary of the call is then allocated on the stream that reads it, so PyTorch's
stream-ordered caching allocator protects each of them, and no tensor needs to be held past the
call. Events are made through ``event_factory`` so tests can drive them without a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch


def _cuda_event_factory() -> Any:
    return torch.cuda.Event()


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
