"""The ``optimized_attention_override`` callable: normalise → plan → run → fence → verify → count.

ComfyUI calls ``transformer_options["optimized_attention_override"](func, q, k, v,
heads, mask=None, attn_precision=None, skip_reshape=False,
skip_output_reshape=False, **kwargs)`` for every attention call (``wrap_attn``
in ``comfy/ldm/modules/attention.py``); ``func`` is the attention function
ComfyUI would have run. :class:`SafeAttention` replaces that call with one
whose every launch is inside the envelope of the kernel that executes it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import report
from .budget import BudgetReader
from .comfy_call import Normalised, UnsupportedCall, _desc, _dtype_name, normalise
from .envelope import AttnCall
from .executor import Executor, is_cuda_error, is_oom
from .fences import GLOBAL_FENCES, FenceBook
from .kernels import SDPA_KERNEL, Kernel, installed_kernels
from .planner import Plan, choose, sdpa_plan
from .policy import Policy
from .probe import Verifier, class_key, compare
from .runtime import Runtime, auto_order, comfy_attention_choice, pricing_tflops, runtime

log = logging.getLogger("SafeSage")


@dataclass
class _Prepared:
    """Everything per call signature that the hot path needs, computed once."""
    plan: Plan                        # chosen under the budget read when the signature was new
    call: AttnCall
    shape_key: str
    count_key: str
    envelopes: list                   # the candidate kernels' envelopes, in preference order
    by_budget: dict                   # budget bucket -> plan chosen under it (see _within_budget)
    class_keys: dict                  # kernel family -> verifier class key of this call
    tflops: dict | None = None        # auto on a measured GPU: TFLOP/s that price the plans



class SafeAttention:
    """Callable installed as ``transformer_options["optimized_attention_override"]``."""

    def __init__(self, policy: Policy = Policy(), kernels: list[Kernel] | None = None,
                 fences: FenceBook = GLOBAL_FENCES, verifier: Verifier | None = None,
                 rt: Runtime | None = None):
        self.policy = policy
        self.rt = rt or runtime()
        self.fences = fences
        self.verifier = verifier or Verifier(policy.verify)
        if kernels is None:
            kernels = installed_kernels(self.rt)
        self.kernels: dict[str, Kernel] = {kk.family: kk for kk in kernels}
        self.kernels.setdefault("sdpa", SDPA_KERNEL)
        self._prepared: dict[tuple, _Prepared] = {}
        self.broken: dict[str, str] = {}     # family -> why it is not used again in this process
        self._budget_reader = BudgetReader()
        self.executor = Executor(self.kernels, fences, policy.debug_sync)

    def __deepcopy__(self, memo):
        # Clones of a patched model share one override (its caches and fences are
        # process-wide anyway); other packs deepcopy model_options freely.
        return self

    # ---------------------------------------------------------------- choice
    def candidates(self, func: Callable | None, comfy_wants_sage: bool | None = None) -> list[str]:
        """Kernel families in preference order for this policy (sdpa always last resort).

        ``comfy_wants_sage``: whether ComfyUI itself runs SageAttention; by default read from
        the name of the attention function ComfyUI handed to the override (sage, comfy-kitchen
        or neither), or from ComfyUI's flags when ``func`` is None (runtime.comfy_attention_choice).
        """
        sage = [f for f in self.kernels if f != "sdpa"]
        if self.policy.kernel == "sdpa":
            return ["sdpa"]
        if self.policy.kernel == "sage":
            return sage + ["sdpa"]
        # Measured GPU: by measurement; unmeasured: what ComfyUI was configured to run.
        if comfy_wants_sage is not None:
            choice = "sage" if comfy_wants_sage else None
        else:
            # ComfyUI's function names it; without one, ComfyUI's flags do (if it is loaded)
            choice = comfy_attention_choice(getattr(func, "__name__", "") if func is not None else None)
        return auto_order(self.rt.arch_name, sage, choice)[0]

    def _budget(self, device: torch.device) -> int | None:
        """Bytes a plan may use now (copies, merge state, kernel temporaries), or None (no limit):
        the policy's fixed number, else budget.BudgetReader's bucketed share of free memory."""
        if self.policy.max_extra_bytes is not None:
            return self.policy.max_extra_bytes
        return self._budget_reader(device)

    def _within_budget(self, p: "_Prepared", device: torch.device) -> Plan:
        """The plan for this signature under the budget *now*: when free memory has moved to
        another bucket since the signature was planned, the same choice is made again for the
        new budget (cached per bucket), in either direction -- a sage plan that no longer fits
        becomes smaller launches or SDPA, an SDPA plan chosen under pressure becomes sage again.
        A fixed budget (the policy's) never moves."""
        if self.policy.max_extra_bytes is not None or not p.envelopes:
            return p.plan
        budget = self._budget(device)            # None off CUDA: no budget, nothing to re-check
        if budget is None:
            return p.plan
        new = p.by_budget.get(budget)
        if new is None:
            new = p.by_budget[budget] = choose(p.call, p.envelopes, budget, p.tflops)
            if new != p.plan:
                report.count("replans")
                report.once(("replan", p.plan, budget), logging.INFO,
                            "SafeSage: memory budget now %.0f MiB: %s instead of %s", budget / 2**20,
                            new.describe(False), p.plan.describe(False))
        return new

    # --------------------------------------------------------------- calling
    def __call__(self, func: Callable, *args: Any, **kwargs: Any) -> Any:
        report.count("attention_calls")
        try:
            n = normalise(args, kwargs)
        except UnsupportedCall as e:
            report.fallback(f"unsupported call passed to ComfyUI's {getattr(func, '__name__', 'attention')}: {e}")
            return func(*args, **kwargs)
        return n.finish(self.attend(n, func))

    def attend(self, n: Normalised, func: Callable | None = None) -> torch.Tensor:
        """Plan (cached per call signature), run, and verify the first call of each class."""
        q, k, v = n.q, n.k, n.v
        if q.shape[2] == 0:
            report.count("plan:empty")
            return q.new_empty(q.shape)
        key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device,
               n.caller_layout, n.mask is None, getattr(func, "__name__", ""), n.low_precision_ok)
        p = self._prepared.get(key)
        if p is None:
            p = self._prepared[key] = self._prepare(n, func)
        plan = self._within_budget(p, q.device)
        report.STATS[p.count_key if plan is p.plan else f"plan:{plan.kind}"] += 1
        if plan.kind == "sdpa" and plan.reasons:       # SDPA because no sage plan could run it
            report.fallback("; ".join(plan.reasons), p.shape_key)
        try:
            out = self.executor.run(plan, n)
        except Exception as e:
            if plan.kernel == "sdpa" or is_cuda_error(e):
                raise          # sticky and asynchronous: nothing can be recomputed after it
            if is_oom(e):
                # not the kernel's fault: this call only goes to SDPA (no large temporaries)
                log.warning("SafeSage: %s ran out of memory: %s", plan.kernel, e)
                return self._fall_back(p, plan, n, f"{plan.kernel} ran out of memory (plan: "
                                       f"{plan.describe(False)})", scope="call")
            # A sage build that imports but raises when called (a missing sm90 extension, a
            # build for another GPU) has launched nothing: recompute with SDPA, drop the family.
            return self._fall_back(p, plan, n, f"{plan.kernel} raised {type(e).__name__}: {e}", scope="family")
        if plan.kernel != "sdpa":
            ck = p.class_keys.get(plan.kernel)
            if ck is None:
                ck = p.class_keys[plan.kernel] = self._class_key(plan.kernel, p.call)
            if self.verifier.needs_probe(ck):
                out = self._verify(p, plan, ck, n, out)
        return out

    def _prepare(self, n: Normalised, func: Callable | None) -> "_Prepared":
        """The slow path, once per call signature: describe the call, choose the plan."""
        q, k, v = n.q, n.k, n.v
        call = AttnCall(_desc(q), _desc(k), _desc(v), _dtype_name(q.dtype), n.caller_layout,
                        n.mask is not None, q.device.type, self.rt.arch_name, q.element_size())
        cand = [f for f in self.candidates(func) if f in self.kernels] if n.low_precision_ok else ["sdpa"]
        # families that failed verification for this class of call are not candidates
        cand = [f for f in cand if f == "sdpa" or not (f in self.broken or
                                                       self.verifier.known_bad(self._class_key(f, call)))]
        envelopes = [self.kernels[f].envelope for f in cand]
        budget = self._budget(q.device)
        # auto on a measured GPU prices the plans (kv_chunks' LSE kernel, copies) against SDPA
        tflops = pricing_tflops(self.policy.kernel, self.rt.arch_name)
        plan = choose(call, envelopes, budget, tflops)
        shape_key = f"{call.dtype} q{tuple(q.shape)} k{tuple(k.shape)} {call.layout}"
        report.remember_plan(shape_key, plan.describe())
        # only sage candidates can change with the budget (SDPA chosen first needs none)
        envelopes = envelopes if envelopes and envelopes[0].family != "sdpa" else []
        return _Prepared(plan, call, shape_key, f"plan:{plan.kind}", envelopes,
                         {} if budget is None else {budget: plan}, {}, tflops)

    @staticmethod
    def _class_key(family: str, call: AttnCall) -> tuple:
        """Verdicts are per class of *call* (the caller's layout), whatever plan ran it."""
        return class_key(family, call.dtype, call.head_dim, call.layout, call.heads, call.kv_heads,
                         call.q_len, call.kv_len)

    def _verify(self, p: "_Prepared", plan: Plan, ck: tuple, n: Normalised, out: torch.Tensor) -> torch.Tensor:
        verdict = compare(out, n.q, n.k, n.v, n.scale, self.kernels[plan.kernel].tolerance)
        self.verifier.record(ck, verdict)
        report.count("probes")
        if verdict.ok:
            return out
        report.count("probe_failures")
        return self._fall_back(p, plan, n, f"{plan.kernel} failed verification ({verdict.detail})")

    def _fall_back(self, p: "_Prepared", plan: Plan, n: Normalised, why: str, scope: str = "class") -> torch.Tensor:
        """Recompute this call with SDPA. ``scope``: "class" (failed probe: the verifier keeps the
        family off this class of call), "family" (raised at call time: off every call in this
        process), "call" (out of memory: this call only)."""
        fam = plan.kernel
        if scope == "family":
            self.broken[fam] = why
            report.count("kernel_errors")
        if scope == "call":
            report.count("oom_fallbacks")
            report.once(("kernel-oom", fam, p.shape_key), logging.WARNING,
                        "SafeSage: %s for %s; this call is recomputed with PyTorch SDPA.", why, p.shape_key)
        else:
            report.once(("kernel-failed", fam, p.class_keys.get(fam)), logging.ERROR,
                        "SafeSage: %s for %s; recomputing with PyTorch SDPA and not using %s again for "
                        "%s in this process.", why, p.shape_key, fam,
                        "any call" if scope == "family" else "this class of call")
            self._prepared.clear()
        report.fallback(why, p.shape_key)
        return self.executor.run(sdpa_plan(p.call, (why,)), n)

