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
import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from . import envelope_ck  # noqa: F401  (registers the comfy-kitchen families)
from . import report
from .envelope import FAMILIES, SDPA, AttnCall, Envelope, TensorDesc
from .fences import GLOBAL_FENCES, FenceBook, StreamHop
from .planner import Plan, choose, sdpa_plan
from .policy import Policy
from .probe import DEFAULT_TOLERANCE, TOLERANCE, Verifier, class_key, compare
from .runtime import (Runtime, auto_order, comfy_attention_choice, free_device_bytes, measured_tflops,
                      pricing_tflops, runtime)

log = logging.getLogger("SafeSage")

# Fraction of currently free device memory a plan's peak may use: its own copies and merge
# state *and* the kernel's temporaries of one launch (Plan.peak_bytes) -- everything the call
# allocates beyond its inputs and result, so most of what is free, with a margin.
FREE_MEMORY_FRACTION = 0.8
BUDGET_STEP = 2 ** 0.25      # budget buckets (~19% apart): a plan is re-chosen when free memory moves
BUDGET_POLL_S = 0.05         # free memory is re-read at most this often


def budget_bucket(nbytes: int) -> int:
    """``nbytes`` rounded down to a power of BUDGET_STEP (0 for nothing free)."""
    if nbytes <= 0:
        return 0
    quarters = math.floor(4 * math.log2(nbytes) + 1e-9)        # BUDGET_STEP = 2 ** (1/4)
    while True:
        b = int(2 ** (quarters // 4) * 2 ** ((quarters % 4) / 4))
        if b <= nbytes:
            return b
        quarters -= 1

def plan_budget_bytes(free: int | None) -> int | None:
    """What a plan may use out of ``free`` bytes: FREE_MEMORY_FRACTION of it, bucketed."""
    return None if free is None else budget_bucket(int(free * FREE_MEMORY_FRACTION))


KernelFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, str, "float | None"], torch.Tensor]
KernelLseFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, str, "float | None"],
                       "tuple[torch.Tensor, torch.Tensor]"]


@dataclass
class Kernel:
    """An executable kernel family: its envelope and ``fn(q, k, v, layout, scale) -> out``.

    ``fn`` receives tensors in ``layout`` order (HND ``[B,H,S,D]`` or NHD
    ``[B,S,H,D]``) and returns the output in the same layout.

    ``fn_lse`` (optional, same arguments) returns ``(out, lse)``: ``lse`` float32
    ``[B,H,Sq]`` whatever the layout, the natural log of ``sum_j exp(scale * q.k_j)`` over
    the keys it was given, up to a per-row constant that is the same for every slice of
    the keys of one call (what key/value-chunked plans need to merge exactly). Without it
    the envelope's ``returns_lse`` is switched off, so the planner never makes kv_chunks.
    """
    envelope: Envelope
    fn: KernelFn
    tolerance: float = DEFAULT_TOLERANCE
    fn_lse: KernelLseFn | None = None

    def __post_init__(self):
        if self.fn_lse is None and self.envelope.returns_lse:
            self.envelope = replace(self.envelope, returns_lse=False)

    @property
    def family(self) -> str:
        return self.envelope.family


def _sdpa_fn(q, k, v, layout, scale, mask=None):
    if layout == "NHD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    kw = {} if scale is None else {"scale": scale}
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    return out.transpose(1, 2) if layout == "NHD" else out


SDPA_KERNEL = Kernel(SDPA, _sdpa_fn, TOLERANCE["sdpa"])


def sage_kernel(rt: Runtime) -> Kernel | None:
    """The installed sageattention as a Kernel, or None (reason in ``rt.sage_error``).

    sage 1.x: ``sageattn`` with ``smooth_k=False`` (as ComfyUI calls it; 1.x would
    otherwise subtract the mean from the caller's k in place). sage 2.2: the
    per-family function ``sageattn`` itself dispatches to on this arch, called
    with explicit arguments so the kernel that runs is exactly the envelope
    checked (``envelope_sage2.SAGEATTN_CALL``); 2.2's ``sageattn`` drops
    ``smooth_k``, so the functions' own default (on) is kept, as in ComfyUI.
    """
    fam = rt.sage_family
    if fam is None or fam not in FAMILIES:
        return None
    if fam == "sage1_triton":
        from sageattention import sageattn

        def fn(q, k, v, layout, scale):
            return sageattn(q, k, v, tensor_layout=layout, is_causal=False, sm_scale=scale, smooth_k=False)

        return Kernel(FAMILIES[fam], fn, TOLERANCE.get(fam, DEFAULT_TOLERANCE))
    return sage2_kernel(fam)


def sage2_kernel(fam: str) -> Kernel | None:
    """The sage 2.2 family ``fam`` as a Kernel (None when this build lacks its function).

    ``fn_lse`` (for kv_chunks) calls the same function with ``return_lse=True`` and
    ``smooth_k=False`` on keys the plan already centred (``Envelope.lse_centred_k``).
    """
    from .envelope_sage2 import SAGEATTN_CALL
    try:
        import sageattention
    except Exception:
        return None
    if fam not in SAGEATTN_CALL or fam not in FAMILIES or not hasattr(sageattention, SAGEATTN_CALL[fam][0]):
        return None
    name, extra = SAGEATTN_CALL[fam]
    f = getattr(sageattention, name)

    def fn(q, k, v, layout, scale):
        return f(q, k, v, tensor_layout=layout, is_causal=False, sm_scale=scale, **extra)

    def fn_lse(q, k, v, layout, scale):
        # keys arrive centred on the whole sequence's mean (Envelope.lse_centred_k): no
        # per-chunk smoothing, and core.py returns lse / log2(e) with no rounded correction
        return f(q, k, v, tensor_layout=layout, is_causal=False, sm_scale=scale,
                 return_lse=True, **{**extra, "smooth_k": False})

    return Kernel(FAMILIES[fam], fn, TOLERANCE.get(fam, DEFAULT_TOLERANCE), fn_lse)


def ck_kernel(rt: Runtime | None = None) -> Kernel | None:
    """comfy-kitchen's ``int8_attention`` as a Kernel, or None (reason in ``rt.ck_error``).

    It takes ``[B,H,L,D]`` with any strides, so an NHD plan hands it transposed views; it
    returns no LSE (``Envelope.returns_lse`` False: no kv_chunks)."""
    rt = rt or runtime()
    fam = rt.ck_family
    if fam not in FAMILIES:
        return None
    try:
        import comfy_kitchen
        f = comfy_kitchen.int8_attention
    except Exception:
        return None

    def fn(q, k, v, layout, scale):
        if layout == "NHD":
            return f(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale).transpose(1, 2)
        return f(q, k, v, scale=scale)

    return Kernel(FAMILIES[fam], fn, TOLERANCE.get(fam, DEFAULT_TOLERANCE))


def installed_kernels(rt: Runtime) -> list[Kernel]:
    """Every usable kernel family here, in ``kernel=sage`` preference order: the family
    ``sageattn`` dispatches to; then (sage 2.2) the other sage-2 families this build runs on
    this arch *that kernel_table.json measured on it* (only verified families are written
    there; an unmeasured family could shadow the dispatch family's evidence-based rules, e.g.
    per_warp FP8-PV on sm_120 without #388's length rule), fastest first; then comfy-kitchen."""
    first = sage_kernel(rt)
    out = [first]
    from .envelope_sage2 import RUNS_ON, KvLenRule
    if (first is not None and first.family != "sage1_triton" and rt.arch is not None
            and not any(isinstance(r, KvLenRule) for r in first.envelope.extra_rules)):
        tflops = measured_tflops(rt.arch_name)
        for fam in sorted(tflops, key=lambda f: -tflops[f]):
            if fam != first.family and tuple(rt.arch) in RUNS_ON.get(fam, ()):
                out.append(sage2_kernel(fam))
    out.append(ck_kernel(rt))
    return [kk for kk in out if kk is not None]


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _desc(t: torch.Tensor) -> TensorDesc:
    return TensorDesc(tuple(t.shape), tuple(t.stride()))


@dataclass
class Normalised:
    q: torch.Tensor          # HND views [B, H, Sq, D]
    k: torch.Tensor
    v: torch.Tensor
    heads: int
    mask: torch.Tensor | None
    scale: float | None
    caller_layout: str       # the layout ComfyUI's own sage path would use
    skip_output_reshape: bool
    low_precision_ok: bool = True   # False: the model asked for full-precision attention

    def finish(self, out_hnd: torch.Tensor) -> torch.Tensor:
        """Shape the [B,H,Sq,D] result the way ComfyUI's attention functions return it."""
        if self.skip_output_reshape:
            return out_hnd
        b, h, s, d = out_hnd.shape
        return out_hnd.transpose(1, 2).reshape(b, s, h * d)


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


# CUDA errors that leave the context unusable (sticky): nothing can be recomputed after them.
# Others ("no kernel image is available", "invalid device function": a build for another GPU)
# mean nothing was launched, so the call can be recomputed with another kernel.
_STICKY_CUDA_ERRORS = ("illegal memory access", "illegal address", "unspecified launch failure",
                       "misaligned address", "device-side assert", "illegal instruction",
                       "hardware stack error", "CUBLAS_STATUS_EXECUTION_FAILED", "launch timed out")


def is_cuda_error(e: BaseException) -> bool:
    """A sticky CUDA error (asynchronous, poisons the context): it cannot be recovered by
    recomputing, so it must propagate."""
    msg = str(e)
    return any(s in msg for s in _STICKY_CUDA_ERRORS)


def is_oom(e: BaseException) -> bool:
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", ())
    return isinstance(e, oom) or "out of memory" in str(e)


class UnsupportedCall(ValueError):
    """An attention call SafeSage cannot read; it is passed to ComfyUI's own function."""


def normalise(args: tuple, kwargs: dict) -> Normalised:
    """ComfyUI's call forms -> HND views of q/k/v (no copies) plus what the output needs."""
    na = len(args)
    get = kwargs.get
    q = args[0] if na > 0 else get("q")
    k = args[1] if na > 1 else get("k")
    v = args[2] if na > 2 else get("v")
    heads = args[3] if na > 3 else get("heads")
    mask = args[4] if na > 4 else get("mask")
    skip_reshape = bool(args[6] if na > 6 else get("skip_reshape", False))
    skip_output_reshape = bool(args[7] if na > 7 else get("skip_output_reshape", False))
    Tensor = torch.Tensor
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)):
        raise UnsupportedCall("q, k and v must be tensors")
    if not isinstance(heads, int) or heads < 1:
        raise UnsupportedCall(f"heads must be a positive int, got {heads!r}")
    dq = q.get_device()                      # an int: cheaper than building torch.device objects
    if dq != k.get_device() or dq != v.get_device():
        raise UnsupportedCall("q, k and v are on different devices")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise UnsupportedCall(f"q/k/v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    if skip_reshape:
        if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
            raise UnsupportedCall(f"skip_reshape expects 4-d [B,H,S,D] tensors, got ranks {q.ndim}/{k.ndim}/{v.ndim}")
        qh, kh, vh = q, k, v
        layout = "HND"
    else:
        if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
            raise UnsupportedCall(f"expects 3-d [B,S,H*D] tensors, got ranks {q.ndim}/{k.ndim}/{v.ndim}")
        if q.shape[-1] % heads:
            raise UnsupportedCall(f"q width {q.shape[-1]} not divisible by heads {heads}")
        d = q.shape[-1] // heads
        if k.shape[-1] % d or v.shape[-1] != k.shape[-1]:
            raise UnsupportedCall(f"k/v widths {k.shape[-1]}/{v.shape[-1]} do not fit head_dim {d}")
        qh = q.unflatten(-1, (heads, d)).transpose(1, 2)
        kh = k.unflatten(-1, (k.shape[-1] // d, d)).transpose(1, 2)
        vh = v.unflatten(-1, (v.shape[-1] // d, d)).transpose(1, 2)
        layout = "NHD"
    if qh.shape[0] != kh.shape[0] or kh.shape[:3] != vh.shape[:3] or qh.shape[3] != kh.shape[3]:
        raise UnsupportedCall(f"mismatched shapes q{tuple(qh.shape)} k{tuple(kh.shape)} v{tuple(vh.shape)}")
    if kh.shape[1] == 0 or qh.shape[1] % kh.shape[1]:
        raise UnsupportedCall(f"q heads {qh.shape[1]} not a multiple of kv heads {kh.shape[1]}")
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise UnsupportedCall("mask must be a tensor")
        if mask.ndim == 2:
            mask = mask.unsqueeze(0)
        if mask.ndim == 3:
            mask = mask.unsqueeze(1)
    scale = kwargs.get("scale")
    # ComfyUI's attention_sage runs PyTorch attention when a model passes
    # low_precision_attention=False (e.g. SAM3); keep that contract.
    low_ok = get("low_precision_attention", True) is not False
    return Normalised(qh, kh, vh, qh.shape[1], mask, scale, layout, skip_output_reshape, low_ok)


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
        self._budget_cache: dict = {}        # device index -> (time read, budget)

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
        """Bytes a plan may use now (copies, merge state, kernel temporaries), or None (no limit).

        Free device memory -- ComfyUI's own ``get_free_memory`` when ComfyUI is loaded (it adds
        what PyTorch's caching allocator holds unused), else ``cudaMemGetInfo`` plus that idle
        cache -- times FREE_MEMORY_FRACTION, rounded down to a BUDGET_STEP bucket so that plans
        are re-chosen only when it really moves. Re-read at most every BUDGET_POLL_S seconds;
        both are host queries (no stream or device synchronisation) and see what ComfyUI's
        dynamic VRAM (comfy-aimdo) frees or takes between calls.
        """
        if self.policy.max_extra_bytes is not None:
            return self.policy.max_extra_bytes
        if device.type != "cuda":
            return None
        cache = self._budget_cache
        now = time.monotonic()
        hit = cache.get(device.index)
        if hit is not None and now - hit[0] < BUDGET_POLL_S:
            return hit[1]
        budget = plan_budget_bytes(free_device_bytes(device))
        cache[device.index] = (now, budget)
        return budget

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
            out = self.run_plan(plan, n)
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
        return self.run_plan(sdpa_plan(p.call, (why,)), n)

    # --------------------------------------------------------------- running
    def run_plan(self, plan: Plan, n: Normalised) -> torch.Tensor:
        """Execute ``plan``; returns the result as an HND [B,H,Sq,D] tensor (maybe a view).

        Same stream (Triton sage, SDPA): the caching allocator already orders the
        reuse of every temporary after the kernels enqueued on that stream, so a
        copy is freed as soon as the next one is made and peak memory stays at
        one launch's worth. Kernels on the legacy default stream (sage 2.x CUDA):
        the call hops there behind an event and the caller's stream waits for the
        result with another event -- no host synchronisation either way. Inside the
        hop the kernel's own temporaries and the pack's copies are allocated on the
        legacy stream, so the allocator orders their reuse; the copies are fenced
        anyway (defence in depth, bytes capped). The
        caller's q/k/v views are *not* fenced: they belong to the caller's stream,
        which waits for the hop's exit event before any later work, so their memory
        cannot be reused early -- and fencing them would pin the whole qkv buffer.
        """
        kern = self.kernels[plan.kernel]
        q, k = n.q, n.k
        dev = q.device
        hop = None
        if kern.envelope.launches_on_legacy_stream and dev.type == "cuda":
            cur = torch.cuda.current_stream(dev)
            legacy = torch.cuda.default_stream(dev)
            if cur != legacy:
                hop = StreamHop(cur, legacy)
        if hop is None:
            out = self._launch_all(plan, kern, n, None)
        else:
            report.count("stream_hops")
            hop.enter()
            try:
                with torch.cuda.stream(hop.target):
                    out = self._launch_all(plan, kern, n,
                                           lambda ts: self.fences.hold(ts, stream=hop.target, label=plan.kernel))
            finally:
                # Even when a launch raised: the caller's stream must not run ahead of (and the
                # allocator must not hand out memory still read by) what was already enqueued.
                hop.exit()
            # `out` was allocated on the legacy stream and is consumed on the caller's:
            # tell the allocator, so its memory is not reused before the caller is done.
            out.record_stream(hop.origin)
        if self.policy.debug_sync and dev.type == "cuda":
            try:
                torch.cuda.synchronize(dev)
            except RuntimeError as e:
                raise RuntimeError(
                    f"SafeSage debug_sync: CUDA error right after {plan.describe()} "
                    f"for q{tuple(q.shape)} k{tuple(k.shape)}: {e}") from e
        return out

    def _launch_all(self, plan: Plan, kern: Kernel, n: Normalised,
                    fence: Callable[[list], Any] | None) -> torch.Tensor:
        q, k, v = n.q, n.k, n.v
        if plan.kind == "sdpa":
            return _sdpa_fn(q, k, v, "HND", n.scale, n.mask)
        B, H, Sq, D = q.shape
        Skv = k.shape[2]
        g = plan.head_group or H
        qc = plan.q_chunk or Sq
        kc = plan.kv_chunk or Skv
        ratio = H // k.shape[1]

        nhd = plan.layout == "NHD"

        def prep(t: torch.Tensor, name: str) -> torch.Tensor:
            """A repacked tensor is contiguous in the kernel's layout (still seen as HND here)."""
            if name not in plan.repack:
                return t
            return t.transpose(1, 2).contiguous().transpose(1, 2) if nhd else t.contiguous()

        def launch(qs, ks, vs) -> torch.Tensor:
            if plan.layout == "NHD":
                o = kern.fn(qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2), "NHD", n.scale).transpose(1, 2)
            else:
                o = kern.fn(qs, ks, vs, "HND", n.scale)
            if fence is not None:
                # only what this call made for the kernel (repacked copies): views of the caller's
                # q/k/v stay unfenced and the output is handed over with record_stream (run_plan)
                fence([t for t, name in ((qs, "q"), (ks, "k"), (vs, "v")) if name in plan.repack])
            return o

        if g >= H and qc >= Sq and kc >= Skv:
            return launch(prep(q, "q"), prep(k, "k"), prep(v, "v"))

        out = torch.empty((B, H, Sq, D), dtype=q.dtype, device=q.device)
        for h0 in range(0, H, g):
            h1 = min(h0 + g, H)
            kh, vh = k[:, h0 // ratio:h1 // ratio], v[:, h0 // ratio:h1 // ratio]
            if kc < Skv:
                self._launch_kv_chunks(plan, kern, n, fence, prep, out, h0, h1, kh, vh, kc)
                continue
            ks = prep(kh, "k")
            vs = prep(vh, "v")
            for s0 in range(0, Sq, qc):
                s1 = min(s0 + qc, Sq)
                out[:, h0:h1, s0:s1].copy_(launch(prep(q[:, h0:h1, s0:s1], "q"), ks, vs))
            del ks, vs
        return out

    @staticmethod
    def _launch_kv_chunks(plan: Plan, kern: Kernel, n: Normalised, fence, prep, out: torch.Tensor,
                          h0: int, h1: int, kh: torch.Tensor, vh: torch.Tensor, kc: int) -> None:
        """Heads h0:h1 of ``out`` from launches over ``kc`` keys at a time, merged exactly.

        Per (head group x query chunk) block: a running float32 accumulator of the
        normalised output and a running LSE; each key chunk's output ``o_c`` (LSE ``l_c``)
        is folded in as ``acc = acc*exp(L - L') + o_c*exp(l_c - L')`` with
        ``L' = logaddexp(L, l_c)``. Peak beyond the result: the accumulator (4 bytes per
        element of the block), one launch's output and temporaries, the centred key chunk
        and [B, g, qc] float32 LSE vectors -- no full-size temporary (Plan.extra_bytes).

        Fencing (legacy-stream kernels), as for the other plans (run_plan): the copies made
        for the kernel (repacked q/v, the centred key chunk) are fenced; views of the caller's
        tensors are not. The kernel's output and LSE and the accumulator are not either: they
        are allocated and consumed on the hop's stream, where the allocator orders reuse, and
        holding every key chunk's output until the GPU caught up would multiply the memory
        the plan was priced at.
        """
        q = n.q
        B, _, Sq, D = q.shape
        Skv = kh.shape[2]
        qc = plan.q_chunk or Sq
        nhd = plan.layout == "NHD"
        centre = kern.envelope.lse_centred_k
        # the unchunked call's smooth_k subtracts this mean (sage core.py: k.mean(seq_dim))
        km = kh.mean(dim=2, keepdim=True) if centre else None

        def key_chunk(c0: int, c1: int) -> torch.Tensor:
            ks = kh[:, :, c0:c1]
            if km is None:
                return prep(ks, "k")
            shape = (B, ks.shape[2], ks.shape[1], D) if nhd else tuple(ks.shape)
            buf = torch.empty(shape, dtype=ks.dtype, device=ks.device)
            buf = buf.transpose(1, 2) if nhd else buf
            return torch.sub(ks, km, out=buf)

        for s0 in range(0, Sq, qc):
            s1 = min(s0 + qc, Sq)
            qs = prep(q[:, h0:h1, s0:s1], "q")
            acc = run = None
            for c0 in range(0, Skv, kc):
                c1 = min(c0 + kc, Skv)
                ks = key_chunk(c0, c1)
                vs = prep(vh[:, :, c0:c1], "v")
                if nhd:
                    o, lse = kern.fn_lse(qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2),
                                         "NHD", n.scale)
                    o = o.transpose(1, 2)
                else:
                    o, lse = kern.fn_lse(qs, ks, vs, "HND", n.scale)
                if fence is not None:
                    fence([t for t, copy in ((ks, km is not None or "k" in plan.repack),
                                             (vs, "v" in plan.repack)) if copy])
                acc, run = lse_merge(acc, run, o, lse)
                del ks, vs, o, lse
            if fence is not None and "q" in plan.repack:
                fence([qs])                  # once, after its last launch (not once per key chunk)
            out[:, h0:h1, s0:s1].copy_(acc)
            del acc, run, qs


def lse_merge(acc: torch.Tensor | None, run: torch.Tensor | None, o: torch.Tensor,
              lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold one key chunk's normalised output ``o`` [B,H,S,D] with LSE ``lse`` [B,H,S] into
    the running float32 ``acc`` / ``run`` (None to start). Exact: softmax over the union of
    the chunks' keys, as long as every ``lse`` is off by the same per-row constant."""
    lse = lse.float()
    if acc is None:
        return o.float().clone() if o.dtype == torch.float32 else o.float(), lse
    new = torch.logaddexp(run, lse)
    acc.mul_(torch.exp(run - new).unsqueeze(-1))
    acc.addcmul_(o, torch.exp(lse - new).unsqueeze(-1))
    return acc, new
