"""What a quality-guard run chose, for the user: the per-block report per SafeSage node, its one line, and
the event.

The guard (guard.py) hands each run's choices here under its node (``QualityGuard.node``: ComfyUI's id of
the SafeSage node that patched the model, a subgraph node's path included; "" where SafeSage runs without
a node). ``/safesage/stats`` ``quality_last_run`` holds the latest run's report at its top level (what one
node shows) and every node's under ``nodes``; one ``safesage.quality`` event per node whose run
published, carrying that node's report and its ``node`` (:func:`send_outcome`), to the prompt's client
(ui/events.py). A run that measured nothing and chose nothing (no step after the probe, every block of
another tower) replaces its node's earlier report with one saying so: no node shows an older prompt's
outcome as this one's.
"""
from __future__ import annotations

import threading

from ..ui import run_stats
from . import targets

_LAST: dict = {}              # the latest published node's report (top level of quality_last_run)
_NODES: dict = {}             # node -> its last run's report
_LAST_LOCK = threading.Lock()
_unsent: set = set()          # nodes published since the last event (under _LAST_LOCK)


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
    from step 2 on (``family``) and its error, whether it moved, by which rule (``budget``: less error
    within the speed budget; ``target``: over its target, whatever the budget) at what predicted
    attention time (``cost``, relative to the kernel policy's family), why, the candidates' errors, and
    ``alternatives``: the other families it runs, in order, where ``family`` cannot (failed its check,
    switched off; ``quality.moved_fallbacks`` counts those calls)."""
    return {"block": c.block, "family": c.family, "error": _r(c.error), "planned": c.planned,
            "planned_error": _r(c.planned_error), "target": _r(c.target), "moved": c.moved, "why": c.why,
            "candidates": {f: _r(e) for f, e in c.candidates.items()}, "call_class": c.klass,
            "alternatives": list(c.alternatives), "runs_now": c.family, "rule": c.rule, "cost": _r(c.cost)}


def _info() -> None:
    run_stats.set_info("quality_last_run", {**_LAST, "nodes": {k: dict(v) for k, v in _NODES.items()}})


def runs_now(st, block: int, klass: str, family: str) -> None:
    """A moved block's calls run ``family`` instead of the family chosen for them (it failed its
    first-call check or was switched off; the override's fallback): the last run's report says so
    (``runs_now``), once per change (st.fell)."""
    key = (block, klass)
    if st.fell.get(key) == family:
        return
    st.fell[key] = family
    with _LAST_LOCK:
        for rep in [_LAST] + list(_NODES.values()):
            for e in (rep.get("choices") or {}).get("blocks", []):
                if e["block"] == block and e.get("call_class") == klass:
                    e["runs_now"] = family
        _info()


def publish(kind: str, value: dict, node: str | None = None, run: object = None) -> None:
    """Sampling run ``run``'s ``choices`` (or a ``later`` step's report, or ``none``: nothing measured,
    with its ``reason``) for ``node``; the first of a run replaces the node's earlier report."""
    from .outcome import PREFIX, summary
    node = node or ""
    if kind == "choices":
        line = summary(value.get("blocks", []), value)
    elif kind == "none":
        line = PREFIX + value.get("reason", "nothing measured")
    with _LAST_LOCK:
        rep = _NODES.get(node)
        if rep is None or rep.get("run") != run:
            rep = _NODES[node] = {"node": node, "run": run}     # a new run: the node's earlier report goes
        if kind in ("choices", "none"):
            rep["summary"] = line
        if kind != "none":
            rep[kind] = value
        _LAST.clear()
        _LAST.update(rep)
        _unsent.add(node)
        run_stats.trim(_NODES, None)
        _info()


def send_outcome() -> None:
    """One ``safesage.quality`` event per node that published since the last, with that node's report
    (per-block choices, the one-line summary, ``node``); nothing without a ComfyUI server (ui/events.py)."""
    with _LAST_LOCK:
        nodes = list(_unsent)
        _unsent.clear()
        reports = [dict(_NODES.get(n, {"node": n})) for n in nodes]
    if not reports:
        return
    from ..ui import events
    for rep in reports:
        events.send(events.QUALITY, rep)


def report(node: str | None = None) -> dict:
    """The latest run's report (``node`` None) or ``node``'s: per-block choices, the one-line
    ``summary`` (and a later step's report), as ``/safesage/stats`` and the ``safesage.quality`` event
    show them."""
    with _LAST_LOCK:
        return dict(_LAST) if node is None else dict(_NODES.get(node, {}))
