"""Run statistics and log-once bookkeeping shared by every SafeSage component.

Counters are process-wide (ComfyUI runs one model at a time per process) and
cheap: plain dict increments under the GIL. ``snapshot()`` is what the node's
HTTP route and the tests read.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

log = logging.getLogger("SafeSage")

_lock = threading.Lock()
STATS: Counter = Counter()
FALLBACKS: Counter = Counter()          # reason -> count
PLANS: dict[str, str] = {}              # shape key -> plan description (first seen)
_logged: set = set()
_extra: dict[str, Any] = {}


def count(key: str, n: int = 1) -> None:
    STATS[key] += n


def fallback(reason: str, key: Any = None, level: int = logging.WARNING) -> None:
    """Count a fallback; log it once per (reason, key)."""
    FALLBACKS[reason] += 1
    STATS["fallbacks"] += 1
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
    if key not in PLANS:
        PLANS[key] = description
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
            **{k: v for k, v in _extra.items()},
        }


def reset() -> None:
    """Forget counters and log-once keys (tests, and a new node execution if wanted)."""
    with _lock:
        STATS.clear()
        FALLBACKS.clear()
        PLANS.clear()
        _logged.clear()
