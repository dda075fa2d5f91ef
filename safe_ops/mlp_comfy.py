"""Each Linear's weight cast once per chunked MLP call, through ComfyUI's own cast and uncast.

ComfyUI's layers (``comfy/ops.py``: ``Linear.forward_comfy_cast_weights``, ``MixedPrecisionOps``,
``linear_input_act``) look ``cast_bias_weight`` / ``uncast_bias_weight`` up in ``comfy.ops`` at
call time. :func:`install` wraps both once, process-wide. Outside a :func:`cast_once` scope, and
while torch compiles, the wrappers pass every call straight through. Inside a scope (opened by
the chunked MLP forward, mlp.py, around ComfyUI's own forward run per token chunk) the first
cast of each watched layer is ComfyUI's real cast; later chunks get that same result back, and
ComfyUI's uncasts of it are deferred until the scope closes, where the real uncasts run in cast
order (also when a chunk raised). ComfyUI's uncast is what orders a weight's release after the
compute that read it (``offload_stream.wait_stream(current)``, aimdo's ``vbar_unpin``), so it
runs after the last chunk has been enqueued.

One guard: a cast that returns memory overlapping a memoised cast (one cast buffer reused for
the next layer, as classic lowvram does with a single offload stream) means the memoised weight
is being overwritten. The memo is then dropped for the rest of the call: the deferred uncasts
run at once and every later cast and uncast is ComfyUI's own again (counted, logged once).

``comfy`` is imported lazily (inside :func:`install`): safe_ops never imports ComfyUI at module
import time.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

log = logging.getLogger("SafeSage.mlp")

_SCOPE: contextvars.ContextVar["_Scope | None"] = contextvars.ContextVar("safesage_cast_scope", default=None)
_MARK = "_safesage_cast_memo"
_REAL: dict = {}        # "cast" / "uncast" -> ComfyUI's own functions, once install() wrapped them


def _compiling() -> bool:
    fn = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(fn()) if fn is not None else False


def _sig(v: Any) -> Any:
    """What of a cast argument can change its result: for a tensor (the layer's input) its
    type, dtype and device, not its values or length; other arguments by value."""
    if isinstance(v, torch.Tensor):
        return ("tensor", type(v).__name__, v.dtype, v.device)
    try:
        hash(v)
        return v
    except TypeError:
        return ("id", id(v))


def _tensors(t: Any) -> Iterator[torch.Tensor]:
    """The plain tensors a cast result holds (a QuantizedTensor's data and scale)."""
    if t is None:
        return
    if isinstance(t, (tuple, list)):
        for x in t:
            yield from _tensors(x)
        return
    qdata = getattr(t, "_qdata", None)
    if isinstance(qdata, torch.Tensor):
        yield qdata
        yield from _tensors(getattr(getattr(t, "_params", None), "scale", None))
        return
    if isinstance(t, torch.Tensor):
        yield t


def _ranges(result: Any) -> list[tuple[int, int, Any]]:
    """(first byte, end byte, device) of every tensor in a cast result (weight, bias, and the
    raw copies ComfyUI keeps in its offload tuple)."""
    out = []
    for t in _tensors(result):
        if t.device.type == "meta" or t.numel() == 0:
            continue
        try:
            p = t.data_ptr()
        except Exception:  # pragma: no cover - tensors without storage
            continue
        out.append((p, p + t.numel() * t.element_size(), t.device))
    return out


def _overlap(a: list, b: list) -> bool:
    return any(da == db and x0 < y1 and y0 < x1 for x0, x1, da in a for y0, y1, db in b)


class _Entry:
    __slots__ = ("module", "result", "ranges")

    def __init__(self, module, result, ranges):
        self.module = module
        self.result = result
        self.ranges = ranges


class _Scope:
    """One chunked MLP call: the memoised casts of the watched layers."""

    def __init__(self, watch: Iterable[torch.nn.Module], stats, uncast):
        self.watch = {id(m) for m in watch}
        self.stats = stats
        self._uncast = uncast
        self.memo: dict[tuple, _Entry] = {}
        self.seen: set[int] = set()          # watched layers cast through comfy.ops
        self.dropped = False
        self.active = uncast is not None     # install() has wrapped ComfyUI's cast and uncast

    def cast(self, real, s, args, kwargs):
        if id(s) not in self.watch:
            return real(s, *args, **kwargs)
        self.seen.add(id(s))
        key = (id(s), tuple(_sig(a) for a in args), tuple(sorted((k, _sig(v)) for k, v in kwargs.items())))
        hit = None if self.dropped else self.memo.get(key)
        if hit is not None:
            self.stats.bump("cast_reuses")
            return hit.result
        result = real(s, *args, **kwargs)
        self.stats.bump("casts")
        if self.dropped:
            return result
        ranges = _ranges(result)
        if any(_overlap(ranges, e.ranges) for e in self.memo.values()):
            self.drop(f"{type(s).__name__} was cast into memory that holds an earlier layer's cast "
                      "(one cast buffer reused)")
            return result
        self.memo[key] = _Entry(s, result, ranges)
        return result

    def defers(self, s, weight) -> bool:
        """True when this uncast belongs to a memoised cast: it runs when the scope closes."""
        if self.dropped:
            return False
        return any(e.module is s and len(e.result) > 2 and e.result[0] is weight for e in self.memo.values())

    def drop(self, why: str) -> None:
        self.stats.bump("memo_dropped")
        self.stats.once_warning(f"SafeSage MLP: weights cast per chunk for this call: {why}")
        self.dropped = True
        self.release()

    def release(self) -> None:
        """ComfyUI's real uncast of every memoised cast, in cast order; every one runs even if
        one raises (the first error is raised after the others ran)."""
        entries, self.memo = list(self.memo.values()), {}
        err = None
        for e in entries:
            if len(e.result) < 3:         # offloadable=False: nothing to give back
                continue
            try:
                self._uncast(e.module, *e.result)
            except BaseException as ex:  # noqa: BLE001 - re-raised below
                err = err or ex
        if err is not None:
            raise err


def install() -> bool:
    """Wrap ``comfy.ops.cast_bias_weight`` / ``uncast_bias_weight`` once (idempotent). False when
    this ComfyUI has no such functions (then chunks cast as ComfyUI does, once per chunk)."""
    import comfy.ops as ops  # lazy: only when a model is patched inside ComfyUI
    cast = getattr(ops, "cast_bias_weight", None)
    uncast = getattr(ops, "uncast_bias_weight", None)
    if cast is None or uncast is None:
        return False
    if getattr(cast, _MARK, False) and getattr(uncast, _MARK, False):
        return True
    real_cast, real_uncast = cast, uncast
    _REAL.update(cast=real_cast, uncast=real_uncast)

    def cast_bias_weight(s, *args, **kwargs):
        scope = _SCOPE.get()
        if scope is None or _compiling():
            return real_cast(s, *args, **kwargs)
        return scope.cast(real_cast, s, args, kwargs)

    def uncast_bias_weight(s, weight, bias, offload_stream, *args, **kwargs):
        scope = _SCOPE.get()
        if scope is not None and not _compiling() and scope.defers(s, weight):
            return None
        return real_uncast(s, weight, bias, offload_stream, *args, **kwargs)

    for fn, real in ((cast_bias_weight, real_cast), (uncast_bias_weight, real_uncast)):
        fn.__wrapped__ = real
        fn.__doc__ = real.__doc__
        setattr(fn, _MARK, True)
    ops.cast_bias_weight = cast_bias_weight
    ops.uncast_bias_weight = uncast_bias_weight
    return True


@contextlib.contextmanager
def cast_once(layers: Iterable[torch.nn.Module], stats) -> Iterator[_Scope]:
    """Inside: each of ``layers`` is cast once (ComfyUI's cast), however many chunks run; on exit
    ComfyUI's uncasts run. Without the wrappers installed it changes nothing."""
    uncast = _REAL.get("uncast")
    scope = _Scope(layers, stats, uncast)
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)
        if uncast is not None:
            scope.release()


def casts_itself(layer: torch.nn.Module) -> bool:
    """A layer whose forward casts its weight (ComfyUI's cast ops with casting on, or weight/bias
    functions such as a LoRA patched on the fly), as opposed to one that uses its parameters."""
    return bool(getattr(layer, "comfy_cast_weights", False) or getattr(layer, "weight_function", None)
                or getattr(layer, "bias_function", None))
