"""A run's quality outcome in one line, as the node shows it under its status (web/safesage.js)
and ``/safesage/stats`` keeps it (``quality_last_run["summary"]``), e.g.
``last run: blocks 4-5 → fake_kitchen, 0.051-0.064 over 0.013``.

Made from the per-block entries guard.py publishes (``quality_last_run["choices"]["blocks"]``:
block, planned, planned_error, family, target, moved); pure, no torch.
"""
from __future__ import annotations

from .targets import COMFY

PREFIX = "last run: "


def _num(lo: float, hi: float) -> str:
    a, b = f"{lo:.3f}", f"{hi:.3f}"
    return a if a == b else f"{a}-{b}"


def _span(blocks: list) -> str:
    lo, hi = blocks[0], blocks[-1]
    return f"block {lo}" if lo == hi else f"blocks {lo}-{hi}"


def summary(blocks: list[dict]) -> str:
    """One short line: each run of neighbouring moved blocks with the same planned family and
    the same new one as ``blocks A-B → family, <planned error range> over <target range>``
    (``;`` between runs), else how many blocks stayed; blocks measured without a verdict
    (inconclusive, no target) are counted at the end."""
    moved = sorted((e for e in blocks if e.get("moved")), key=lambda e: e["block"])
    parts: list[str] = []
    group: list[dict] = []

    def flush():
        if not group:
            return
        fam = group[0]["family"]
        name = f"{fam} (ComfyUI's own)" if fam == COMFY else fam
        errs = [e["planned_error"] for e in group if e.get("planned_error") is not None]
        tgts = [e["target"] for e in group if e.get("target") is not None]
        piece = f"{_span(sorted({e['block'] for e in group}))} → {name}"
        if errs:
            piece += f", {_num(min(errs), max(errs))}"
            if tgts:
                piece += f" over {_num(min(tgts), max(tgts))}"
        parts.append(piece)
        group.clear()

    for e in moved:
        g = group[-1] if group else None
        if g is not None and (e["family"] != g["family"] or e.get("planned") != g.get("planned")
                              or e["block"] - g["block"] > 1):
            flush()
        group.append(e)
    flush()
    unsure = {e["block"] for e in blocks if not e.get("moved")
              and (e.get("planned_error") is None or e.get("target") is None)}
    stayed = {e["block"] for e in blocks} - {e["block"] for e in moved} - unsure
    if not parts:
        parts.append(f"no block moved ({len(stayed)} within target)" if stayed or not unsure else "no block moved")
    if unsure:
        parts.append(f"{len(unsure)} block{'s' if len(unsure) != 1 else ''} inconclusive")
    return PREFIX + "; ".join(parts)
