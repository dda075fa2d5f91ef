"""No re-plan stalls (issue 29 point 2): a call signature's plan follows free memory on a ladder.

``planner.choose`` costs 16-140 ms on the GPU. Free memory crossing budget buckets must not pay it
again while the signature's plan still fits (budget.plan_on_ladder): a re-plan happens when no
plan the signature already has fits (memory really shrank), or when a degraded plan (SDPA under
pressure, smaller launches) meets REPLAN_GROWTH times the memory it was planned for. Each re-plan
is counted (``replans``) with the time it stalled the call (``replan_us``; a stand-in clock here,
no timing is measured). The same rule per sampling run under ComfyUI's compiler is in
test_compiler.py.
"""
from types import SimpleNamespace

import pytest
import torch

import safe_ops.attention.plans as plans
from safe_ops.facts import budget as B
from safe_ops.ui import run_stats as report

from test_attention import ComfyFunc, h3_like, make_attn, raw, reference
from test_compiler import prefetch  # noqa: F401 - a fixture
from test_quality_budget import speeds  # noqa: F401 - a fixture
from test_quality_guard import extra_families  # noqa: F401 - a fixture


@pytest.fixture(autouse=True)
def _clean():
    report.reset()
    yield
    report.reset()


@pytest.fixture
def chooses(monkeypatch):
    """Every planner.choose the override makes (a test clears it after the first plan), and a
    clock that says each took 5 ms."""
    calls = []
    real = plans.choose
    clock = {"t": 0.0}

    def counted(call, envelopes, budget_bytes=None, tflops=None):
        calls.append(budget_bytes)
        clock["t"] += 0.005
        return real(call, envelopes, budget_bytes, tflops)
    monkeypatch.setattr(plans, "choose", counted)
    monkeypatch.setattr(plans.time, "perf_counter", lambda: clock["t"])
    return calls


def _run(att, kern, q, k, v, budgets, budget_now, comfy=raw):
    """One call per budget; the launches each made."""
    launches = []
    for b in budgets:
        budget_now["b"] = b
        kern.launches.clear()
        out = att(comfy, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
        torch.testing.assert_close(out.double(), reference(q, k, v), rtol=1e-5, atol=1e-5)
        launches.append(len(kern.launches))
    return launches


def test_budget_crossing_buckets_while_the_plan_fits_costs_no_replan(chooses):
    att, kern = make_attn()
    q, k, v = h3_like(700)
    now = {"b": 10**12}
    att._budget = lambda dev: now["b"]
    first = _run(att, kern, q, k, v, [10**12], now)[0]
    assert chooses == [10**12]                      # the signature's first plan
    chooses.clear()
    (p,) = att._prepared.values()
    peak = p.plan.peak_bytes
    # free memory moves across many buckets, down to exactly the plan's peak and up again
    moving = [B.budget_bucket(int(peak * f)) for f in (40, 9, 3, 1.3, 7, 1.6, 300, 2)] + [peak]
    assert all(b >= peak for b in moving) and len(set(moving)) == len(moving)
    assert _run(att, kern, q, k, v, moving, now) == [first] * len(moving)
    assert chooses == [] and report.value("replans") == 0 and report.value("replan_us") == 0
    # memory really shrank: the plan no longer fits -> one re-plan (smaller launches), counted
    tight = _run(att, kern, q, k, v, [peak - 1], now)[0]
    assert tight > first and chooses == [peak - 1]
    assert report.value("replans") == 1 and report.value("replan_us") == 5000
    # oscillating around it afterwards: both plans are on the ladder, nothing planned again
    assert _run(att, kern, q, k, v, [peak - 1, 10**12, peak - 1, peak, peak * 3], now) == \
        [tight, first, tight, first, first]
    assert report.value("replans") == 1 and len(chooses) == 1


def test_a_degraded_plan_is_planned_again_only_for_twice_the_memory(chooses):
    att, kern = make_attn()
    q, k, v = h3_like(700)
    unlimited, _ = make_attn()
    unlimited._budget = lambda dev: 10**12
    unlimited(raw, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    best_peak = next(iter(unlimited._prepared.values())).plan.peak_bytes
    chooses.clear()
    now = {"b": best_peak - 1}                       # the signature is first seen under pressure
    att._budget = lambda dev: now["b"]
    small = _run(att, kern, q, k, v, [best_peak - 1], now)[0]
    chooses.clear()
    (p,) = att._prepared.values()
    assert B.degraded(p.plan) and p.plan.peak_bytes < best_peak
    # more memory, but less than twice what it was planned under: kept
    grown = [best_peak, int(1.5 * best_peak), int(1.99 * (best_peak - 1))]
    assert _run(att, kern, q, k, v, grown, now) == [small] * 3 and chooses == []
    # twice: planned once more, the better plan from then on
    big = _run(att, kern, q, k, v, [2 * (best_peak - 1)], now)[0]
    assert big < small and chooses == [2 * (best_peak - 1)] and report.value("replans") == 1
    top = 2 * (best_peak - 1)
    assert _run(att, kern, q, k, v, [best_peak, 3 * best_peak, 2 * top - 1, best_peak - 1], now) == \
        [big, big, big, small] and len(chooses) == 1
    # the toy envelope needs two head groups whatever the memory: the next doubling plans once
    # more (the same plan), and then only the doubling after that -- a bounded cost, not per bucket
    assert _run(att, kern, q, k, v, [2 * top, 3 * top, 4 * top - 1], now) == [big] * 3
    assert chooses[1:] == [2 * top] and report.value("replans") == 2


def test_a_plan_of_one_launch_is_kept_however_much_memory_comes(chooses):
    for S in (100, 300):                              # direct; repack (the toy envelope's copies)
        att, kern = make_attn()
        q, k, v = h3_like(S)
        now = {"b": 0}
        att._budget = lambda dev: now["b"]
        plan_budget = 400_000
        first = _run(att, kern, q, k, v, [plan_budget], now)[0]
        assert next(iter(att._prepared.values())).plan.launches == 1
        chooses.clear()
        assert _run(att, kern, q, k, v, [plan_budget * f for f in (2, 9, 100, 10**6)], now) == [first] * 4
        assert chooses == [] and report.value("replans") == 0


def test_sdpa_under_pressure_becomes_the_kernel_when_memory_comes_back(chooses):
    att, kern = make_attn()
    q, k, v = h3_like(700)
    now = {"b": 0}
    att._budget = lambda dev: now["b"]
    comfy = ComfyFunc()
    assert _run(att, kern, q, k, v, [0, 0], now, comfy) == [0, 0] and len(comfy.calls) == 2
    assert B.degraded(next(iter(att._prepared.values())).plan)
    assert _run(att, kern, q, k, v, [10**12], now, comfy)[0] > 0 and len(comfy.calls) == 2
    assert report.value("replans") == 1


def _plan(peak, launches=1, kind="head_groups", reasons=()):
    return SimpleNamespace(peak_bytes=peak, launches=launches, kind=kind, reasons=reasons)


def test_plan_on_ladder_rule():
    direct, groups = _plan(500), _plan(100, launches=4)
    assert B.plan_on_ladder({1000: direct}, 1000) is direct
    assert B.plan_on_ladder({1000: direct}, 600) is direct          # fits a smaller budget
    assert B.plan_on_ladder({1000: direct}, 499) is None            # does not: re-plan
    assert B.plan_on_ladder({1000: direct}, 10**9) is direct        # one launch: nothing better
    ladder = {1000: direct, 300: groups}
    assert B.plan_on_ladder(ladder, 499) is groups and B.plan_on_ladder(ladder, 700) is direct
    assert B.plan_on_ladder({300: groups}, 599) is groups           # degraded, under 2x: kept
    assert B.plan_on_ladder({300: groups}, 600) is None             # degraded, 2x: planned again
    assert B.plan_on_ladder(ladder, 10**9) is direct, "the best known plan fits: not degraded"
    pressure = _plan(0, kind="sdpa", reasons=("k: no plan within the 0 MiB memory budget (copies): x",))
    rule = _plan(0, kind="sdpa", reasons=("k: head_dim 80 not in (64, 128)",))
    assert B.degraded(pressure) and not B.degraded(rule) and not B.degraded(_plan(1, kind="direct"))
    assert B.plan_on_ladder({0: pressure}, 1) is None and B.plan_on_ladder({0: rule}, 10**9) is rule


# ---------------------------------------------------------------- the quality guard's plans (issue 45 item 3)
def _guarded_run(att, data, budgets, steps, per_step):
    """A sampling run of ``steps`` steps over the 8 blocks of test_quality_guard, the budget moving
    with every attention call (``budgets``: a callable giving the next); ``per_step`` gets the number
    of planner.choose calls each step made (appended)."""
    from test_quality_guard import end_run, forward, schedule
    sched = schedule(steps)
    for s in range(1, steps + 1):
        before = len(per_step[0])
        forward(att, data, sched, s)
        per_step[1].append(len(per_step[0]) - before)
    end_run()


def test_moved_blocks_and_candidates_take_their_plans_from_the_ladder(fresh, chooses):
    """2 of 8 blocks move to fake_kitchen at the end of step 1 while free memory cycles over 6 budget
    buckets, every one of which the plans fit: a moved block's family is planned once (at its first
    call) and the step-1 candidates once per signature (not once per block), then never again -- as
    a planned signature's plan (the ladder). Each of those plans after the signature's first is
    counted with its stall; memory that really shrinks re-plans each ladder once, counted; memory
    cycling again costs nothing."""
    from test_quality_guard import OUTLIERS, blocks, make
    fq, data = fresh, blocks()
    att = make(quality="balanced")
    cycle = [B.budget_bucket(int(2**23 * f)) for f in (1, 1.3, 2, 3, 5, 9)]
    assert len(set(cycle)) == 6
    now = {"i": 0, "fixed": None}

    def budget(dev):
        now["i"] += 1
        return now["fixed"] if now["fixed"] is not None else cycle[now["i"] % 6]
    att._budget = budget
    per_step = (chooses, [])
    _guarded_run(att, data, budget, 6, per_step)
    assert {c["block"] for c in stats_blocks() if c["moved"]} == set(OUTLIERS)
    (p,) = att.prepared_plans()
    peak = p.plan.peak_bytes          # fake_sage's direct plan; fake_kitchen's is the same size
    assert p.plan.kind == "direct" and peak < min(cycle)
    # step 1: the signature's plan and the candidate's (one rows call for all 8 blocks); step 2: the moved
    # family's first plan; steps 3-6: nothing, whatever bucket the budget is in
    assert per_step[1] == [2, 1, 0, 0, 0, 0], per_step[1]
    assert report.value("replans") == 2 and report.value("replan_us") == 2 * 5000
    kitchen = fq.LAUNCHES[fq.KITCHEN]
    # memory really shrank below the full calls' plans (not the candidate's 1,024 rows): the signature's
    # ladder and the moved family's re-plan once each (counted), then the cycle is back and costs nothing
    now["fixed"] = peak - 1
    _guarded_run(att, data, budget, 2, per_step)
    assert per_step[1][-2:] == [1, 1], per_step[1]
    assert report.value("replans") == 2 + 2 and report.value("replan_us") == 4 * 5000
    assert fq.LAUNCHES[fq.KITCHEN] - kitchen > 2 * len(OUTLIERS), "the moved blocks' smaller launches"
    now["fixed"] = None
    _guarded_run(att, data, budget, 2, per_step)
    assert per_step[1][-2:] == [0, 0] and report.value("replans") == 4


def stats_blocks():
    return report.snapshot()["quality_last_run"]["choices"]["blocks"]


def test_under_the_compiler_a_moved_block_keeps_its_runs_plan(fresh, chooses, prefetch):
    """ComfyUI's allocation compiler: a moved block's plan, as a planned signature's, holds for the whole
    sampling run (another plan on a later step would allocate differently); the next run plans under
    the budget it finds."""
    from test_quality_guard import OUTLIERS, blocks, make
    fq, data = fresh, blocks()
    att = make(quality="balanced")
    now = {"b": 2**26}
    att._budget = lambda dev: now["b"]
    launches = []

    def step_budgets(budgets):
        from test_quality_guard import end_run, forward, schedule
        sched = schedule(len(budgets))
        for s, b in enumerate(budgets, 1):
            now["b"] = b
            before = fq.LAUNCHES[fq.KITCHEN]
            forward(att, data, sched, s)
            launches.append(fq.LAUNCHES[fq.KITCHEN] - before)
        end_run()
    step_budgets([2**26, 2**26, 2**26])
    (p,) = att.prepared_plans()
    peak = p.plan.peak_bytes          # fake_sage's direct plan; fake_kitchen's is the same size
    chooses.clear()
    step_budgets([2**26, 2**26, peak - 1])        # memory shrinks at step 3: the run keeps its plans
    assert launches[4:6] == [len(OUTLIERS)] * 2 and chooses == [], (launches, chooses)
    step_budgets([peak - 1] * 3)                   # the next run plans for what it finds
    assert launches[7] > len(OUTLIERS) and launches[8] == launches[7] and chooses == [peak - 1] * 2


def test_under_the_compiler_a_moved_blocks_oom_plans_its_run_again(fresh, extra_families, prefetch):
    """A moved block's launch runs out of memory (ComfyUI's own recomputes that call): as for a planned
    signature, the run's next call of the moved family plans under the memory now instead of keeping
    the run's plan that no longer fits."""
    import torch as T
    from test_quality_guard import OUTLIERS, _with_families, blocks, end_run, forward, schedule
    fq, data = fresh, blocks()
    state = {"oom": False}

    def err():
        if state["oom"]:
            state["oom"] = False
            raise T.OutOfMemoryError("CUDA out of memory (test)")
        return 0.003
    att = _with_families(fq, ("fake_kitchen_b", err))
    now = {"b": 2**26}
    att._budget = lambda dev: now["b"]
    sched = schedule(3)
    launches = []
    for s in (1, 2, 3):
        if s == 3:
            (p,) = att.prepared_plans()
            now["b"] = p.plan.peak_bytes - 1            # memory shrank; the run keeps its plans ...
            state["oom"] = True                         # ... until the first moved call runs out of it
        before = fq.LAUNCHES["fake_kitchen_b"]
        forward(att, data, sched, s)
        launches.append(fq.LAUNCHES["fake_kitchen_b"] - before)
    end_run()
    assert launches[1] == len(OUTLIERS), launches                # step 2: one launch per moved block
    assert report.value("oom_fallbacks") == 1
    assert launches[2] > 1 + 1, ("after the OOM the other moved block ran a plan for the memory now", launches)


def test_a_family_the_speed_budget_planned_stays_on_its_signatures_ladder(fresh, speeds, chooses, monkeypatch):
    """kernel=auto, balanced, both families priced as on a measured GPU: the speed budget plans fake_kitchen
    (less error, 1.02x fake_sage's time) for the signature from step 1. Memory that really shrinks re-plans
    on the signature's ladder -- fake_kitchen's smaller plan, counted, not the policy's faster fake_sage (the
    budget's choice lost at the first re-plan) -- and memory back where it was costs nothing."""
    from test_quality_budget import make, sample
    from test_quality_guard import blocks
    fq = fresh
    monkeypatch.setattr(plans, "pricing_tflops", lambda *a: {fq.SAGE: 100.0, fq.KITCHEN: 98.0})
    att = make()
    now = {"b": 2**26}
    att._budget = lambda dev: now["b"]
    sample(att, blocks(), 2)
    (p,) = att.prepared_plans()
    assert p.plan.kernel == fq.KITCHEN and p.policy_plan.kernel == fq.SAGE, (p.plan, p.policy_plan)
    replans = report.value("replans")
    now["b"] = p.plan.peak_bytes - 1
    tight = att.plan_now(p)
    assert tight.kernel == fq.KITCHEN and tight.peak_bytes < p.plan.peak_bytes, tight
    assert report.value("replans") == replans + 1
    now["b"] = 2**26
    assert att.plan_now(p) is p.plan and report.value("replans") == replans + 1

