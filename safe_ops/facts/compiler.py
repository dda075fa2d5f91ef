"""ComfyUI's allocation compiler (comfy-aimdo's malloc graph, ComfyUI 0.34+): is it on, and its pause.

With the compiler, comfy-aimdo records a sampling step's device allocations (for H3: the whole
forward, one scope per DiT block) and replays them on later steps. A step that allocates
differently is a *graph break*; an allocation alive when its scope closes is a *rogue*; freeing
a graph allocation in another scope fails the graph (and the next free aborts the process). So
while it is on, SafeSage keeps the same plans and chunk sizes for a whole sampling run (chosen at
the first call of the run: :func:`run_id` changes when a run ends, patch.py's OUTER_SAMPLE
wrapper), and allocates what only some steps make (the first-call check) under
:func:`paused`, which ComfyUI's own persistent buffers use too.

The run id is the calling thread's: ComfyUI samples one prompt at a time, on its prompt worker
thread, but a second thread sampling a second prompt keeps its own run -- thread A's run ending
(OUTER_SAMPLE) never makes thread B choose again mid-run. Ids are unique across threads (one
counter, under a lock), so caches keyed by run id (mlp.py's chunk sizes, attention's per-run
plans) never mix two threads' runs. Reading it is one thread-local attribute (the hot path).

Both are ComfyUI's own functions (``comfy.model_prefetch.malloc_graph_enabled`` /
``pause_malloc_graph``), looked up at call time; on a ComfyUI without them the compiler is off
and :func:`paused` does nothing -- the pack behaves as before.
"""
from __future__ import annotations

import contextlib
import itertools
import sys
import threading

_lock = threading.Lock()
_ids = itertools.count(1)           # run ids, unique across threads (taken under _lock)
_local = threading.local()          # .run: the calling thread's current run id


def _prefetch():
    return sys.modules.get("comfy.model_prefetch")


def enabled(device) -> bool:
    """ComfyUI's own answer (``malloc_graph_enabled(device)``), False where it has none."""
    fn = getattr(_prefetch(), "malloc_graph_enabled", None)
    if fn is None:
        return False
    try:
        return bool(fn(device))
    except Exception:  # a changed signature: the compiler is not known to be on
        return False


def enabled_now(device) -> bool:
    """:func:`enabled`, asked once per device per diffusion-model forward of the calling thread
    (patch.py's APPLY_MODEL wrapper calls :func:`forward_started`, eagerly also under TorchCompileModel), not once per attention or
    MLP call. ComfyUI's answer depends on its flags and the kind of device only; a thread whose
    forwards are not wrapped keeps its first answer."""
    c = getattr(_local, "enabled", None)
    if c is None:
        c = _local.enabled = {}
    hit = c.get(device)
    if hit is None:
        hit = c[device] = enabled(device)
    return hit


def forward_started() -> None:
    """A diffusion-model forward of the calling thread begins: :func:`enabled_now` asks again."""
    _local.enabled = None


def paused():
    """``comfy.model_prefetch.pause_malloc_graph()`` where ComfyUI has it: allocations inside are
    not recorded (they come from PyTorch's pool and may be freed anywhere). Else a no-op."""
    fn = getattr(_prefetch(), "pause_malloc_graph", None)
    return fn() if fn is not None else contextlib.nullcontext()


def run_id() -> int:
    """The calling thread's current sampling run; plans and chunk sizes chosen under the compiler
    hold within one."""
    rid = getattr(_local, "run", None)
    if rid is None:
        rid = _next_run()
    return rid


def new_run() -> None:
    """The calling thread's sampling run ended (or memory ran out): its next call chooses again.
    Other threads' runs are untouched."""
    _local.enabled = None
    _next_run()


def _next_run() -> int:
    with _lock:
        rid = next(_ids)
    _local.run = rid
    return rid
