"""What a guarded call's failure does (a mixin of override.SafeAttention): the run stage's failed launch,
and the verify stage's first-call check of a class of call with what its failure does. Every failure is a
fallback -- counted, said once, in the report -- and ComfyUI's own attention recomputes the call; its
scope says what else: ``"call"`` (out of memory, any other error of one launch: this call only),
``"class"`` (a failed check: the verifier keeps the family off this class of call), ``"family"`` (a build
that cannot run here: off every call on this GPU arch and build in this process). A CUDA error is raised:
sticky and asynchronous, nothing can be recomputed after it (HAZARDS H-1, H-2).
"""
from __future__ import annotations

import logging

import torch

from ..facts import compiler
from ..ui import run_stats
from .call_forms import Normalised
from .errors import is_build_error, is_cuda_error, is_oom
from .planner import Plan
from .plans import Prepared
from .verification import compare

log = logging.getLogger("SafeSage")


class Fallbacks:
    """SafeAttention's failed launches and first-call checks (see the module docstring)."""

    def _run_failed(self, p: Prepared, plan: Plan, e: Exception) -> None:
        """The plan's launch raised ``e``: a CUDA error is raised again (sticky and asynchronous: nothing
        can be recomputed after it); any other failure is a fallback (:meth:`_fall_back`), and ComfyUI's
        own attention recomputes the call (None)."""
        if is_cuda_error(e):
            raise e
        if is_oom(e):
            # not the kernel's fault: this call only goes to ComfyUI's (no large temporaries)
            log.warning("SafeSage: %s ran out of memory: %s", plan.kernel, e)
            return self._fall_back(p, plan, f"{plan.kernel} ran out of memory (plan: "
                                   f"{plan.describe(False)})", scope="call")
        # A sage build that imports but cannot run here (a missing sm90 extension, a build
        # for another GPU) has launched nothing: recompute, drop the family. Anything else
        # drops nothing beyond this call: one odd call never disables a kernel.
        return self._fall_back(p, plan, f"{plan.kernel} raised {type(e).__name__}: {e}",
                               scope="family" if is_build_error(e) else "call")

    def _verify(self, p: Prepared, plan: Plan, ck: tuple, n: Normalised, out: torch.Tensor,
                layout: str) -> torch.Tensor | None:
        """The first-call check of ``plan``'s family on this class of call (key ``ck``), on the call's
        own output: ``out`` when it passes (or no memory to check it now), else None (a fallback)."""
        # under ComfyUI's compiler: a first-step-only allocation would be a graph break on step 2
        try:
            with compiler.paused():
                verdict = compare(n.to_hnd(out, layout), n.q, n.k, n.v, n.scale,
                                  self.kernels[plan.kernel].tolerance)
        except Exception as e:
            if not is_oom(e):
                raise
            # the check itself found no memory: inconclusive, not a failed prompt; probed again later
            run_stats.count("probes_inconclusive")
            run_stats.once(("probe-oom", plan.kernel, p.shape_key), logging.WARNING,
                        "SafeSage: no memory to check %s on %s now; its output is used and the check runs "
                        "again at the next call of this kind", plan.kernel, p.shape_key)
            return out
        self.verifier.record(ck, verdict)
        run_stats.count("probes")
        if verdict.ok:
            return out
        run_stats.count("probe_failures")
        return self._fall_back(p, plan, f"{plan.kernel} failed verification ({verdict.detail})")

    def _fall_back(self, p: Prepared, plan: Plan, why: str, scope: str = "class") -> None:
        """This call goes to ComfyUI's own attention (returns None for the caller to run it).
        ``scope``: "class" (failed probe: the verifier keeps the family off this class of call),
        "family" (its build cannot run here: off every call in this process), "call" (out of
        memory, or any other error of one call: this call only)."""
        fam = plan.kernel
        if scope == "family":
            run_stats.disabled(fam, why, self._sites[fam])
            run_stats.count("kernel_errors")
        elif scope == "class":
            run_stats.failed_check(f"{fam} on {self.rt.arch_name} {p.shape_key}", why)
        if scope == "call":
            self._forget_run(p)          # under the compiler: this run chooses again at the next call
            run_stats.count("oom_fallbacks" if "out of memory" in why else "call_fallbacks")
            run_stats.once(("kernel-call", fam, p.shape_key, why[:80]), logging.WARNING,
                        "SafeSage: %s for %s; this call is recomputed with ComfyUI's own attention.", why,
                        p.shape_key)
        else:
            run_stats.once(("kernel-failed", fam, p.class_keys.get(fam)), logging.ERROR,
                        "SafeSage: %s for %s; recomputing with ComfyUI's own attention and not using %s again for "
                        "%s in this process.", why, p.shape_key, f"{fam} on {self._sites[fam]}",
                        "any call" if scope == "family" else "this class of call")
            self._prepared.clear()
        run_stats.fallback(why, p.shape_key)
        return None

