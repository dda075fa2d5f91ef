"""One rank's sage call under sequence parallelism, guarded the way one GPU's calls are.

xFuser and yunchang call the kernel yunchang selected once per rank per key chunk: ``fn(q, k, v,
dropout_p=, softmax_scale=, causal=, ...)`` with NHD tensors ([B, S, H, D]), expecting ``(out, lse)``.
Under Ulysses degree U each rank gets the whole sequence and H/U heads (contiguous, after the
all-to-all); under ring degree R each call gets the rank's S/R queries and one S/R key chunk. A
:class:`GuardedRankKernel` stands in for that ``fn``:

1. **check** the rank's call -- its own geometry, heads per rank and key chunk -- against the
   family's :class:`~safe_ops.families.envelope.Envelope` (``check()``, the one-GPU mechanism). The
   shapes are the same on every rank of a group, so every rank makes the same choice without talking.
   A call outside it is planned by the one-GPU planner into launches inside it (rank_plan: copies,
   head groups, query chunks); a call no plan fits is refused (3.).
2. **first call of a class** (verification.class_key, the one-GPU classes): run the kernel, compare
   its output with float32 attention on the verifier's probe rows (``compare``, the family's
   tolerance) and its LSE (lse_reference.lse_error), then **agree**: one ``all_reduce(MAX)`` of a
   failure flag over the agreement group, so that a kernel that raised or failed on *one* rank is
   refused on every rank, for that class, for the rest of the process.
3. a refused call runs PyTorch's attention with its LSE (lse_reference.sdpa_with_lse) on that rank:
   counted in run_stats' ``multigpu`` section and logged once per reason, the reason's words the
   same on every rank.

Nothing SafeSage raises leaves a rank (a rank that raised would stall the others in the next
collective until it times out): its own errors are contained (contain.internal_error) and the call
falls back. What passes through is what nothing can recover from: a sticky CUDA error
(attention.errors.is_cuda_error), and an error of the fallback itself (PyTorch's out of memory).

The agreement happens only at a class's first call, where the check already reads the host once; a
kernel that raises on a later call of a checked class falls back on that rank for that call and is
refused there from then on (counted ``kernel_errors``), without a collective on the hot path.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from .. import contain
from ..attention.errors import is_cuda_error
from ..attention.verification import class_key, compare
from ..families.envelope import AttnCall, TensorDesc, check
from ..ui import run_stats
from .lse_reference import LSE_TOLERANCE, lse_error, sdpa_with_lse
from .rank_plan import plan_rank_call, run_rank_plan

log = logging.getLogger("SafeSage")

SECTION = run_stats.Section(
    "multigpu",
    ("calls", "kernel", "checked", "failed_checks", "outside_envelope", "planned", "kernel_errors", "refused",
     "internal_errors"),
    fallback_log="SafeSage (sequence-parallel rank): {reason}; this rank's call runs PyTorch's attention")

WHAT = "the sequence-parallel attention guard"


def _desc(t: torch.Tensor) -> TensorDesc:
    """An NHD tensor [B, S, H, D] in the envelope's canonical (b, h, s, d) order."""
    b, s, h, d = t.shape
    sb, ss, sh, sd = t.stride()
    return TensorDesc((b, h, s, d), (sb, sh, ss, sd))


def rank_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: str = "") -> AttnCall:
    """The rank's kernel call as an envelope sees it (``tensor_layout="NHD"``)."""
    return AttnCall(_desc(q), _desc(k), _desc(v), str(q.dtype).replace("torch.", ""), layout="NHD",
                    device=q.device.type, arch=arch, elt_bytes=q.element_size())


def default_agree(group: Any = None) -> Callable[[bool, torch.device], bool]:
    """Agreement over ``group`` (None: the default group): True when any rank passes True.
    Without an initialised torch.distributed, a rank's own flag."""
    def agree(flag: bool, device: torch.device) -> bool:
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) <= 1:
            return flag
        on = device if dist.get_backend(group) != "gloo" else torch.device("cpu")
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=on)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return bool(t.item())
    return agree


class GuardedRankKernel:
    """yunchang's selected sage ``fn`` for one family, guarded (module docstring).

    ``family``: the KernelFamily whose envelope and tolerance the calls are held to, or a callable
    ``device -> KernelFamily | None`` (``sageattn``'s family depends on the GPU); None refuses every
    call. ``site``: ``(device, family name) -> str``, the kernel build a verdict covers (facts.devices'
    kernel_site). ``agree``: see :func:`default_agree`."""

    def __init__(self, fn: Callable, family: Any, site: Callable[[torch.device, str], str] | None = None,
                 agree: Callable[[bool, torch.device], bool] | None = None, verdicts: dict | None = None):
        self.fn = fn
        self._family = family
        self._site = site or (lambda device, family: device.type)
        self._agree = agree or default_agree()
        #: class key -> None (checked, good) or the reason it is refused; shared by the kernels of
        #: one hook (xfuser_hook), so a class checked once is not checked again per chunk
        self.verdicts = {} if verdicts is None else verdicts
        self._plans: dict = {}

    def family(self, device: torch.device):
        return self._family(device) if callable(self._family) else self._family

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any):
        SECTION.bump("calls")
        scale = kwargs.get("sm_scale") or q.shape[-1] ** -0.5     # what sage computes: it takes sm_scale
        try:
            fam = self.family(q.device)
            if fam is None:
                return self._refused(q, k, v, scale, "no SafeSage family for this sage function here")
            call = rank_call(q, k, v)
            viol = check(call, fam.envelope)
            key = class_key(fam.name, self._site(q.device, fam.name), call.dtype, call.head_dim, "NHD", call.heads,
                            call.kv_heads, call.q_len, call.kv_len)
        except Exception as e:  # noqa: BLE001 - SafeSage's own error: contained, never raised on a rank
            contain.internal_error(e, WHAT, "this rank's call runs PyTorch's attention", stats=SECTION)
            return sdpa_with_lse(q, k, v, scale)
        if viol:
            SECTION.bump("outside_envelope")
            plan = self._plan(call, fam)
            if plan is None:
                return self._refused(q, k, v, scale, f"{fam.name}: outside its envelope on this rank's call and no "
                                     f"plan of its kernel fits ({len(viol)} limit(s); first: {viol[0]})")
            SECTION.bump("planned")
            key = (*key, plan.describe(reasons=False))         # the planned run is its own class

            def run():
                return run_rank_plan(plan, self.fn, q, k, v, args, kwargs)
        else:
            def run():
                return self.fn(q, k, v, *args, **kwargs)
        if key in self.verdicts:
            reason = self.verdicts[key]
            if reason is not None:
                return self._refused(q, k, v, scale, reason)
            return self._run_checked(fam, key, run, q, k, v, scale)
        return self._first_call(fam, key, run, q, k, v, scale)

    def _plan(self, call: AttnCall, fam):
        """The planner's plan for a rank call outside the envelope (rank_plan), once per call shape;
        None where none fits or planning failed (contained)."""
        pk = (fam.name, call)
        if pk in self._plans:
            return self._plans[pk]
        try:
            plan = plan_rank_call(call, fam.envelope)
            if plan is not None:
                run_stats.remember_plan(f"rank {call.q.shape} {call.k.shape} {fam.name}", plan.describe())
        except Exception as e:  # noqa: BLE001 - SafeSage's own error: the call is refused instead
            contain.internal_error(e, WHAT + "'s planner", "this rank's call runs PyTorch's attention", stats=SECTION)
            plan = None
        self._plans[pk] = plan
        run_stats.trim(self._plans)
        return plan

    def _refused(self, q, k, v, scale, reason: str):
        SECTION.bump("refused")
        SECTION.fallback(reason)
        return sdpa_with_lse(q, k, v, scale)

    def _run_checked(self, fam, key, run, q, k, v, scale):
        try:
            out = run()
            SECTION.bump("kernel")
            return out
        except Exception as e:  # noqa: BLE001 - the kernel's error: this call falls back
            if is_cuda_error(e):
                raise                   # the context is gone: nothing can be recomputed
            SECTION.bump("kernel_errors")
            self.verdicts[key] = reason = f"{fam.name}: raised on this rank ({type(e).__name__}); refused here"
            log.warning("SafeSage: %s kernel raised on a checked class: %s: %s", fam.name, type(e).__name__, e)
            return self._refused(q, k, v, scale, reason)

    def _first_call(self, fam, key, run, q, k, v, scale):
        out = None
        local: str | None = None
        try:
            out = run()
            o, lse = out[0], out[1]
            verdict = compare(o.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                              scale, fam.tolerance)
            lerr = lse_error(lse, q, k, scale) if lse is not None else float("inf")
            if not verdict.ok:
                local = f"output: {verdict.detail}"
            elif not lerr <= LSE_TOLERANCE:
                local = f"LSE off by {lerr:.4g} > {LSE_TOLERANCE} on the probe rows"
        except Exception as e:  # noqa: BLE001 - the kernel's (or the check's) error: agreed below
            if is_cuda_error(e):
                raise
            local = f"raised {type(e).__name__}: {str(e)[:160]}"
        if local is not None:
            log.warning("SafeSage: %s failed its first-call check on this rank: %s", fam.name, local)
        try:
            refused = self._agree(local is not None, q.device)
        except Exception as e:  # noqa: BLE001 - the collective failed: this rank decides alone
            contain.internal_error(e, WHAT + "'s agreement", "this rank decides alone", stats=SECTION)
            refused = local is not None
        SECTION.bump("checked")
        run_stats.trim(self.verdicts, expendable=lambda reason: reason is None)   # bounded; refusals stay
        if not refused:
            self.verdicts[key] = None
            SECTION.bump("kernel")
            return out
        SECTION.bump("failed_checks")
        self.verdicts[key] = reason = (f"{fam.name}: failed the first-call check on a rank for "
                                       f"{call_words(q, k)}; refused on every rank")
        run_stats.failed_check("/".join(map(str, key)), local or "another rank's kernel failed")
        return self._refused(q, k, v, scale, reason)


def call_words(q: torch.Tensor, k: torch.Tensor) -> str:
    return f"{q.shape[2]} heads x {q.shape[1]:,} queries x {k.shape[1]:,} keys"
