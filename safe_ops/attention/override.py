"""The ``optimized_attention_override`` callable: special calls first, then find the plan → the quality
guard chooses → run → verify once per class → record (:meth:`SafeAttention.attend_prepared`, the call's
story; what a failure in it does: fallbacks.py).

ComfyUI calls ``transformer_options["optimized_attention_override"](func, q, k, v,
heads, mask=None, attn_precision=None, skip_reshape=False,
skip_output_reshape=False, **kwargs)`` for every attention call (``wrap_attn``
in ``comfy/ldm/modules/attention.py``); ``func`` is the attention function
ComfyUI would have run. :class:`SafeAttention` gives a call to a guarded kernel (sage or
comfy-kitchen, every launch inside the envelope of the kernel that executes it, executor.py)
when its plan says so; every other call -- SDPA plans, masks, calls it cannot read, fallbacks
after a failure -- runs exactly what ComfyUI would have run, with the caller's arguments:
the override that was on the model before SafeSage (``previous``, chained), else ``func`` --
except that an unguarded sage / comfy-kitchen function is replaced by ComfyUI's own
``attention_pytorch`` (comfy_functions.comfy_function).
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import torch

from .. import contain
from ..ui import run_stats
from .fallbacks import Fallbacks
from .handoff import ComfyCalls
from .speed_budget import BudgetChoice
from .plans import PlanChoice, Prepared
from .special_calls import INSIDE, INSIDE_KW, ContextCalls, capturing, torch_is_compiling, unwrap_attn
from ..facts.budget import BudgetReader
from .call_forms import Normalised, UnsupportedCall, base_alignment, call_arguments, read_form, signature
from .comfy_functions import function_name, unguarded_kind
from .executor import Executor
from ..families.family import Kernel
from ..families.sdpa import SDPA_KERNEL
from ..families.registry import installed_kernels
from .planner import Plan
from ..policy import Policy
from .verification import Verifier
from ..facts.devices import Runtime, runtime
from ..quality import guard as quality_guard
from ..quality.guard import QualityGuard

log = logging.getLogger("SafeSage")

#: the quality guard's modes that choose a call's plan (the report step runs the choices too), and those
#: that measure its output
_CHOOSING = (quality_guard.CHOSEN, quality_guard.EXACT, quality_guard.REPORT)
_MEASURED = (quality_guard.PROBE, quality_guard.REPORT)
#: the quality guard's counters the record stage counts (run_stats.record_call's ``also``)
_MOVED, _EXACT = quality_guard.STATS.key("moved_calls"), quality_guard.STATS.key("exact_calls")


def _fallback_reason(p: Prepared, plan: Plan) -> str:
    """The fallback an SDPA plan is: its reasons (no guarded kernel could run the call), "" when it has none."""
    if not plan.reasons:
        return ""
    return p.fallback_reason if plan is p.plan else "; ".join(plan.reasons)


#: what SafeAttention._call returns for a call it hands on unread (previous None): __call__ runs
#: what ComfyUI runs for it outside the containment handler (ComfyUI's errors pass untouched)
HAND_ON = object()


class SafeAttention(PlanChoice, BudgetChoice, ContextCalls, ComfyCalls, Fallbacks):
    """Callable installed as ``transformer_options["optimized_attention_override"]``.

    ``previous``: an override that was already on the model (another pack's, core's
    ``ModelAttentionBackend``); it runs, in place of ComfyUI's ``func``, every call SafeSage does
    not give to a guarded kernel -- unless it would run an unguarded sage / comfy-kitchen kernel
    on a call outside that kernel's limits, where SafeSage runs ComfyUI's ``attention_pytorch``
    and says so once. ``layer_functions``: block index -> the attention function a layer asked
    ComfyUI for (newer ComfyUI's per-layer ``comfy_attention``, which ComfyUI does not pass to an
    override); such a layer's calls are treated as if ComfyUI had handed that function."""

    _safesage_guarded = True

    def __init__(self, policy: Policy = Policy(), kernels: list[Kernel] | None = None,
                 verifier: Verifier | None = None,
                 rt: Runtime | None = None, previous: Callable | None = None,
                 layer_functions: dict | None = None, quality: QualityGuard | None = None):
        self.policy = policy
        self.rt = rt or runtime()
        self.verifier = verifier or Verifier(policy.verify)
        # rt / kernels describe the current GPU (the home device); kernels handed in (tests,
        # benches) are for it only, found here each other GPU arch gets its own
        self._home = torch.cuda.current_device() if torch.cuda.is_available() else None
        self._own_kernels = kernels is None
        if kernels is None:
            kernels = installed_kernels(self.rt)
        self.kernels: dict[str, Kernel] = {kk.family: kk for kk in kernels}
        self.kernels.setdefault("sdpa", SDPA_KERNEL)
        # verdicts and kill switches hold for one GPU arch and kernel build (Runtime.kernel_site)
        self._sites = {f: self.rt.kernel_site(f) for f in self.kernels}
        self.previous = previous
        self.previous_kind = unguarded_kind(previous)       # "sage" / "ck" / None
        self.layer_functions = {k: getattr(f, "__wrapped__", f) for k, f in (layer_functions or {}).items()}
        self._layer_fn_ids = {id(f) for f in self.layer_functions.values()}
        self._prepared: dict[tuple, Prepared] = {}
        self._comfy_fns: dict[int, tuple] = {}      # id(func) -> (func, what runs in its place)
        self._guards: dict = {}                      # cuda device index -> the SafeAttention for its arch
        self._cache_lock = threading.Lock()          # held while a trimmed cache changes (_remember)
        self._budget_reader = BudgetReader()
        self.executor = Executor(self.kernels, policy.debug_sync)
        # per-block error targets over a sampling run (quality/); one per node, shared by its GPUs
        self.quality = quality or QualityGuard(policy.quality, policy.probe_step, policy.exact_steps)
        self._quality_told = False                   # "no sampling step seen" said (once per override)
        self._init_context()
        self._quality_on = self.quality.active and self._may_guard   # the guard may change a call's plan
        guarded = [k for f, k in self.kernels.items() if f != "sdpa"]
        self._masks_guarded = any(k.envelope.supports_mask for k in guarded)
        self._unread_said: set = set()               # kinds of calls handed on unread, named in the plans
        self._mask_reason = ("attention mask: no guarded kernel takes one ("
                             + ", ".join(k.family for k in guarded) + ")")
        # the signature holds base-pointer alignment when a plan may depend on it: a family's extra
        # rule reads it (comfy-kitchen's AlignRule), here or on another GPU's guard (its own kernels)
        self._key_alignment = any(k.envelope.extra_rules for k in guarded) or (
            self._own_kernels and torch.cuda.is_available() and torch.cuda.device_count() > 1)

    @property
    def broken(self) -> dict[str, str]:
        """Families whose build cannot run on this GPU: off for every call here in this process (the
        report's one list, so a SafeSage node applied later in the process knows them too); the
        same family on a GPU of another arch, or another build, is not affected."""
        return run_stats.disabled_at(self._sites)

    def __deepcopy__(self, memo):
        # Clones of a patched model share one override (its caches are process-wide
        # anyway); other packs deepcopy model_options freely.
        return self

    # --------------------------------------------------------------- calling
    @contain.boundary
    def __call__(self, func: Callable, *args: Any, **kwargs: Any) -> Any:
        # torch.compile (asked once per call, before anything else), inside another SafeSage: special_calls.py
        if getattr(func, "__wrapped__", None) is not None:
            func = unwrap_attn(func)
        if torch_is_compiling():        # traced by dynamo: nothing else first (special_calls.py)
            return self._compiled_call(func, args, kwargs)
        try:                            # the containment boundary (contain.py)
            if INSIDE_KW in kwargs or INSIDE.get():     # inside another SafeSage
                return self._nested_call(func, args, kwargs)
            out = self._call(func, args, kwargs)    # eager from here on: nothing asks torch again
            if out is not HAND_ON:
                return out
            run = self._what_comfy_runs(self._layer_function(kwargs, func) if self.layer_functions else func)
        except Exception as e:          # noqa: BLE001 - SafeSage's own error: see _contained
            run = self._contained(e, func, kwargs)
        return run(*args, **kwargs)     # outside the handler: ComfyUI's errors are not chained to ours

    def _call(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """An eager call outside another SafeSage, up to its story (:meth:`attend_prepared`). The special
        calls are decided first: one no guarded kernel takes whatever it is (handed on unread), one
        during CUDA-graph capture, one whose signature no guarded kernel takes under any budget. Then
        the plan is found: a repeated signature's (call_forms.signature) in one lookup, the call bound
        to its form without being read again; a new signature's read in full and planned
        (:meth:`_first_call`, then :meth:`attend`)."""
        if self.layer_functions:
            func = self._layer_function(kwargs, func)
        a = call_arguments(args, kwargs)
        if self.previous is None and (not self._may_guard or kwargs.get("low_precision_attention", True) is False
                                      or (a[4] is not None and not self._masks_guarded)):
            # no guarded kernel takes it, whatever it is (ComfyUI's attention_sage asks the same
            # first: full precision asked for, or a mask): ComfyUI's function, the call not read
            return self._hand_on_unread(a, kwargs)
        key = signature(func, a, kwargs, self._key_alignment)
        if key is None:
            return self._first_call(func, args, kwargs, a, None)
        guard = self
        p = self._prepared.get(key)
        if p is None and a[0].is_cuda:              # a GPU of another arch: its guard's plans
            guard = self._guard_for(a[0].device)
            p = guard._prepared.get(key) if guard is not None else None
        if p is None or p.func is not func:
            return self._first_call(func, args, kwargs, a, key)
        if p.cuda and capturing():
            return self._captured_call(func, args, kwargs)
        if p.never_guarded and self.previous is None:
            # no guarded kernel can take this signature under any budget (a mask, a head size no
            # family runs, ...): ComfyUI's function, counted as on the full path
            return self._hand_on(p.count_key, p.fallback_reason, p.shape_key, kwargs)
        n = p.form.bind(a, kwargs)
        n.prepared = p
        if self._quality_on:
            self._quality_context(n, kwargs)
        out = guard.attend_prepared(p, n, func)
        if out is None:
            return self._run_comfy(func, args, kwargs, n)
        return out

    def _hand_on_unread(self, a: tuple, kwargs: dict) -> Any:
        """A call no guarded kernel takes whatever it is, handed on unread (HAND_ON): recorded, and its
        kind named once in the statistics' plans."""
        if not self._may_guard:
            kind, why = "every call", ""
        elif a[4] is not None:
            kind, why = "masked calls", self._mask_reason
        else:
            kind, why = "full-precision calls", ""
        if kind not in self._unread_said:
            self._name_unread(kind)
        return self._hand_on("plan:sdpa", why, None, kwargs)

    def _hand_on(self, plan_key: str | None, reason: str, key: Any, kwargs: dict) -> Any:
        """The record of a call SafeSage gives to ComfyUI unplanned or never guarded (HAND_ON: the
        caller runs what ComfyUI runs): counted once, and counted by the quality guard, whose block
        numbering counts every call of a forward."""
        run_stats.record_call(plan_key, None, reason, key)
        if self._quality_on:
            self.quality.count_call(kwargs.get("transformer_options"))
        return HAND_ON

    def _name_unread(self, kind: str) -> None:
        """Calls of ``kind`` are handed on unread: the statistics' plans say so, once."""
        self._unread_said.add(kind)
        why = {"every call": "no guarded kernel here", "masked calls": self._mask_reason,
               "full-precision calls": "the model asked for full precision"}[kind]
        run_stats.remember_plan(kind, f"sdpa: ComfyUI's own attention, the call not read ({why})")

    def _first_call(self, func: Callable, args: tuple, kwargs: dict, a: tuple, key: tuple | None) -> Any:
        """A call read in full: a new signature (its plan is prepared and kept under ``key``), or
        one of no plain signature (``key`` None)."""
        if capturing():
            return self._captured_call(func, args, kwargs)
        try:
            n = read_form(a, kwargs).bind(a, kwargs)
        except UnsupportedCall as e:
            self._hand_on(None, f"unsupported call passed to {function_name(self._what_comfy_runs(func))}: {e}",
                          None, kwargs)          # handed on unread: it still counts in the call-order numbering
            return self._run_comfy(func, args, kwargs, None)
        if self._quality_on:
            self._quality_context(n, kwargs)
        out = self.attend(n, func, key)     # an error of SafeSage's own here: the boundary (__call__)
        if out is None:
            return self._run_comfy(func, args, kwargs, n)
        return out

    def attend(self, n: Normalised, func: Callable | None = None,
               key: tuple | None = None) -> torch.Tensor | None:
        """A call read in full: its plan found (cached per call signature: ``key``, the call's raw
        signature, else the normalised one; made on a miss), then its story (:meth:`attend_prepared`).
        Returns the result in the caller's form (Normalised.finish); None: no guarded kernel takes
        this call (the caller runs ComfyUI's own)."""
        q = n.q4
        if n.q.shape[2] == 0:
            run_stats.record_call("plan:empty")
            return None
        guard = self._guard_for(q.device)
        if guard is not self:
            if guard is not None:
                return guard.attend(n, func, key)
            run_stats.record_call("plan:other_gpu", None, f"a call on {q.device}, another kind of GPU than the "
                                  f"one the kernels handed to SafeSage are for ({self.rt.arch_name}): ComfyUI's own "
                                  "attention")
            return None
        if key is None:
            key = self._call_key(n, func)
        p = self._prepared.get(key)
        if p is None or p.func is not func:
            p = self._remember(self._prepared, key, self._prepare(n, func))   # the newest signatures
        n.prepared = p
        return self.attend_prepared(p, n, func)

    def attend_prepared(self, p: Prepared, n: Normalised, func: Callable | None) -> torch.Tensor | None:
        """The guarded call's story, for a call whose signature's plan ``p`` is known (this GPU's), one
        stage a line: the plan under the memory budget now → the quality guard's choice → run →
        verify once per class of call (and the quality guard's measurement on its steps) → record,
        the one place a call is counted (this thread's own counts: no lock). Returns the result in
        the caller's form; None where ComfyUI's own attention runs the call (the caller runs it)."""
        st, plan, also, out = n.run, None, None, None
        try:
            plan = p.plan if p.fixed else self._within_budget(p)           # the plan now
            if st is not None and (st.mode in _CHOOSING or (
                    st.mode is quality_guard.PROBE and self.quality.recalled(self, st, n.block, p, func))):
                plan, also = self._quality_plan(p, plan, st, n)             # the quality guard chooses
            if plan is not None and plan.kind != "sdpa":
                try:
                    out, layout = self.executor.run(plan, n)                # run
                except Exception as e:
                    out = self._run_failed(p, plan, e)      # a CUDA error raised, else ComfyUI's own: None
                if out is not None and plan.kernel not in p.checked:
                    out = self._verify_once(p, plan, n, out, layout)        # verify once per class
                if out is not None and st is not None and st.mode in _MEASURED:
                    self.quality.measure(self, st, n.block, p.klass, n, func, plan, n.to_hnd(out, layout))
        finally:                                                            # record (a call that raised too)
            run_stats.record_call(None if plan is None else p.count_key if plan is p.plan else f"plan:{plan.kind}",
                                  also, _fallback_reason(p, plan) if plan is not None and plan.kind == "sdpa" else "",
                                  p.shape_key)
        return None if out is None else n.finish(out, layout)

    def _verify_once(self, p: Prepared, plan: Plan, n: Normalised, out: torch.Tensor,
                     layout: str) -> torch.Tensor | None:
        """Stage "verify": the first call of each class of call on ``plan``'s family is checked against
        SDPA (:meth:`_verify`); once its class has a verdict, not asked again for this signature."""
        ck = p.class_keys.get(plan.kernel)
        if ck is None:
            ck = p.class_keys[plan.kernel] = self._class_key(plan.kernel, p.call)
        if self.verifier.needs_probe(ck):
            return self._verify(p, plan, ck, n, out, layout)
        if self.verifier.mode != "every":
            p.checked.add(plan.kernel)     # its class has a verdict: not asked again for this signature
        return out

    def _quality_context(self, n: Normalised, kwargs: dict) -> None:
        """The quality guard's run and the call's block (quality/guard.py), when a forward of this
        run has started; else said once (no step known: the guard is off for this call)."""
        st = self.quality.state()
        if st is None:
            if self._quality_told:
                return
            self._quality_told = True
            run_stats.once(("quality-no-run",), logging.WARNING,
                           "SafeSage: the quality guard is off for these calls: no sampling step started for them. "
                           "SafeSage's APPLY_MODEL wrapper marks each model evaluation of ComfyUI's sampler; it did "
                           "not run (the model was called outside ComfyUI's sampler), or found another attention "
                           "override put after SafeSage on the model (it chains SafeSage). Attention calls run as "
                           "planned, with the first-call fault checks only")
            return
        if st.mode is quality_guard.PLANNED:
            return                      # this forward runs the plans as they are: no call's block is used
        n.run = st
        n.block = self.quality.block_of(st, kwargs.get("transformer_options"))

    def _quality_plan(self, p: Prepared, plan: Plan, st, n: Normalised) -> tuple:
        """The plan for this call after the quality guard's choice, and the guard's counter for the
        record (None: none): ComfyUI's own (plan None) at an exact step, or for a block moved there;
        the moved-to family's plan; else ``plan``."""
        if st.mode == quality_guard.EXACT:
            return None, _EXACT
        fams = st.choices.get((n.block, p.klass))
        if fams is None:
            return plan, None
        for i, fam in enumerate(fams):
            if fam == "sdpa":
                if i:
                    quality_guard.runs_now(st, n.block, p.klass, fam)
                return None, _MOVED
            got = plan if fam == plan.kernel else self._family_plan(p, fam)
            if got is not None:
                if i:
                    quality_guard.runs_now(st, n.block, p.klass, fam)
                return got, _MOVED
            # the family it moved to cannot run it (failed its first-call check on this class of call,
            # switched off, or outside its limits): the next family under the block's target, else ComfyUI's own
            quality_guard.STATS.bump("moved_fallbacks")
            if st.fell.get((n.block, p.klass)) is None:      # said once per block, the reason read only then
                run_stats.once(("quality-moved-fallback", fam, p.klass), logging.WARNING,
                               "SafeSage quality guard: %s cannot run the calls of %s moved to it (%s); they run %s "
                               "instead", fam, p.shape_key, self.why_unusable(fam, p.call) or "outside its limits",
                               next((f for f in fams[i + 1:] if f != "sdpa"), "ComfyUI's own attention"))
        quality_guard.runs_now(st, n.block, p.klass, "sdpa")
        return None, _MOVED

    @staticmethod
    def _call_key(n: Normalised, func: Callable | None) -> tuple:
        """A call signature (the key of the plan prepared for it): base-pointer alignment
        included (comfy-kitchen's #15494 rule: the same view at another offset may need a copy)."""
        q, k, v = n.q, n.k, n.v
        return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device,
                n.caller_layout, n.mask is None, id(func), n.low_precision_ok,
                base_alignment(q), base_alignment(k), base_alignment(v))

    def _guard_for(self, device: torch.device) -> "SafeAttention | None":
        """Who guards calls on ``device``: this SafeAttention on the GPU it was made on (whose facts
        it holds, e.g. a bench's emulated arch), off CUDA, and on any GPU of the same arch; for a GPU
        of another arch in the same process, a SafeAttention made for that GPU
        (its own runtime, kernels and limits; same policy, verifier, chained override), once per
        device. None when this one was handed its kernels (they are for its GPU only)."""
        if device.type != "cuda" or self.rt.arch is None or device.index in (None, self._home):
            return self
        try:
            return self._guards[device.index]
        except KeyError:
            pass
        rt = runtime(device)
        if rt.arch == self.rt.arch:
            guard = self
        elif not self._own_kernels:
            guard = None
        else:
            guard = SafeAttention(self.policy, verifier=self.verifier, rt=rt, previous=self.previous,
                                  layer_functions=self.layer_functions, quality=self.quality)
            guard._guards[device.index] = guard
            run_stats.once(("other-gpu", device.index), logging.INFO, "SafeSage: %s is %s (%s); its calls are "
                        "guarded with that GPU's kernels", device, rt.device_name, rt.summary())
        self._guards[device.index] = guard
        return guard
