"""The override's choice and its caches: which kernel families a call may use (:meth:`PlanChoice.usable`,
the one rule), the plan prepared once per call signature (:class:`Prepared`), and a call's plan under
the memory budget *now*: one mechanism (:meth:`PlanChoice._within_budget`, a :class:`Ladder` of plans by
budget, and under ComfyUI's allocation compiler one plan per sampling run) for a signature's planned
families, the family the quality guard moved a block to, and a candidate it measures on sampled rows.

A mixin of :class:`~.override.SafeAttention` (which holds ``policy``, ``rt``, ``kernels``, the
verifier and the caches these methods fill); the call flow itself is in override.py.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..facts import compiler
from ..facts.budget import plan_on_ladder
from ..families.envelope import AttnCall
from ..families.registry import family_kind
from ..ui import run_stats
from .call_forms import Normalised, describe_tensor, dtype_name
from .comfy_functions import unguarded_kind
from .errors import is_cuda_error, is_oom
from .kernel_choice import comfy_attention_choice, policy_order, pricing_tflops
from .move_order import move_order, planning_families
from .planner import Plan, choose
from .verification import class_key

RUNS_KEPT = 4      # per call signature: the plans of this many sampling runs (threads) at once
_NONE = object()   # by_family: this family cannot run the signature (kept, so it is not asked per call)


@dataclass
class Ladder:
    """One call's plans under the memory budget (:meth:`PlanChoice._within_budget`): the plan chosen
    first, the plans by the budget each was chosen under (budget.plan_on_ladder), the plan kept per
    sampling run under ComfyUI's compiler. A signature's (:class:`Prepared`), a moved block's family's
    and a measured candidate's (``Prepared.by_family``)."""
    plan: Plan                        # chosen under the budget read when the ladder was made
    call: AttnCall
    envelopes: list                   # the kernels' envelopes, in preference order ([]: the plan never moves)
    by_budget: dict                   # budget bucket -> plan chosen under it (see _within_budget)
    device: Any = None                # the calls' device (part of the signature): read once, not per call
    tflops: dict | None = None        # auto on a measured GPU: TFLOP/s that price the plans (None: the speed budget
                                      # planned its family, re-planned first; moved families, candidates)
    run: dict = field(default_factory=dict)  # under ComfyUI's compiler: run id -> plan kept for that run
    fixed: bool = False               # the plan never moves with the budget (a fixed budget, none off CUDA, SDPA first)


@dataclass(kw_only=True)
class Prepared(Ladder):
    """Everything per call signature that the hot path needs, computed once: its ladder and more."""
    shape_key: str
    count_key: str
    class_keys: dict                  # kernel family -> verifier class key of this call
    previous_viol: list | None = None  # the chained override's kernel's violations by this call
    klass: str = ""                  # the class of call the quality guard keys its choices by
    by_family: dict = field(default_factory=dict)  # quality guard: family (moved) or ("rows", family, r) -> Ladder
    func: Any = None                  # ComfyUI's function the signature was planned for (its id is in the key)
    form: Any = None                  # call_forms.CallForm: how the next call of the signature is read
    cuda: bool = False                # a CUDA call (asked whether it is being captured)
    checked: set = field(default_factory=set)  # families whose class of this call has a verdict (not asked again)
    never_guarded: bool = False       # no guarded kernel takes this signature under any budget
    fallback_reason: str = ""         # why not, when a guarded kernel was a candidate (counted per call)
    policy_plan: Plan | None = None   # the kernel policy's own plan where the speed budget planned another family
    costs: dict | None = None         # family -> predicted time vs policy_plan (speed_budget.BudgetChoice.speed_costs)


class PlanChoice:
    """SafeAttention's choice of kernel and plan per call signature, and the caches behind it."""

    def candidates(self, func: Callable | None, comfy_wants_sage: bool | None = None) -> list[str]:
        """Kernel families in preference order for this policy (sdpa -- ComfyUI's own -- last).

        ``comfy_wants_sage``: whether ComfyUI itself runs SageAttention; by default what would run
        without SafeSage: the override SafeSage chained, else the attention function ComfyUI
        handed to the override (sage, comfy-kitchen or neither), else ComfyUI's flags when
        ``func`` is None (kernel_choice.comfy_attention_choice).
        """
        sage = self.planning_families()
        if self.policy.kernel == "sdpa":
            return ["sdpa"]
        if func is not None and id(func) in self._layer_fn_ids:
            # a layer asked ComfyUI for this function: its kernel (guarded) or ComfyUI's own
            kind = unguarded_kind(func)
            return [f for f in sage if family_kind(f) == kind] + ["sdpa"]
        if self.policy.kernel == "sage":
            return policy_order("sage", self.rt.arch_name, sage, None)
        # Measured GPU: by measurement; unmeasured: what ComfyUI was configured to run.
        if comfy_wants_sage is not None:
            choice = "sage" if comfy_wants_sage else None
        elif self.previous is not None:
            choice = self.previous_kind
        elif func is not None:
            choice = unguarded_kind(func)
        else:
            choice = comfy_attention_choice()
        return policy_order("auto", self.rt.arch_name, sage, choice, self.rt.device_name)

    def planning_families(self) -> list[str]:
        """The kernel families a plan may use here, in ``kernel=sage`` order (move_order.planning_families)."""
        return planning_families(self.kernels.values())

    def _budget(self, device: torch.device) -> int | None:
        """Bytes a plan may use now (copies, merge state, kernel temporaries), or None (no limit):
        the policy's fixed number, else budget.BudgetReader's bucketed share of free memory."""
        if self.policy.max_extra_bytes is not None:
            return self.policy.max_extra_bytes
        return self._budget_reader(device)

    def _within_budget(self, p: Ladder) -> Plan:
        """The plan of ``p`` (a signature's, a moved block's family's, a candidate's) under the budget
        *now*. A plan that still fits is kept; free memory crossing budget buckets re-plans only
        where no plan on the ladder fits (memory really shrank), or where a degraded plan (SDPA
        under pressure, smaller launches) meets twice the memory it was planned for
        (budget.plan_on_ladder's rule). A fixed budget (the policy's) never moves. Under ComfyUI's
        allocation compiler the plan chosen at the first call of a sampling run is kept for the
        whole run (another plan on a later step would allocate differently: a graph break). The
        device is the calls' (``p.device``, read once)."""
        if self.policy.max_extra_bytes is not None or not p.envelopes:
            return p.plan
        device = p.device
        if compiler.enabled_now(device):
            run = compiler.run_id()          # the calling thread's run: another thread's keeps its plan
            plan = p.run.get(run)
            if plan is None:
                plan = self._remember(p.run, run, self._by_budget(p, self._budget(device)), RUNS_KEPT)
            return plan
        return self._by_budget(p, self._budget(device))

    def _by_budget(self, p: Ladder, budget: int | None) -> Plan:
        """``p.by_budget`` is the plan ladder (budget -> the plan chosen under it): a plan on it
        when budget.plan_on_ladder finds one, else planned again for the budget now and added."""
        if budget is None:                   # off CUDA: no budget, nothing to re-check
            return p.plan
        held = plan_on_ladder(p.by_budget, budget)
        if held is not None:
            return held
        new = self._replan(p.call, p.envelopes, budget, p.tflops)
        with self._cache_lock:
            p.by_budget[budget] = new
        if new != p.plan:
            run_stats.once(("replan", p.plan, budget), logging.INFO,
                           "SafeSage: memory budget now %.0f MiB: %s instead of %s", budget / 2**20,
                           new.describe(False), p.plan.describe(False))
        return new

    @staticmethod
    def _replan(call: AttnCall, envelopes: list, budget: int | None, tflops: dict | None) -> Plan:
        """``planner.choose`` after a signature's first plan (a rung added to a ladder, a moved block's
        family's or a candidate's first plan): counted (``replans``) with the microseconds it
        stalled the call (``replan_us``)."""
        t0 = time.perf_counter()
        new = choose(call, envelopes, budget, tflops)
        run_stats.count("replans")
        run_stats.count("replan_us", round((time.perf_counter() - t0) * 1e6))
        return new

    def _ladder(self, call: AttnCall, envelope, device: torch.device) -> Ladder:
        """A ladder of one family's plans for ``call`` (a moved block's, a candidate's rows), its first
        plan chosen under the budget now (counted: :meth:`_replan`)."""
        budget = self._budget(device)
        plan = self._replan(call, [envelope], budget, None)
        return Ladder(plan, call, [envelope], {} if budget is None else {budget: plan}, device,
                      fixed=budget is None or self.policy.max_extra_bytes is not None)

    def _forget_run(self, p: "Prepared") -> None:
        """Under the compiler: the calling thread's run chooses its plans for ``p`` again at the next call
        (a launch ran out of memory), the moved blocks' and candidates' too."""
        rid = compiler.run_id()
        with self._cache_lock:
            for lad in [p] + [x for x in p.by_family.values() if x is not _NONE]:
                lad.run.pop(rid, None)

    def _remember(self, cache: dict, key: Any, value: Any, keep: int | None = None) -> Any:
        """``cache[key] = value``, trimmed to the store's bound, under the cache lock (another
        thread may be inserting: a trim iterates the dict)."""
        with self._cache_lock:
            cache[key] = value
            run_stats.trim(cache, keep)
        return value

    def _describe(self, n: Normalised) -> AttnCall:
        q, k, v = n.q, n.k, n.v
        return AttnCall(describe_tensor(q), describe_tensor(k), describe_tensor(v), dtype_name(q.dtype), n.caller_layout,
                        n.mask is not None, q.device.type, self.rt.arch_name, q.element_size())

    def _prepare(self, n: Normalised, func: Callable | None) -> "Prepared":
        """The slow path, once per call signature: describe the call, choose the plan."""
        q = n.q
        call = self._describe(n)
        cand = [f for f in self.candidates(func) if f in self.kernels] if n.low_precision_ok else ["sdpa"]
        # families that failed verification for this class of call are not candidates
        cand = [f for f in cand if self.usable(f, call)]
        envelopes = [self.kernels[f].envelope for f in cand]
        budget = self._budget(q.device)
        # auto on a measured GPU prices the plans (kv_chunks' LSE kernel, copies) against SDPA
        tflops = pricing_tflops(self.policy.kernel, self.rt.arch_name, self.rt.device_name)
        plan = choose(call, envelopes, budget, tflops)
        policy_plan = plan
        # the quality setting's speed budget: the least-error family within it runs from step 1 (speed_budget.py)
        plan, envelopes, costs = self.within_budget_plan(call, plan, envelopes, budget)
        if plan is not policy_plan:
            # the speed budget's family heads the envelopes: its ladder re-plans it first, unpriced (priced,
            # choose would take the policy's faster family at the first re-plan: the budget's choice lost)
            tflops = None
        key = shape_key(call, n)
        run_stats.remember_plan(key, plan.describe())
        # only sage candidates can change with the budget (SDPA chosen first needs none)
        envelopes = envelopes if envelopes and envelopes[0].family != "sdpa" else []
        # one string (its hash is kept): the guard looks (block, class) up on every call of a run with moved blocks
        klass = "|".join(str(x) for x in (self.rt.arch_name,) + class_key(
            "", "", call.dtype, call.head_dim, call.layout, call.heads, call.kv_heads, call.q_len, call.kv_len)[2:])
        # SDPA now, and with no limit on memory too: no budget makes a guarded kernel take it
        never = plan.kind == "sdpa" and (budget is None or not envelopes
                                         or choose(call, envelopes, None, tflops).kind == "sdpa")
        return Prepared(plan, call, envelopes, {} if budget is None else {budget: plan}, q.device, tflops,
                        shape_key=key, count_key=f"plan:{plan.kind}", class_keys={}, klass=klass, func=func,
                        form=n.form, cuda=n.q4.is_cuda, fixed=budget is None or not envelopes or never,
                        never_guarded=never, fallback_reason="; ".join(plan.reasons),
                        policy_plan=policy_plan if plan is not policy_plan else None, costs=costs)

    def _class_key(self, family: str, call: AttnCall) -> tuple:
        """Verdicts are per class of *call* (the caller's layout), whatever plan ran it, on this
        GPU arch with this kernel build."""
        return class_key(family, self._sites[family], call.dtype, call.head_dim, call.layout, call.heads,
                         call.kv_heads, call.q_len, call.kv_len)


    # ------------------------------------------------------------------ what benches and tools read
    def prepared_plans(self) -> list["Prepared"]:
        """The plans kept per call signature (Prepared: plan, call, envelopes, ...), oldest first: the
        public read of the cache the override's hot path looks up (benches, tools)."""
        with self._cache_lock:
            return list(self._prepared.values())

    def plan_now(self, p: "Prepared") -> Plan:
        """The plan a call of ``p``'s signature runs under the memory budget now (the hot path's choice)."""
        return p.plan if p.fixed else self._within_budget(p)

    def prepared_for(self, func: Callable, *args: Any, **kwargs: Any) -> "Prepared | None":
        """The plan kept for the signature of the call ``(func, *args, **kwargs)`` as ComfyUI makes it,
        or None (never called, a signature-less form, or dropped)."""
        from .call_forms import call_arguments, signature
        key = signature(func, call_arguments(args, kwargs), kwargs, self._key_alignment)
        return self._prepared.get(key) if key is not None else None

    # ------------------------------------------------------------------ the quality guard's families
    def quality_order(self, func: Callable | None) -> list[str]:
        """The family this policy plans for ``func``'s calls, then the families a block over its quality
        target may move to, fastest first on this GPU ([] where ComfyUI's own attention is planned):
        move_order.move_order, the one rule the node's status and Preflight word too. A target may be
        a move-only kernel (never a candidate, :meth:`candidates`); ComfyUI's own is the last resort
        after the list (quality/targets.py)."""
        cand = [f for f in self.candidates(func) if f in self.kernels]
        return move_order(cand[0] if cand else None, list(self.kernels), self.rt.arch_name,
                          self.rt.device_name, self.policy.kernel)

    def probe_budget(self, device: torch.device) -> int | None:
        """Bytes the quality guard's measurement may use on ``device`` (the plans' budget)."""
        return self._budget(device)

    def usable(self, family: str, call: AttnCall) -> bool:
        """Whether ``family`` may run ``call``'s class of call here (:meth:`why_unusable` says no reason).
        The one rule for a planned family (:meth:`_prepare`), a block the quality guard moved
        (:meth:`_family_plan`), a candidate it measures (:meth:`run_family_rows`) and a plan run during
        CUDA-graph capture (special_calls)."""
        return not self.why_unusable(family, call)

    def why_unusable(self, family: str, call: AttnCall) -> str:
        """Why ``family`` may not run ``call``'s class of call here, "" where it may: installed, not
        switched off for this GPU arch and build (the kill switch, :attr:`broken`), and without a
        failed first-call check for this class (the verifier's known-bad verdicts). ComfyUI's own is
        always usable."""
        if family == "sdpa":
            return ""
        if family not in self.kernels:
            return "not installed here"
        off = self.broken.get(family)
        if off is not None:
            return f"switched off: {off}"
        bad = self.verifier.known_bad(self._class_key(family, call))
        return f"failed its check on this class of call: {bad.detail}" if bad is not None else ""

    def _family_plan(self, p: "Prepared", family: str) -> Plan | None:
        """The plan of ``family`` alone for this signature (a block the quality guard moved) under the
        budget now, from its own :class:`Ladder` (:meth:`_within_budget`, as the signature's plan);
        None when that family cannot run it -- outside its limits, or not :meth:`usable`. Asked again
        after a failed check or a kill switch: those clear the prepared signatures (``_fall_back``),
        and this signature's family ladders with them."""
        lad = p.by_family.get(family)
        if lad is None:
            ok = self.usable(family, p.call)
            lad = self._remember(p.by_family, family,
                                 self._ladder(p.call, self.kernels[family].envelope, p.device) if ok else _NONE)
        if lad is _NONE:
            return None
        plan = lad.plan if lad.fixed else self._within_budget(lad)
        return None if plan.kind == "sdpa" else plan

    def run_family_rows(self, family: str, n: Normalised, q_rows: torch.Tensor):
        """``family`` on query rows ``q_rows`` [B,H,r,D] against all of the call's keys (the quality
        guard's candidate measurement); None when it cannot run them (outside its limits, or it
        raised: counted)."""
        p = n.prepared
        if not self.usable(family, p.call if p is not None else self._describe(n)):
            return None                   # switched off, or failed its check on this class of call
        rows = n.with_queries(q_rows)
        # the rows call is the signature's with r fresh query rows: one ladder per (family, r)
        key = ("rows", family, q_rows.shape[2])
        lad = p.by_family.get(key) if p is not None else None
        if lad is None:
            lad = self._ladder(self._describe(rows), self.kernels[family].envelope, q_rows.device)
            if p is not None:
                self._remember(p.by_family, key, lad)
        plan = lad.plan if lad.fixed else self._within_budget(lad)
        if plan.kind == "sdpa":
            return None
        try:
            out, layout = self.executor.run(plan, rows)
            return rows.to_hnd(out, layout)
        except Exception as e:  # noqa: BLE001 - a candidate that cannot run is not a candidate
            if is_cuda_error(e) or is_oom(e):
                raise
            run_stats.count("quality_candidate_errors")
            run_stats.once(("quality-candidate", family, type(e).__name__), logging.WARNING,
                           "SafeSage: quality guard candidate %s raised %s: %s (not a candidate for this block)",
                           family, type(e).__name__, e)
            return None


def shape_key(call: AttnCall, n: Normalised) -> str:
    """How a call signature is named in logs and statistics."""
    return f"{call.dtype} q{tuple(n.q.shape)} k{tuple(n.k.shape)} {call.layout}"


