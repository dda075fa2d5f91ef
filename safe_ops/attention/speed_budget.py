"""The quality guard's speed budget: which families may run a call for less error, and at what cost.

``quality`` names a budget (facts/speed_table.SPEED_BUDGETS): the predicted attention time a call may
spend, as a multiple of the time of the family the kernel policy plans for it (``kernel=auto``: the
fastest it knows; the budget applies only there -- ``kernel=sage`` keeps sage, ``faults only`` keeps the
plan). Each family's time for *this* call is priced as ``planner.choose`` prices plans
(``planner.estimated_us``: the kernel's TFLOP/s from the speed table times its plan's kernel variant,
plus the plan's copies and launches), so sm_120's key-chunked sage plan past 150,000 keys costs sage
more than comfy-kitchen's direct one. A family whose speed on this arch is unknown has no cost: it is
never within the budget.

:func:`price` gives every family's cost ratio for a call; :func:`least_error_within` picks, before
step 1, the family with the least error on random H3-shaped inputs (``KernelFamily.benign_error``)
among those within the budget. Step 1 then measures each block (quality/targets.decide).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..facts.speed_table import Speed, speed_budget, speeds
from ..families.envelope import AttnCall
from ..families.registry import family, table_aliases
from .planner import Plan, estimated_us, plan_for


@dataclass(frozen=True)
class Cost:
    """One family's predicted attention time for a call, relative to the planned family's."""
    family: str
    ratio: float | None            # None: no known speed on this arch (never within a budget)
    plan: Plan | None              # its plan for the call (None: it cannot run it within the memory budget)
    speed: Speed | None


def price(call: AttnCall, planned: Plan, kernels: dict, arch_name: str, gpu_name: str | None,
          budget_bytes: int | None) -> dict[str, Cost]:
    """Every installed family's cost for ``call`` relative to ``planned`` (the policy's plan; its own
    ratio 1.0 where its speed is known). A family that cannot plan the call has no entry."""
    table = speeds(arch_name, gpu_name, table_aliases())
    base_speed = table.get(planned.kernel)
    base = estimated_us(call, planned, base_speed.tflops) if base_speed is not None else None
    out: dict[str, Cost] = {planned.kernel: Cost(planned.kernel, 1.0 if base else None, planned, base_speed)}
    for name, kern in kernels.items():
        if name in (planned.kernel, "sdpa"):
            continue
        plan = plan_for(call, kern.envelope, budget_bytes)
        if plan is None:
            continue
        sp = table.get(name)
        ratio = estimated_us(call, plan, sp.tflops) / base if (sp is not None and base) else None
        out[name] = Cost(name, ratio, plan, sp)
    return out


def prior_error(name: str) -> float | None:
    """A family's error on random H3-shaped inputs (``KernelFamily.benign_error``), None when unmeasured."""
    f = family(name)
    return getattr(f, "benign_error", None) if f is not None else None


def within(costs: dict[str, Cost], quality: str) -> list[str]:
    """The families whose cost is known and within ``quality``'s budget, cheapest first."""
    limit = speed_budget(quality)
    ok = [c for c in costs.values() if c.ratio is not None and c.plan is not None and c.ratio <= limit + 1e-9]
    return [c.family for c in sorted(ok, key=lambda c: c.ratio)]


def least_error_within(costs: dict[str, Cost], planned: str, quality: str) -> str:
    """Before step 1: the family within the budget with the least error on random H3-shaped inputs;
    ``planned`` where no other family's cost and error are both known (or none beats it)."""
    best, best_err = planned, prior_error(planned)
    if best_err is None:
        return planned
    for name in within(costs, quality):
        err = prior_error(name)
        if err is not None and err < best_err:
            best, best_err = name, err
    return best


def ratios(costs: dict[str, Cost]) -> dict[str, float | None]:
    """family -> predicted attention time relative to the planned family (None: unknown)."""
    return {name: c.ratio for name, c in costs.items()}


class BudgetChoice:
    """SafeAttention's speed budget (a mixin beside plans.PlanChoice, which holds ``policy``, ``rt``,
    ``kernels``, ``usable``): the family planned for a signature within the budget, before step 1, and
    each signature's prices for the quality guard (``Prepared.costs``)."""

    def speed_budget(self) -> float:
        """The budget the guard decides under: the quality setting's, under ``kernel=auto`` only
        (``kernel=sage`` keeps sage; ``faults only`` measures nothing)."""
        return speed_budget(self.policy.quality) if self.policy.kernel == "auto" else 1.0

    def kernel_sites(self) -> tuple:
        """The kernel builds here (Runtime.kernel_site of every guarded family): what remembered
        errors are keyed on (quality/memory.py)."""
        return tuple(sorted(set(v for f, v in self._sites.items() if f != "sdpa")))

    def speed_costs(self, p) -> dict:
        """family -> predicted attention time for ``p``'s calls relative to the policy's planned family
        (None: unknown), priced once per signature; {} outside ``kernel=auto`` or where ComfyUI's own
        attention is planned."""
        if p.costs is None:
            planned = p.policy_plan or p.plan
            p.costs = {} if self.speed_budget() <= 1.0 or planned.kind == "sdpa" else ratios(
                self._prices(p.call, planned, self._budget(p.device)))
        return p.costs

    def speed_sources(self) -> dict[str, str]:
        """family -> where its speed on this arch comes from (the speed table's provenance), for the run's
        report (quality/report.py); read once per override."""
        src = getattr(self, "_speed_sources", None)
        if src is None:
            table = speeds(self.rt.arch_name, self.rt.device_name, table_aliases())
            src = self._speed_sources = {f: s.provenance() for f, s in table.items()}
        return src

    def _prices(self, call: AttnCall, planned: Plan, budget_bytes: int | None) -> dict:
        ok = {f: k for f, k in self.kernels.items() if f == planned.kernel or self.usable(f, call)}
        return price(call, planned, ok, self.rt.arch_name, self.rt.device_name, budget_bytes)

    def within_budget_plan(self, call: AttnCall, plan: Plan, envelopes: list, budget_bytes: int | None) -> tuple:
        """Before step 1: ``plan`` (the policy's, for a new signature) or the plan of the family with the
        least error on random H3-shaped inputs within the speed budget (:func:`least_error_within`), and
        ``envelopes`` with that family first (re-plans under another memory budget start from it), and
        the prices (None where no budget applies)."""
        if self.speed_budget() <= 1.0 or plan.kind == "sdpa":
            return plan, envelopes, None
        costs = self._prices(call, plan, budget_bytes)
        pick = least_error_within(costs, plan.kernel, self.policy.quality)
        if pick == plan.kernel or costs[pick].plan is None:
            return plan, envelopes, ratios(costs)
        env = self.kernels[pick].envelope
        return costs[pick].plan, [env] + [e for e in envelopes if e.family != pick], ratios(costs)


def budget_line(quality: str, kernel_policy: str, arch_name: str, gpu_name: str | None, installed: list[str],
                planned: str | None = None) -> str:
    """One line for the node's status and Preflight: the quality setting's speed budget and what it can
    buy here (``planned``: the family the kernel policy plans), with the speed table's provenance."""
    if quality == "faults only":
        return "speed budget: none (faults only: the kernel policy's choice runs, nothing measured)"
    if kernel_policy != "auto":
        return (f"speed budget: none under kernel '{kernel_policy}' (the policy's kernel runs; a block over its "
                "target still moves)")
    limit = speed_budget(quality)
    table = speeds(arch_name, gpu_name, table_aliases())
    known = [table[f] for f in installed if f in table]
    head = f"speed budget {limit:.2f}x the fastest kernel's predicted attention time ({quality})"
    if planned is not None and planned != "sdpa" and planned not in table:
        return head + f": {planned}'s speed on {arch_name} is unknown, so the budget changes nothing here " \
            "(a block over its target still moves)"
    if len(known) < 2:
        return (head + f": no two installed kernels have a known speed on {arch_name}, so the budget changes "
                "nothing here (a block over its target still moves)")
    return head + "; speeds: " + "; ".join(
        f"{s.family} {s.tflops:g} TFLOP/s ({s.kind} on {s.gpu}, {s.version})" for s in known)
