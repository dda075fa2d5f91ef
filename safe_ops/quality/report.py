"""What a quality-guard run chose, for the user: the per-block report, its one line, and the event.

The guard (guard.py) hands each run's choices here; ``/safesage/stats`` (``quality_last_run``), the node's
line under its status and the stats panel read :func:`report`; one ``safesage.quality`` event per run
that published something (:func:`send_outcome`).
"""
from __future__ import annotations

import threading

from ..ui import run_stats
from . import targets

#: how a run's choices are shown (``/safesage/stats`` ``quality.last_run``)
_LAST: dict = {}
_LAST_LOCK = threading.Lock()


def _r(x):
    return None if x is None else round(float(x), 5)


def predicted_cost(choices: list) -> dict:
    """The choices' predicted attention time relative to the policy's planned family, averaged over
    the blocks (speed_budget's prices): ``budget`` over the blocks the budget placed (moved or not),
    ``safety`` over those the target moved (apart: they move whatever the budget), and how many
    blocks' cost is unknown (a family with no speed on this arch)."""
    def mean(cs):
        known = [c.cost for c in cs if c.cost is not None]
        return round(sum(known) / len(known), 4) if known else None
    safety = [c for c in choices if c.rule == "target"]
    rest = [c for c in choices if c.rule != "target"]
    return {"budget": mean(rest), "safety": mean(safety), "safety_blocks": len(safety),
            "unknown": sum(c.cost is None for c in choices)}


def entry(c: targets.Choice) -> dict:
    """One (block, class of call) of a run: what was planned and its error, the target, what runs
    from step 2 on (``family``) and its error, whether it moved, why, the candidates' errors, and
    ``alternatives``: the other families under the target it runs, in order, where ``family``
    cannot (failed its check, switched off; ``quality.moved_fallbacks`` counts those calls)."""
    return {"block": c.block, "family": c.family, "error": _r(c.error), "planned": c.planned,
            "planned_error": _r(c.planned_error), "target": _r(c.target), "moved": c.moved, "why": c.why,
            "candidates": {f: _r(e) for f, e in c.candidates.items()}, "call_class": c.klass,
            "alternatives": list(c.alternatives), "runs_now": c.family, "rule": c.rule, "cost": _r(c.cost)}


def runs_now(st, block: int, klass: str, family: str) -> None:
    """A moved block's calls run ``family`` instead of the family chosen for them (it failed its
    first-call check or was switched off; the override's fallback): the last run's report says so
    (``runs_now``), once per change (st.fell)."""
    key = (block, klass)
    if st.fell.get(key) == family:
        return
    st.fell[key] = family
    with _LAST_LOCK:
        for e in (_LAST.get("choices") or {}).get("blocks", []):
            if e["block"] == block and e.get("call_class") == klass:
                e["runs_now"] = family
        run_stats.set_info("quality_last_run", dict(_LAST))


_unsent = False          # published since the last event (under _LAST_LOCK)


def publish(kind: str, value: dict) -> None:
    global _unsent
    if kind == "choices":
        from .outcome import summary
        line = summary(value.get("blocks", []))
    with _LAST_LOCK:
        if kind == "choices":
            _LAST.pop("later", None)          # a later step's report belongs to the run it was measured in
            _LAST["summary"] = line
        _LAST[kind] = value
        _unsent = True
        run_stats.set_info("quality_last_run", dict(_LAST))


def send_outcome() -> None:
    """One ``safesage.quality`` event with :func:`report` (per-block choices, the one-line
    summary) when this run published something; nothing without a ComfyUI server (ui/events.py)."""
    global _unsent
    with _LAST_LOCK:
        if not _unsent:
            return
        _unsent = False
    from ..ui import events
    events.send(events.QUALITY, report())


def report() -> dict:
    """The last run's per-block choices, its one-line ``summary`` (and a later step's report), as
    ``/safesage/stats`` (``quality_last_run``) and the ``safesage.quality`` event show them."""
    with _LAST_LOCK:
        return dict(_LAST)
