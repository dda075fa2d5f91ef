"""The logic of bench/length/max_length.py, apart from the servers it starts: the search over H3's frame grid,
what a bench.repro row's outcome means here, the verdict rule, the per-budget summary (ratios, the
Preflight comparison) and the JSON merge. No torch, no GPU, no ComfyUI: tests/unit/test_max_length.py
drives it with fake probes.

Outcomes of a probe (one length of one arm, one fresh ComfyUI server):
  completed       the prompt finished (before the output check; afterwards it stays "completed",
                  with ``verified`` true, or false and ``unverified`` saying why)
  out of memory   ComfyUI's OOM error (torch.OutOfMemoryError / "out of memory" / "Got an OOM")
  fault           a native abort (signal), a CUDA error, a timeout, any other Python error
  wrong output    completed, but rel. L2 vs the reference > verdict.WRONG_FACTOR x the in-limit error
  error           the harness, not the arm: the prompt was rejected, the server did not answer
  not finished    cut by the call's deadline (its timeout was shortened): neither success nor failure
"""
from __future__ import annotations

COMPLETED, OOM, FAULT, WRONG, ERROR, UNFINISHED = (
    "completed", "out of memory", "fault", "wrong output", "error", "not finished")
OOM_TEXT = ("outofmemoryerror", "out of memory", "would exceed allowed memory", "got an oom")
CUDA_TEXT = ("illegal memory access", "cuda error", "acceleratorerror", "device-side assert", "misaligned address")


def classify(row: dict, timeout_cut: bool = False) -> tuple[str, str]:
    """(outcome, detail) of a bench.repro worker row (worker.run_row's fields, with the driver's
    ``key_lines`` from logs.log_excerpt when the log was read). ``timeout_cut``: the row's timeout was
    shortened by the call's deadline, so a timeout says nothing about the length."""
    out = row.get("outcome") or ""
    err = (row.get("error") or "").strip()
    if out == "completed":
        return COMPLETED, "completed"
    lines = [err, *row.get("key_lines", [])]
    text = " ".join(lines).lower()
    what = [ln.split("what():", 1)[1].strip() for ln in row.get("key_lines", []) if "what():" in ln]
    if out.startswith("timeout"):
        return (UNFINISHED, f"cut by the call's deadline: {out}") if timeout_cut else (FAULT, out)
    if out.startswith("process abort"):
        return FAULT, out + (f": {what[-1][:160]}" if what else "")
    if out.startswith("Python error"):
        if any(t in text for t in OOM_TEXT):
            return OOM, err or out
        return FAULT, f"{out}: {err}" if err else out
    if any(t in text for t in CUDA_TEXT):
        return FAULT, f"{out}: {err}" if err else out
    return ERROR, f"{out}: {err}" if err else (out or "no outcome")


def is_wrong(rel_l2: float, in_limit: float, factor: float) -> bool:
    """bench/repro/verdict.py's rule: silently wrong above ``factor`` x the in-limit error."""
    return rel_l2 > factor * in_limit


# ------------------------------------------------------------------------------------------ the search
def bracket(probes: list[dict], grid: list[int]) -> dict:
    """Where the longest completing length lies, from ``probes`` ({frames, outcome}): ``max_frames`` the
    longest that completed, ``fail_above_frames`` the shortest failure above it (None: none tried),
    ``resolved`` when nothing on ``grid`` lies between them (or the grid's top completed, or its bottom
    failed), ``non_monotone`` the failures below a completed length. "not finished" counts as untried."""
    idx = {n: i for i, n in enumerate(grid)}
    done = [(idx[p["frames"]], p["outcome"]) for p in probes if p["outcome"] != UNFINISHED]
    ok = [i for i, o in done if o == COMPLETED]
    lo = max(ok) if ok else None
    above = [i for i, o in done if o != COMPLETED and (lo is None or i > lo)]
    hi = min(above) if above else None
    resolved = (lo is not None and (lo == len(grid) - 1 or (hi is not None and hi - lo <= 1))) or \
        (lo is None and hi == 0)
    first_fail = next((o for i, o in done if i == hi), None)
    return {"max_frames": grid[lo] if lo is not None else None,
            "fail_above_frames": grid[hi] if hi is not None else None, "fail_above_outcome": first_fail,
            "resolved": resolved,
            "non_monotone": sorted(grid[i] for i, o in done if o != COMPLETED and lo is not None and i < lo)}


def next_length(probes: list[dict], grid: list[int], start: int, grow: float, shrink: float) -> int | None:
    """The next length to try: ``start`` first (the longest grid length not above it); above the
    longest completed length by x``grow`` while nothing above it failed; below the shortest failure by
    /``shrink`` while nothing completed; then bisection of the bracket. None: the bracket is resolved."""
    if not [p for p in probes if p["outcome"] != UNFINISHED]:
        return max([n for n in grid if n <= start] or grid[:1])
    b = bracket(probes, grid)
    if b["resolved"]:
        return None
    lo, hi = b["max_frames"], b["fail_above_frames"]
    i_lo = grid.index(lo) if lo is not None else None
    i_hi = grid.index(hi) if hi is not None else None
    if i_lo is not None and i_hi is not None:
        return grid[(i_lo + i_hi) // 2]
    if i_lo is not None:                      # only completions above: expand
        want = lo * grow
        return next((n for n in grid[i_lo + 1:] if n >= want), grid[-1])
    want = hi / shrink                        # only failures: contract
    below = [n for n in grid[:i_hi] if n <= want]
    return below[-1] if below else grid[0]


def search(probe, grid: list[int], start: int, *, limit: int, grow: float = 1.25, shrink: float = 1.25,
           may_probe=lambda: True) -> dict:
    """Probe lengths of ``grid`` (ascending frame counts) until the bracket is resolved, ``limit`` probes
    ran, or ``may_probe()`` says no (the deadline). ``probe(frames)`` returns a probe dict with at least
    ``outcome``; a probe that is not finished is kept but does not count as tried (it is not repeated).
    Returns {start_frames, probes, stop, **bracket}."""
    probes: list[dict] = []
    stop = None
    while stop is None:
        n = next_length(probes, grid, start, grow, shrink)
        if n is None:
            stop = "resolved"
        elif n in {p["frames"] for p in probes}:
            stop = "deadline"                 # the next length is one the deadline cut: not repeated
        elif len(probes) >= limit:
            stop = "probe limit"
        elif not may_probe():
            stop = "deadline"
        else:
            p = dict(probe(n))
            p.setdefault("frames", n)
            probes.append(p)
    return {"start_frames": max([n for n in grid if n <= start] or grid[:1]), "probes": probes, "stop": stop,
            **bracket(probes, grid)}


# ------------------------------------------------------------------------------------------ judging
def judge(probes: list[dict], reference, in_limit: float | None, factor: float) -> None:
    """Check the output of an arm's completed probes, longest first, in place: ``reference(frames)``
    returns (rel. L2 vs the reference, None) or (None, why there is none). A probe over the rule becomes
    "wrong output" and the next shorter completed one is checked; the first correct one ends it (shorter
    ones are left "completed", ``verified`` None: not needed). Unverifiable ones keep "completed" with
    ``verified`` false and ``unverified`` (why), and the next shorter one is checked."""
    for p in sorted((p for p in probes if p["outcome"] == COMPLETED), key=lambda p: -p["frames"]):
        if in_limit is None:
            p.update(verified=False, unverified="no in-limit error to judge by")
            continue
        rel, why = reference(p["frames"])
        if rel is None:
            p.update(verified=False, unverified=why)
            continue
        p["rel_l2_vs_reference"] = rel
        if is_wrong(rel, in_limit, factor):
            p.update(outcome=WRONG, verified=True, detail=f"rel. L2 {rel:.4g} > {factor:g} x {in_limit:.4g}")
            continue
        p["verified"] = True
        return


def arm_summary(result: dict, grid: list[int], tokens) -> dict:
    """The arm's fields after judging: max_frames / max_tokens (the longest completed, not wrong),
    ``verified`` (its output was checked), the bracket again (wrong outputs count as failures)."""
    b = bracket(result["probes"], grid)
    best = next((p for p in result["probes"] if p["frames"] == b["max_frames"] and p["outcome"] == COMPLETED), None)
    out = dict(result, **b)
    out["max_tokens"] = tokens(b["max_frames"]) if b["max_frames"] else None
    out["fail_above_tokens"] = tokens(b["fail_above_frames"]) if b["fail_above_frames"] else None
    out["verified"] = bool(best and best.get("verified"))
    ver = [p["frames"] for p in result["probes"] if p["outcome"] == COMPLETED and p.get("verified")]
    out["max_frames_verified"] = max(ver) if ver else None
    return out


# ------------------------------------------------------------------------------------------ the summary
def _ratio(a, b):
    return round(a / b, 3) if a and b else None


def ratios(arms: dict, guarded: str = "safesage", unguarded: str = "sage") -> dict:
    """safesage_over_unguarded_sage and safesage_over_best_other (max_tokens ratios), each with bounds
    from the brackets ([guarded's max / other's first failure, guarded's first failure / other's max]:
    the true ratio lies between where both brackets are resolved), the best other arm, the goal
    (>= 2x unguarded sage, >= the best other) and the unverified arms they rest on."""
    if guarded not in arms:
        return {}
    g = arms[guarded]
    others = {k: v for k, v in arms.items() if k != guarded}
    best = max(others, key=lambda k: others[k].get("max_tokens") or 0) if others else None
    out = {"best_other": best}
    for key, name in (("safesage_over_unguarded_sage", unguarded), ("safesage_over_best_other", best)):
        o = arms.get(name) if name else None
        if o is None:
            out[key] = None
            continue
        out[key] = _ratio(g.get("max_tokens"), o.get("max_tokens"))
        out[key + "_bounds"] = [_ratio(g.get("max_tokens"), o.get("fail_above_tokens")),
                                _ratio(g.get("fail_above_tokens"), o.get("max_tokens"))]
        if g.get("max_tokens") and not o.get("max_tokens"):
            out[key + "_note"] = f"{name} completed none of the lengths it tried (ratio unbounded)"
    s, u = g.get("max_tokens") or 0, (arms.get(unguarded) or {}).get("max_tokens") or 0
    b = (arms.get(best) or {}).get("max_tokens") or 0 if best else 0
    out["goal"] = {"safesage_ge_2x_unguarded_sage": bool(s) and s >= 2 * u if unguarded in arms else None,
                   "safesage_ge_best_other": bool(s) and s >= b if best else None}
    out["unverified_arms"] = sorted(k for k, v in arms.items() if v.get("max_frames") and not v.get("verified"))
    return out


#: Preflight's prediction is to land within this fraction of each arm's measured longest (issue #47)
PREFLIGHT_TOLERANCE = 0.15
#: the fields :func:`preflight_vs_measured` writes (and an older call's version of them)
PREFLIGHT_CHECK_KEYS = ("preflight_over_measured", "within_15pct", "over_measured_safesage", "gap_over_10pct")


def preflight_vs_measured(pf: dict, arms: dict) -> dict:
    """Preflight's predicted longest length per arm (``pf["arms"]``) next to the measured one (``arms``):
    ``preflight_over_measured`` (tokens) and whether it is within PREFLIGHT_TOLERANCE, per arm both have."""
    ratio, within = {}, {}
    for arm, m in arms.items():
        p = (pf.get("arms") or {}).get(arm) or {}
        if p.get("max_tokens") and m.get("max_tokens"):
            r = p["max_tokens"] / m["max_tokens"]
            ratio[arm], within[arm] = round(r, 3), abs(r - 1) <= PREFLIGHT_TOLERANCE
    return {"preflight_over_measured": ratio, "within_15pct": within} if ratio else {}


# ------------------------------------------------------------------------------------------ the JSON
IDENTITY = ("width", "height", "text_tokens", "steps", "seed", "blocks", "ckpt_bytes", "emulate_arch", "cpu")


def merge(old: dict | None, new: dict) -> dict:
    """``new`` (this call's document) merged into ``old`` (an earlier call's, same setup): budgets
    measured now replace the same budgets there, the others are kept; ``calls`` lists every call.
    A document of another setup (IDENTITY) is refused: ValueError."""
    if not old:
        return dict(new, calls=list(new.get("calls", [])))
    diff = {k: (old.get(k), new.get(k)) for k in IDENTITY if old.get(k) != new.get(k)}
    if diff:
        raise ValueError(f"cannot merge into a document of another setup: {diff}")
    out = dict(old)
    out.update({k: v for k, v in new.items() if k not in ("budgets", "calls", "in_limit")})
    out["budgets"] = dict(old.get("budgets", {}))
    for key, b in new.get("budgets", {}).items():
        out["budgets"][key] = merge_budget(out["budgets"].get(key), b)
    out["calls"] = list(old.get("calls", [])) + [c for c in new.get("calls", []) if c not in old.get("calls", [])]
    if new.get("in_limit") or old.get("in_limit"):
        out["in_limit"] = new.get("in_limit") or old.get("in_limit")
    return out


def merge_budget(old: dict | None, new: dict) -> dict:
    """One budget measured over several calls (e.g. ARMS="safesage sage", then ARMS="pytorch"): the arms
    and references of both, this call's replacing the same arm's; the ratios and the Preflight comparison
    computed again over all arms; ``commands`` lists each call's command."""
    if not old:
        return dict(new, commands=[new.get("command")])
    out = dict(old, **new)
    out["arms"] = {**old.get("arms", {}), **new.get("arms", {})}
    out["references"] = {**old.get("references", {}), **new.get("references", {})}
    out["commands"] = list(old.get("commands", [old.get("command")])) + [new.get("command")]
    for k in [k for k in out if k.startswith(SUMMARY_KEYS)]:     # the summary again, over all arms
        del out[k]
    pf = {k: v for k, v in (out.get("preflight") or {}).items() if k not in PREFLIGHT_CHECK_KEYS}
    if all("max_tokens" in a for a in out["arms"].values()):      # every arm judged
        out.update(ratios(out["arms"]))
        pf.update(preflight_vs_measured(pf, out["arms"]))
    if "preflight" in out:
        out["preflight"] = pf
    return out


SUMMARY_KEYS = ("safesage_over_", "goal", "best_other", "unverified_arms")


def budget_key(gib: float) -> str:
    """"24" for 24 GiB, "0.5" for half a GiB."""
    return str(int(gib)) if float(gib).is_integer() else f"{gib:g}"


def fmt_gib(n: int | None) -> float | None:
    return None if n is None else round(n / 2 ** 30, 3)
