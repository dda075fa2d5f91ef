"""A run's quality outcome in words: one line under the node's status (web/safesage.js,
``/safesage/stats`` ``quality_last_run["summary"]``), e.g.
``last run: blocks 4-5 → fake_kitchen, 0.051-0.064 over 0.013 → 0.006``, and one log line per group of
blocks (:func:`lines`, what guard.py logs).

Both come from one grouping rule (:func:`groups`): neighbouring blocks of one class of call with the same
planned family, the same family run from then on and the same rule. Made from the per-block entries
guard.py publishes (report.entry: block, planned, planned_error, family, error, target, moved, rule,
call_class); pure, no torch.
"""
from __future__ import annotations

from .targets import COMFY

PREFIX = "last run: "


def _num(lo: float, hi: float) -> str:
    a, b = f"{lo:.3f}", f"{hi:.3f}"
    return a if a == b else f"{a}-{b}"


def _range(values) -> str | None:
    vals = [v for v in values if v is not None]
    return _num(min(vals), max(vals)) if vals else None


def _span(blocks: list) -> str:
    lo, hi = blocks[0], blocks[-1]
    return f"block {lo}" if lo == hi else f"blocks {lo}-{hi}"


def groups(entries: list[dict]) -> list[list[dict]]:
    """The one grouping rule: runs of neighbouring blocks (sorted by class of call, then block) with the
    same class of call, planned family, family run from the next step and rule."""
    out: list[list[dict]] = []
    for e in sorted(entries, key=lambda e: (e.get("call_class") or "", e["block"])):
        g = out[-1] if out else None
        if g is not None and all(e.get(k) == g[-1].get(k) for k in ("call_class", "planned", "family", "rule")) \
                and e["block"] - g[-1]["block"] <= 1:
            g.append(e)
        else:
            out.append([e])
    return out


def _moved_words(group: list[dict]) -> str:
    """``blocks 4-5 → fam, <before> over <target> → <after>`` (the target's move) or ``..., <before> →
    <after> within the speed budget`` (the budget's)."""
    fam = group[0]["family"]
    name = f"{fam} (ComfyUI's own)" if fam == COMFY else fam
    piece = f"{_span(sorted({e['block'] for e in group}))} → {name}"
    before = _range(e.get("planned_error") for e in group)
    after = _range(e.get("error") for e in group)
    target = _range(e.get("target") for e in group)
    if before:
        piece += f", {before}"
        if group[0].get("rule") == "budget":
            piece += (f" → {after}" if after else "") + " within the speed budget"
        else:
            piece += (f" over {target}" if target else "") + (f" → {after}" if after else "")
    return piece


def lines(entries: list[dict]) -> list[str]:
    """One line per group (the log's), moved or not, e.g. ``blocks 41-49: ck_int8 -- sage2_sm89_fp8pv
    0.051-0.064 over target 0.045`` / ``blocks 0-40: sage2_sm89_fp8pv (0.010-0.020, target 0.045)``."""
    out = []
    for g in groups(entries):
        span = _span([g[0]["block"], g[-1]["block"]])
        if not g[0].get("moved"):
            errs = _range(e.get("planned_error") for e in g)
            tgt = [e["target"] for e in g if e.get("target") is not None]
            out.append(f"{span}: {g[0]['family']} (" + (errs or "inconclusive")
                       + (f", target {max(tgt):.3f})" if tgt else ")"))
        else:
            out.append(f"{span}: {g[0]['family']} -- {g[0]['planned']} {_range(e.get('planned_error') for e in g)}"
                       + (f" over target {_range(e.get('target') for e in g)}" if g[0].get("rule") != "budget"
                          else " within the speed budget"))
    return out


def summary(blocks: list[dict], run: dict | None = None) -> str:
    """One short line: each group of moved blocks (:func:`groups`) as ``blocks A-B → family, <error
    before> over <target> → <error after>`` (``;`` between groups), else how many blocks stayed; blocks
    measured without a verdict (inconclusive, no target) are counted at the end. ``run``: the run's
    ``source`` (errors measured this prompt or remembered), ``budget`` and predicted ``cost``
    (guard.predicted_cost), said at the end when a speed budget applied."""
    moved = [e for e in blocks if e.get("moved")]
    parts = [_moved_words(g) for g in groups(moved)]
    unsure = {e["block"] for e in blocks if not e.get("moved")
              and (e.get("planned_error") is None or e.get("target") is None)}
    stayed = {e["block"] for e in blocks} - {e["block"] for e in moved} - unsure
    if not parts:
        parts.append(f"no block moved ({len(stayed)} within target)" if stayed or not unsure else "no block moved")
    if unsure:
        parts.append(f"{len(unsure)} block{'s' if len(unsure) != 1 else ''} inconclusive")
    run = run or {}
    cost = (run.get("cost") or {}).get("budget")
    if run.get("budget", 1.0) > 1.0 and cost is not None:
        safety = (run.get("cost") or {}).get("safety")
        parts.append(f"predicted attention time {cost:.2f}x the fastest kernel's (budget {run['budget']:.2f}x)"
                     + (f", moves over target {safety:.2f}x" if safety is not None else ""))
    if run.get("source") == "remembered":
        parts.append("errors remembered from an earlier prompt")
    return PREFIX + "; ".join(parts)
