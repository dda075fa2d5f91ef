"""Run statistics and log-once bookkeeping shared by every SafeSage component.

Counters are process-wide (ComfyUI runs one model at a time per process) and
cheap. Writers and ``snapshot()`` (the node's HTTP route, on the server thread) share one lock;
what is kept per call shape (plans, failed checks, fallback reasons) keeps the newest
``MAX_KEYS``. Kernel families switched off for the process are listed too.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

log = logging.getLogger("SafeSage")

MAX_KEYS = 256                          # per-shape entries kept (the newest)

_lock = threading.Lock()
STATS: Counter = Counter()
FALLBACKS: Counter = Counter()          # reason -> count
PLANS: dict[str, str] = {}              # shape key -> plan description (first seen)
DISABLED: dict[str, str] = {}           # kernel family -> why it is not used again in this process
FAILED_CHECKS: dict[str, str] = {}      # call class -> why its kernel failed the first-call check
_logged: set = set()
_extra: dict[str, Any] = {}


def _bounded(d: dict) -> None:
    while len(d) > MAX_KEYS:
        d.pop(next(iter(d)))


def count(key: str, n: int = 1) -> None:
    with _lock:
        STATS[key] += n


def disabled(family: str, why: str) -> None:
    with _lock:
        DISABLED[family] = why


def failed_check(call_class: str, why: str) -> None:
    with _lock:
        FAILED_CHECKS[call_class] = why
        _bounded(FAILED_CHECKS)


def fallback(reason: str, key: Any = None, level: int = logging.WARNING) -> None:
    """Count a fallback; log it once per (reason, key)."""
    with _lock:
        FALLBACKS[reason] += 1
        STATS["fallbacks"] += 1
        if len(FALLBACKS) > MAX_KEYS:
            del FALLBACKS[next(iter(FALLBACKS))]
    once(("fallback", reason, key), level, "SafeSage fallback: %s%s", reason,
         f" (call {key})" if key is not None else "")


def once(key: Any, level: int, msg: str, *args: Any) -> bool:
    with _lock:
        if key in _logged:
            return False
        _logged.add(key)
    log.log(level, msg, *args)
    return True


def remember_plan(key: str, description: str) -> None:
    with _lock:
        new = key not in PLANS
        if new:
            PLANS[key] = description
            _bounded(PLANS)
    if new:
        log.info("SafeSage plan for %s: %s", key, description)


def set_info(name: str, value: Any) -> None:
    _extra[name] = value


def snapshot() -> dict:
    from .mlp import MLP_STATS
    with _lock:
        return {
            "mlp": MLP_STATS.as_dict(),
            **{k: int(v) for k, v in STATS.items()},
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
        STATS.clear()
        FALLBACKS.clear()
        PLANS.clear()
        DISABLED.clear()
        FAILED_CHECKS.clear()
        _logged.clear()
