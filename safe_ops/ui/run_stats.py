"""Run statistics and log-once bookkeeping shared by every SafeSage component.

The one store of SafeSage's run statistics. Counters are process-wide (ComfyUI runs one model at
a time per process) and cheap: :func:`count` writes the calling thread's own dict, no lock (the
attention override counts on every call); a read (``snapshot()``, :func:`value`, a Section's)
sums every thread's counts into the store under its lock -- only the owning thread ever writes a
thread's dict, and the reader keeps apart what it has already summed, so no count is lost or
counted twice. Every other writer and ``snapshot()`` (the node's HTTP route, on the server
thread) share one lock; what is kept per call shape (plans, failed checks, fallback reasons) keeps
the newest ``MAX_KEYS``, and the log-once keys the newest ``MAX_LOG_KEYS``. Kernel families
switched off for the process are listed too. A component with counters of its own (the MLP) gets a
:class:`Section` of this store: its counters appear under its name in ``snapshot()``.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any, Callable

log = logging.getLogger("SafeSage")

MAX_KEYS = 256                          # per-shape entries kept (the newest)
MAX_LOG_KEYS = 4 * MAX_KEYS             # log-once keys kept (an evicted one may log once more)

_lock = threading.Lock()
STATS: Counter = Counter()
FALLBACKS: Counter = Counter()          # reason -> count
PLANS: dict[str, str] = {}              # shape key -> plan description (first seen)
DISABLED: dict[str, str] = {}           # "family on <arch (build)>" -> why it is not used again in this process
_DISABLED_AT: dict[str, tuple] = {}      # that label -> (family, where) (where None: everywhere)
FAILED_CHECKS: dict[str, str] = {}      # call class -> why its kernel failed the first-call check
_SECTION_FALLBACKS: dict[str, Counter] = {}   # section -> reason -> count
_logged: dict = {}                      # log-once keys (a dict keeps their insertion order)
_extra: dict[str, Any] = {}
_MAXIMA: set = set()                    # the _extra entries info_max keeps (reset() forgets them)
_THREADS: list = []                     # [thread, its counts, what reads have summed of them] per counting thread
_own = threading.local()                # .counts: the calling thread's dict (written by that thread only)


def _bounded(d: dict, keep: int | None = None) -> None:
    keep = MAX_KEYS if keep is None else keep
    while len(d) > keep:
        d.pop(next(iter(d)))


def trim(d: dict, keep: int | None = None, expendable: Callable[[Any], bool] = lambda v: True) -> None:
    """Bound a per-shape cache kept outside this module to ``keep`` (default ``MAX_KEYS``) entries
    (the caller holds its own lock): drop the oldest ``expendable`` values first, then the oldest."""
    keep = MAX_KEYS if keep is None else keep
    over = len(d) - keep
    if over <= 0:
        return
    for key in [k for k, v in d.items() if expendable(v)][:over]:
        del d[key]
    _bounded(d, keep)


MAX_THREAD_KEYS = 4 * MAX_KEYS          # keys a thread's own counts hold; a new one past that counts under the lock
_REASON = "fallback reason"             # (_REASON, reason): a fallback's reason among a thread's counts


def _no_compiler() -> bool:
    return False


try:
    import torch
    #: ``torch.compiler.is_compiling``: True while dynamo traces the caller (a constant to it)
    _tracing = getattr(getattr(torch, "compiler", None), "is_compiling", None) or _no_compiler
except ImportError:          # the store is read where torch is missing too (nothing is traced there)
    _tracing = _no_compiler


def count(key: Any, n: int = 1) -> None:
    """Add ``n`` to counter ``key``: the calling thread's own dict, no lock (summed on read).
    Nothing while torch.compile traces the caller: dynamo would replay a traced write of the
    thread's dict after every run of the graph with the values it saw when tracing, wiping what
    the graph's eager parts (SafeSage's opaque attention op) counted in between."""
    if _tracing():
        return
    try:
        c = _own.counts
    except AttributeError:
        c = _new_thread_counts()
    if key in c or len(c) < MAX_THREAD_KEYS:
        c[key] = c.get(key, 0) + n
    else:
        with _lock:
            _add(key, n)


def _add(key: Any, n: int) -> None:
    """Add to the store itself (the caller holds ``_lock``): a counter, or a fallback's reason."""
    if type(key) is tuple:
        FALLBACKS[key[1]] += n
        _bounded(FALLBACKS)
    else:
        STATS[key] += n


def counts() -> dict:
    """The calling thread's own counts, for a hot path that counts several things in one call:
    ``c[key] = c.get(key, 0) + n`` (only this thread writes it; a read sums it in). While
    torch.compile traces the caller, a dict of its own that nothing reads (see :func:`count`)."""
    if _tracing():
        return {}
    try:
        return _own.counts
    except AttributeError:
        return _new_thread_counts()


def _new_thread_counts() -> dict:
    c: dict = {}
    with _lock:
        _THREADS.append([threading.current_thread(), c, {}])
    _own.counts = c
    return c


def _sum_threads() -> None:
    """Every thread's counts since the last read into STATS (the caller holds ``_lock``). A
    thread's dict is copied whole (``dict.copy`` holds the GIL, or the dict's own lock without
    one); a thread that has ended is summed a last time and dropped."""
    for entry in list(_THREADS):
        thread, counts, seen = entry
        now = counts.copy()
        for key, v in now.items():
            d = v - seen.get(key, 0)
            if d:
                _add(key, d)
        entry[2] = now
        if not thread.is_alive():
            _THREADS.remove(entry)


def value(key: str) -> int:
    """Counter ``key`` now (every thread's counts summed)."""
    with _lock:
        _sum_threads()
        return int(STATS.get(key, 0))


def disabled(family: str, why: str, where: str | None = None) -> None:
    """Switch ``family`` off for this process where ``where`` says (a GPU arch and kernel build,
    ``Runtime.kernel_site``: the same family on another arch or build stays on); everywhere when
    None."""
    label = family if where is None else f"{family} on {where}"
    with _lock:
        DISABLED[label] = why
        _DISABLED_AT[label] = (family, where)


def disabled_families() -> dict[str, str]:
    """Kernel families switched off for this process ("family on <arch (build)>") -> why."""
    with _lock:
        return dict(DISABLED)


def disabled_at(sites: dict[str, str]) -> dict[str, str]:
    """family -> why, for the families of ``sites`` (family -> its site here) switched off at that
    site, and families switched off everywhere."""
    with _lock:
        return {fam: DISABLED[label] for label, (fam, where) in _DISABLED_AT.items()
                if where is None or sites.get(fam) == where}


def failed_check(call_class: str, why: str) -> None:
    with _lock:
        FAILED_CHECKS[call_class] = why
        _bounded(FAILED_CHECKS)


def record_call(plan_key: str | None, also: str | None = None, reason: str = "", key: Any = None) -> None:
    """The attention override's record of one call, made once per call (its last stage): ``attention_calls``,
    the plan's counter ``plan_key`` (None: none), a counter ``also`` (e.g. a :meth:`Section.key`), and a
    fallback's ``reason`` for call ``key`` (as :func:`fallback`). The calling thread's own counts, no lock.
    For an eager caller only: the override asked ``torch.compiler.is_compiling()`` itself, once per call,
    so this does not ask again (:func:`count` says why a traced caller must not count)."""
    try:
        c = _own.counts
    except AttributeError:
        c = _new_thread_counts()
    c["attention_calls"] = c.get("attention_calls", 0) + 1
    if plan_key is not None:
        c[plan_key] = c.get(plan_key, 0) + 1
    if also is not None:
        c[also] = c.get(also, 0) + 1
    if reason:
        _fallback(c, reason, key, logging.WARNING)


def fallback(reason: str, key: Any = None, level: int = logging.WARNING) -> None:
    """Count a fallback and its reason (the calling thread's own counts); log it once per
    (reason, key)."""
    _fallback(counts(), reason, key, level)


def _fallback(c: dict, reason: str, key: Any, level: int) -> None:
    c["fallbacks"] = c.get("fallbacks", 0) + 1
    rk = (_REASON, reason)
    if rk in c or len(c) < MAX_THREAD_KEYS:
        c[rk] = c.get(rk, 0) + 1
    else:
        count(rk)
    said = ("fallback", reason, key)
    if said not in _logged:         # the message is made only when it is said
        once(said, level, "SafeSage fallback: %s%s", reason, f" (call {key})" if key is not None else "")


def once(key: Any, level: int, msg: str, *args: Any) -> bool:
    if key in _logged:          # said already (a read: the lock is for the change)
        return False
    with _lock:
        if key in _logged:
            return False
        _logged[key] = None
        _bounded(_logged, MAX_LOG_KEYS)
    log.log(level, msg, *args)
    return True


class Section:
    """A component's own counters in this store, e.g. ``Section("mlp", ("calls", "chunks"))``:
    ``snapshot()[name]`` is ``{counter: n for every declared counter, "fallbacks": {reason: n}}``.
    Kept as ``STATS["<name>.<counter>"]``, under the store's lock, reset by ``reset()``."""

    def __init__(self, name: str, counters: tuple[str, ...], fallback_log: str = "{reason}"):
        self.name = name
        self.counters = tuple(counters)
        self.fallback_log = fallback_log        # the warning logged once per fallback reason
        with _lock:
            _SECTIONS[name] = self

    def bump(self, counter: str, n: int = 1) -> None:
        count(self.key(counter), n)

    def key(self, counter: str) -> str:
        """The store's key of ``counter`` (for :func:`record_call`'s ``also``)."""
        if counter not in self.counters:
            raise KeyError(f"{self.name} has no counter {counter!r}")
        return f"{self.name}.{counter}"

    def get(self, counter: str) -> int:
        with _lock:
            _sum_threads()
            return int(STATS.get(f"{self.name}.{counter}", 0))

    def __getattr__(self, name: str):
        # ``section.chunks`` reads a counter, ``section.fallbacks`` the reasons
        if name == "fallbacks":
            with _lock:
                return dict(_SECTION_FALLBACKS.get(self.name, {}))
        if name in self.__dict__.get("counters", ()):
            return self.get(name)
        raise AttributeError(name)

    def reset(self) -> None:
        """Zero this section's counters and forget its fallback reasons (its log-once keys stay)."""
        with _lock:
            _sum_threads()
            for c in self.counters:
                STATS.pop(f"{self.name}.{c}", None)
            _SECTION_FALLBACKS.pop(self.name, None)

    def once_warning(self, msg: str) -> None:
        once((self.name, msg), logging.WARNING, "%s", msg)

    def fallback(self, reason: str) -> None:
        """Count a fallback of this component; log it once per reason."""
        with _lock:
            c = _SECTION_FALLBACKS.setdefault(self.name, Counter())
            c[reason] += 1
            _bounded(c)
        self.once_warning(self.fallback_log.format(reason=reason))

    def _as_dict(self) -> dict:          # the caller holds the lock
        d = {c: int(STATS.get(f"{self.name}.{c}", 0)) for c in self.counters}
        d["fallbacks"] = dict(_SECTION_FALLBACKS.get(self.name, {}))
        return d

    def as_dict(self) -> dict:
        with _lock:
            _sum_threads()
            return self._as_dict()


_SECTIONS: dict[str, Section] = {}


def remember_plan(key: str, description: str) -> None:
    with _lock:
        new = key not in PLANS
        if new:
            PLANS[key] = description
            _bounded(PLANS)
    if new:
        log.info("SafeSage plan for %s: %s", key, description)


def set_info(name: str, value: Any) -> None:
    with _lock:
        _extra[name] = value


def info_max(name: str, value: int) -> None:
    """``snapshot()[name]`` is the largest ``value`` given since the last ``reset()``. No lock once the
    largest is known (the MLP asks on every call): a value not above it returns at once."""
    if _tracing() or (name in _MAXIMA and value <= _extra.get(name, 0)):
        return
    with _lock:
        _MAXIMA.add(name)
        if value > _extra.get(name, 0):
            _extra[name] = value


def snapshot() -> dict:
    with _lock:
        _sum_threads()
        return {
            **{name: sec._as_dict() for name, sec in _SECTIONS.items()},
            **{k: int(v) for k, v in STATS.items() if "." not in k},
            "attention_calls": int(STATS.get("attention_calls", 0)),
            "fallbacks": int(STATS.get("fallbacks", 0)),
            "fallback_reasons": dict(FALLBACKS),
            "plans": dict(PLANS),
            "disabled_families": dict(DISABLED),
            "failed_checks": dict(FAILED_CHECKS),
            **{k: v for k, v in _extra.items()},
        }


def reset() -> None:
    """Forget counters and log-once keys (tests, and a new node execution if wanted)."""
    with _lock:
        _sum_threads()          # what the threads counted so far is behind the reset
        STATS.clear()
        FALLBACKS.clear()
        PLANS.clear()
        DISABLED.clear()
        _DISABLED_AT.clear()
        FAILED_CHECKS.clear()
        _SECTION_FALLBACKS.clear()
        _logged.clear()
        for name in _MAXIMA:
            _extra.pop(name, None)
