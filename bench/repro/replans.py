"""What a row's /safesage/stats says about re-planning (issue 29 point 2).

A row is one ComfyUI server that runs one prompt (one sampling run), so SafeSage's process-wide
counters are that run's: ``replans`` counts the ``planner.choose`` calls after each call
signature's first plan (budget.plan_on_ladder: memory really shrank, or a degraded plan met twice
its memory) and ``replan_us`` the time they stalled the calls that made them. Re-plans without
``replan_us`` (a pack before the plan ladder) read a stall of None, not 0. The soak runs several
prompts on one server: there the numbers after each prompt are cumulative (``per_prompt`` gives
the differences).
"""
from __future__ import annotations


def replan_fields(stats: dict | None) -> dict:
    """``{"replans_per_run": n, "replan_stall_ms": ms}`` from a /safesage/stats snapshot (None for
    both without one). The counters appear only once something was counted: a snapshot without
    them reads 0 re-plans; re-plans without ``replan_us`` (a pack before the ladder) read a
    stall of None."""
    if not isinstance(stats, dict) or "plans" not in stats:
        return {"replans_per_run": None, "replan_stall_ms": None}
    n = int(stats.get("replans") or 0)
    us = stats.get("replan_us")
    if n and us is None:                     # re-planned, but the pack does not time it
        return {"replans_per_run": n, "replan_stall_ms": None}
    return {"replans_per_run": n, "replan_stall_ms": round(int(us or 0) / 1000.0, 3)}


def per_prompt(samples: list[dict]) -> list[dict]:
    """Re-plans and stall of each prompt of a soak, from the cumulative counters recorded after
    each one (``sample["safesage"]["replans"]`` / ``["replan_us"]``)."""
    out, prev_n, prev_us = [], 0, 0
    for s in samples:
        st = s.get("safesage") or {}
        n, us = int(st.get("replans") or 0), int(st.get("replan_us") or 0)
        out.append({"what": s.get("what"), "replans": n - prev_n, "replan_stall_ms": round((us - prev_us) / 1000.0, 3)})
        prev_n, prev_us = n, us
    return out
