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

The guard: a memoised cast is only as good as the memory it lives in. Every cast inside the
scope (of any layer, not only the watched ones) and every cast buffer ComfyUI hands out inside it
(``comfy.model_management.get_cast_buffer``, aimdo's ``get_aimdo_cast_buffer``: the buffers a
cast writes, also the ones it does not return, such as aimdo's transfer destination) is checked
against the memoised casts' memory. A buffer reused while a memoised cast lives in it (classic
lowvram's per-stream cast buffers: with two offload streams a third cast lands on fc1's) drops
the memo before the buffer is written: the deferred uncasts run at once and every later cast and
uncast is ComfyUI's own again (counted, logged once).

Compile-clean: every wrapper asks ``torch.compiler.is_compiling()`` before anything else and then
runs ComfyUI's function untouched, so a model compiled in a process where an H3 model was patched
gets no graph break from the wrappers. Contained: an error in this module's own bookkeeping never
fails a cast -- that call runs ComfyUI's own cast / uncast and the memo is dropped (counted as
``cast_faults`` in the MLP's stats, logged once); an error raised by ComfyUI's own cast or
uncast passes through untouched.

``comfy`` is imported lazily (inside :func:`install`): safe_ops never imports ComfyUI at module
import time.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ... import contain
from ...ui import run_stats

log = logging.getLogger("SafeSage.mlp")

_SCOPE: contextvars.ContextVar["_Scope | None"] = contextvars.ContextVar("safesage_cast_scope", default=None)
_MARK = "_safesage_cast_memo"
_REAL: dict = {}        # "cast" / "uncast" -> ComfyUI's own functions, once install() wrapped them


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


#: keyword values whose ``==`` and hash are plain (the per-chunk shortcut compares them directly)
_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)
_MISSING = object()


def _key(s: Any, args: tuple, kwargs: dict) -> tuple:
    """The memo key of a cast: the layer and the :func:`_sig` of every argument."""
    return (id(s), tuple(_sig(a) for a in args), tuple(sorted((k, _sig(v)) for k, v in kwargs.items())))


def _shortcut(args: tuple, kwargs: dict, key: tuple) -> tuple | None:
    """What a later chunk's cast of the same layer is compared with instead of building its
    :func:`_key` again: ComfyUI's form of the call (one tensor -- the chunk -- and keyword values
    of plain types), else None (every cast builds its key)."""
    if len(args) != 1 or not isinstance(args[0], torch.Tensor) or \
            not all(type(v) in _PLAIN for v in kwargs.values()):
        return None
    a = args[0]
    return (type(a), a.dtype, a.device, dict(kwargs), key)


def _same_as(cut: tuple, args: tuple, kwargs: dict) -> bool:
    """This cast's :func:`_key` equals the one ``cut`` was made for: the tensor's type (exact),
    dtype and device, the same keywords with values of the same type and equal (so equal
    :func:`_sig`). False is only a missed shortcut (the key is built)."""
    if len(args) != 1 or len(kwargs) != len(cut[3]):
        return False
    a = args[0]
    if type(a) is not cut[0] or a.dtype is not cut[1] or a.device != cut[2]:
        return False
    plain = cut[3]
    for k, v in kwargs.items():
        w = plain.get(k, _MISSING)
        if type(v) is not type(w) or v != w:
            return False
    return True


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


def _same_device(a: Any, b: Any) -> bool:
    """Same device; a device named without an index ("cuda") may be any index of its type."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _overlap(a: list, b: list) -> bool:
    return any(x0 < y1 and y0 < x1 and _same_device(da, db) for x0, x1, da in a for y0, y1, db in b)


class _Entry:
    __slots__ = ("module", "result", "ranges")

    def __init__(self, module, result, ranges):
        self.module = module
        self.result = result
        self.ranges = ranges


def _buffer_ranges(buf: Any, device: Any) -> list[tuple[int, int, Any]]:
    """The memory a cast buffer handed out by ComfyUI spans: a tensor (``get_cast_buffer``), or
    aimdo's ``VRAMBuffer`` (``get_aimdo_cast_buffer``: its whole reservation, every cast starts
    writing at its offset 0). A buffer whose address cannot be read spans the whole device:
    every memoised cast on it is assumed overwritten."""
    if buf is None:
        return []
    if isinstance(buf, torch.Tensor):
        return _ranges(buf)
    base, size = getattr(buf, "base_addr", None), getattr(buf, "max_size", None)
    dev = device if isinstance(device, torch.device) else torch.device("cuda", getattr(buf, "device", 0))
    if isinstance(base, int) and isinstance(size, int):
        return [(base, base + size, dev)]
    return [(0, 2 ** 64, dev)]


class _Scope:
    """One chunked MLP call: the memoised casts of the watched layers.

    Every cast inside the scope (of any module) and every cast buffer ComfyUI hands out inside
    it is checked against the memoised casts' memory: a buffer about to be written over one of
    them drops the memo *before* the write (ComfyUI's deferred uncasts run first, so the
    buffer's reuse is ordered after the compute that read it, as ComfyUI orders it), a cast
    result that overlaps one drops it after. A fault in this bookkeeping never fails a cast:
    that call runs ComfyUI's own cast / uncast, the memo is dropped (counted, logged once)."""

    def __init__(self, watch: Iterable[torch.nn.Module], stats, uncast):
        self.watch = {id(m) for m in watch}
        self.stats = stats
        self._uncast = uncast
        self.memo: dict[tuple, _Entry] = {}
        self.cuts: dict[int, tuple] = {}     # watched layer -> its last cast's key shortcut (_shortcut)
        self.seen: set[int] = set()          # watched layers cast through comfy.ops
        self.dropped = False
        self.active = uncast is not None     # install() has wrapped ComfyUI's cast and uncast

    # ------------------------------------------------------------------ the wrappers' calls
    def cast(self, real, s, args, kwargs):
        if self.dropped:                       # ComfyUI's cast, only noted
            try:
                self._note(s)
            except Exception as e:  # noqa: BLE001
                self.fault(e)
            return real(s, *args, **kwargs)
        try:
            key, hit = self._lookup(s, args, kwargs)
        except Exception as e:  # noqa: BLE001 - SafeSage's bookkeeping, never the prompt's
            self.fault(e)
            return real(s, *args, **kwargs)
        if hit is not None:
            return hit.result
        result = real(s, *args, **kwargs)      # ComfyUI's cast: its exceptions pass through
        try:
            why = self._record(s, key, result)
        except Exception as e:  # noqa: BLE001
            self.fault(e)
            return result
        if why is not None:
            self.drop(why)                     # ComfyUI's uncasts: their exceptions pass through
        return result

    def defers(self, s, weight) -> bool:
        """True when this uncast belongs to a memoised cast: it runs when the scope closes."""
        if self.dropped:
            return False
        try:
            return self._defers(s, weight)
        except Exception as e:  # noqa: BLE001
            released = self.fault(e)
            # the memoised cast of this weight was just given back: not a second time
            return any(len(x.result) > 2 and x.result[0] is weight for x in released)

    def handout(self, buf: Any, device: Any) -> None:
        """ComfyUI handed out a cast buffer that a cast is about to write."""
        if self.dropped or not self.memo:
            return
        try:
            hit = any(_overlap(_buffer_ranges(buf, device), e.ranges) for e in self.memo.values())
        except Exception as e:  # noqa: BLE001
            self.fault(e)
            return
        if hit:
            self.drop("a cast buffer handed out inside the MLP call holds an earlier layer's memoised cast")

    # ------------------------------------------------------------------ bookkeeping
    def _lookup(self, s, args, kwargs):
        if id(s) not in self.watch:
            return None, None
        sid = id(s)
        self.seen.add(sid)
        cut = self.cuts.get(sid)
        if cut is not None and _same_as(cut, args, kwargs):
            key = cut[4]                       # the key is built once per call, not per chunk
        else:
            key = _key(s, args, kwargs)
            self.cuts[sid] = _shortcut(args, kwargs, key)
        hit = self.memo.get(key)
        if hit is not None:
            self.stats.bump("cast_reuses")
        return key, hit

    def _note(self, s) -> None:
        if id(s) in self.watch:
            self.seen.add(id(s))
            self.stats.bump("casts")

    def _record(self, s, key, result) -> str | None:
        """Memoise a watched layer's cast; why the memo must be dropped, or None."""
        if key is not None:
            self.stats.bump("casts")
        if self.dropped:                       # dropped while ComfyUI cast (a buffer handed out)
            return None
        ranges = _ranges(result)
        if any(_overlap(ranges, e.ranges) for e in self.memo.values()):
            return (f"{type(s).__name__} was cast into memory that holds an earlier layer's cast "
                    "(one cast buffer reused)")
        if key is not None:
            self.memo[key] = _Entry(s, result, ranges)      # last: a fault before leaves no entry
        return None

    def _defers(self, s, weight) -> bool:
        return any(e.module is s and len(e.result) > 2 and e.result[0] is weight for e in self.memo.values())

    def fault(self, e: BaseException) -> list:
        """An error in this module's own code: count, log once, drop the memo (its deferred
        uncasts run now). Returns the entries given back."""
        try:
            self.stats.bump("cast_faults")
            if run_stats.once(("mlp-cast-fault", type(e).__name__, str(e)[:120]), logging.DEBUG, "cast fault"):
                log.error("SafeSage MLP: internal error in the cast memo (please report it, with this "
                          "traceback); this MLP call casts as ComfyUI does", exc_info=e)
        except Exception:  # noqa: BLE001 - the count is best effort, the fallback is not
            pass
        self.dropped = True
        return self.release()

    def drop(self, why: str) -> None:
        self.stats.bump("memo_dropped")
        self.stats.once_warning(f"SafeSage MLP: weights cast per chunk for this call: {why}")
        self.dropped = True
        self.release()

    def release(self) -> list:
        """ComfyUI's real uncast of every memoised cast, in cast order; every one runs even if
        one raises (the first error is raised after the others ran). Returns the entries."""
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
        return entries


if getattr(getattr(torch, "compiler", None), "is_compiling", None) is not None:
    @contain.boundary
    def compiling() -> bool:
        """``torch.compiler.is_compiling()``, looked up per call (dynamo reads it as a constant)."""
        return torch.compiler.is_compiling()
else:  # pragma: no cover - a torch without torch.compiler
    def compiling() -> bool:
        return False


def _wrap(owner: Any, name: str, make: Callable[[Callable], Callable]) -> bool:
    """Replace ``owner.name`` by ``make(real)`` unless it is already ours; False when absent."""
    real = getattr(owner, name, None)
    if real is None:
        return False
    if getattr(real, _MARK, False):
        return True
    fn = make(real)
    fn.__wrapped__ = real
    fn.__doc__ = real.__doc__
    setattr(fn, _MARK, True)
    setattr(owner, name, fn)
    return True


@contain.boundary
def install() -> bool:
    """Wrap ``comfy.ops.cast_bias_weight`` / ``uncast_bias_weight`` once (idempotent), and
    observe the cast buffers ComfyUI hands out (``comfy.model_management.get_cast_buffer`` /
    ``get_aimdo_cast_buffer``, where this ComfyUI has them). False when this ComfyUI has no
    cast / uncast functions (then chunks cast as ComfyUI does, once per chunk).

    Every wrapper asks ``torch.compiler.is_compiling()`` first and then runs ComfyUI's own
    function untouched: nothing a traced region runs reads a ContextVar, a lock or a cache."""
    import comfy.model_management as mm  # lazy: only when a model is patched inside ComfyUI
    import comfy.ops as ops
    if getattr(ops, "cast_bias_weight", None) is None or getattr(ops, "uncast_bias_weight", None) is None:
        return False

    def make_cast(real_cast):
        _REAL["cast"] = real_cast

        def cast_bias_weight(s, *args, **kwargs):
            if compiling():
                return real_cast(s, *args, **kwargs)
            scope = _SCOPE.get()
            if scope is None:
                return real_cast(s, *args, **kwargs)
            return scope.cast(real_cast, s, args, kwargs)
        return cast_bias_weight

    def make_uncast(real_uncast):
        _REAL["uncast"] = real_uncast

        def uncast_bias_weight(s, weight, bias, offload_stream, *args, **kwargs):
            if compiling():
                return real_uncast(s, weight, bias, offload_stream, *args, **kwargs)
            scope = _SCOPE.get()
            if scope is not None and scope.defers(s, weight):
                return None
            return real_uncast(s, weight, bias, offload_stream, *args, **kwargs)
        return uncast_bias_weight

    def make_buffer(real_get, device_at):
        def get_buffer(*args, **kwargs):
            if compiling():
                return real_get(*args, **kwargs)
            buf = real_get(*args, **kwargs)
            scope = _SCOPE.get()
            if scope is not None:
                scope.handout(buf, args[device_at] if len(args) > device_at else kwargs.get("device"))
            return buf
        return get_buffer

    _wrap(ops, "cast_bias_weight", make_cast)
    _wrap(ops, "uncast_bias_weight", make_uncast)
    _wrap(mm, "get_cast_buffer", lambda real: make_buffer(real, 1))        # (offload_stream, device, size, ref)
    _wrap(mm, "get_aimdo_cast_buffer", lambda real: make_buffer(real, 1))  # (offload_stream, device)
    return True


def installed() -> bool:
    """Whether ComfyUI's cast functions carry SafeSage's wrappers in this process."""
    ops = sys.modules.get("comfy.ops")
    return any(getattr(getattr(ops, n, None), _MARK, False) for n in ("cast_bias_weight", "uncast_bias_weight"))


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
