"""Attention calls in a special context: under torch.compile, during CUDA-graph capture, and
inside another SafeSage (a mixin of attention.SafeAttention). ``SafeAttention.__call__`` asks
``torch.compiler.is_compiling()`` before anything else, then whether it runs inside another
SafeSage; capture is
asked before any plan of a call is used or made -- for a repeated signature only when it is a
CUDA call (a CPU call is never captured), for a new one always. Before that the override has only
read the call's metadata and looked its signature up (host-side, no sync, nothing enqueued). A call
handed on unread (override.HAND_ON: no guarded kernel takes it whatever it is) is not asked: it runs
ComfyUI's function in either case, counted on the host.

* **torch.compile** (``torch.compiler.is_compiling()``, asked before anything else): nothing here
  touches a ContextVar, a lock, a cache or a counter. A call no guarded kernel can take (policy
  ``sdpa``, no guarded kernel, a mask, a full-precision call, a form the op does not take) runs
  ComfyUI's function -- or the chained override -- traced by dynamo: 0 graph breaks added. A call
  a guarded kernel may take is ONE opaque op (opaque_op.py) whose body runs SafeSage's eager path
  at run time. Without ``torch.library.custom_op`` such calls run ComfyUI's function (said once).
* **CUDA-graph capture** (``torch.cuda.is_current_stream_capturing()``, e.g. ComfyUI's
  model_prefetch ``enable_graph``): no stream hop, no probe, no budget read, no host sync. A
  call whose signature was planned earlier, on a family that launches on the caller's stream,
  whose class is already verified and that may still run it (``PlanChoice.usable``), runs that
  plan; every other call runs ComfyUI's own function. The quality guard's choices do not apply here:
  a block it moved (and an exact step) runs the signature's planned kernel. Counted
  (``captured_calls``, ``captured_guarded``) and said once.
* **Nested SafeSage** (another SafeSage is chained below the outermost one, e.g. through a
  foreign override): the outermost decides. It sets the ContextVar :data:`INSIDE` while the
  override it chained runs (and under torch.compile, where no ContextVar is read, passes the
  keyword :data:`INSIDE_KW` to it); a SafeSage reached inside runs what ComfyUI would run --
  its chained override when that runs no unguarded sage / comfy-kitchen kernel, else ComfyUI's
  function -- never a kernel the outer one did not choose, and counts only ``nested_calls``.
"""
from __future__ import annotations

import contextvars
import logging
from typing import Any, Callable

import torch

from ..facts import compiler
from .. import contain
from . import opaque_op
from ..ui import run_stats
from .call_forms import UnsupportedCall, call_arguments, read_form, signature
from .comfy_functions import comfy_function
from .errors import is_cuda_error

log = logging.getLogger("SafeSage")

#: True while a SafeSage override runs the override it chained (eager; read only when not compiling)
INSIDE: contextvars.ContextVar[bool] = contextvars.ContextVar("safesage_inside", default=False)
#: the same, as a keyword of the call, under torch.compile (as ComfyUI's own ``_inside_attn_wrapper``)
INSIDE_KW = "_safesage_inside"

_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)
#: torch's own ``torch.compiler.is_compiling`` (the override's hot path asks it without a frame of its own)
torch_is_compiling = _is_compiling


@contain.boundary
def compiling() -> bool:
    """torch.compile is tracing this call (asked before anything else)."""
    return _is_compiling()


def capturing() -> bool:
    """The current CUDA stream is being captured into a CUDA graph (False on a CPU-only torch)."""
    try:
        return torch.cuda.is_current_stream_capturing()
    except (RuntimeError, AssertionError):     # a torch built without CUDA
        return False


@contain.boundary
def unwrap_attn(func: Any) -> Any:
    """ComfyUI's ``wrap_attn`` wrapper -> the function it wraps (calling the wrapper would enter
    the override again); any other callable as it is."""
    inner = getattr(func, "__wrapped__", None)
    code = getattr(func, "__code__", None)
    if inner is not None and code is not None and "_inside_attn_wrapper" in code.co_consts:
        return inner
    return func


class ContextCalls:
    """SafeAttention's calls in a special context (see the module docstring)."""

    def _init_context(self) -> None:
        self._op_key = opaque_op.register(self)
        # a guarded kernel may take some call (else every call under compile is traced through)
        self._may_guard = self.policy.kernel != "sdpa" and (
            any(f != "sdpa" for f in self.kernels)
            or (self._own_kernels and torch.cuda.is_available() and torch.cuda.device_count() > 1))
        if opaque_op.OP is None and (self._may_guard or self.previous_kind is not None):
            run_stats.once(("no-custom-op",), logging.WARNING,
                        "SafeSage: this torch (%s) has no torch.library.custom_op: under torch.compile its "
                        "attention calls run ComfyUI's own attention function", torch.__version__)

    @property
    def may_guard(self) -> bool:
        """Whether a guarded kernel may take any call of this override (else every call is ComfyUI's own)."""
        return self._may_guard

    def _nested_call(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """An eager call inside another SafeSage (the caller asked: :data:`INSIDE_KW` or :data:`INSIDE`)."""
        run_stats.count("nested_calls")
        run_stats.once(("nested",), logging.INFO, "SafeSage: another SafeSage override runs inside this one "
                    "(through an override chained between them): the outermost decides, the inner one "
                    "runs what ComfyUI would run")
        return self._passthrough(func, args, kwargs, compiled=False)

    def _passthrough(self, func: Callable, args: tuple, kwargs: dict, compiled: bool) -> Any:
        """What ComfyUI would run, and never an unguarded sage / comfy-kitchen kernel: the chained
        override unless it runs one, else ComfyUI's function (attention_pytorch for a sage one)."""
        if self.previous is not None and self.previous_kind is None:
            if compiled:                  # traced: no try/except of run_comfy's
                kwargs[INSIDE_KW] = True
                return self.previous(func, *args, **kwargs)
            return contain.run_comfy(self.previous, func, *args, **kwargs)
        kwargs.pop(INSIDE_KW, None)
        if compiled:
            return comfy_function(func)(*args, **kwargs)
        return contain.run_comfy(self._what_comfy_runs(func), *args, **kwargs)

    # ------------------------------------------------------------------ torch.compile
    def _compiled_call(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """Traced by dynamo: no ContextVar, lock, cache or counter (see the module docstring)."""
        if self.layer_functions:
            func = self._layer_function(kwargs, func)
        c = None
        if (INSIDE_KW not in kwargs and opaque_op.OP is not None
                and (self._may_guard or self.previous_kind is not None)):
            c = opaque_op.read_call(args, kwargs)
        if c is None:
            return self._passthrough(func, args, kwargs, compiled=True)
        return opaque_op.call(self._op_key, func, c)

    # ------------------------------------------------------------------ CUDA-graph capture
    def _captured_call(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        run_stats.count("captured_calls")
        if self.layer_functions:
            func = self._layer_function(kwargs, func)
        run_stats.once(("capture",), logging.INFO, "SafeSage: attention calls during CUDA-graph capture run a "
                    "same-stream kernel planned and verified earlier, else ComfyUI's own function (no stream "
                    "hop, no check, no memory read); the quality guard's choices do not apply there: blocks "
                    "it moved run their planned kernel")
        a = call_arguments(args, kwargs)
        try:
            n = read_form(a, kwargs).bind(a, kwargs)
        except UnsupportedCall:
            n = None
        plan = self._captured_plan(n, func, signature(func, a, kwargs, self._key_alignment)) if n is not None else None
        if plan is not None:
            try:
                out = self.executor.run_captured(plan, n)
            except Exception as e:          # noqa: BLE001 - this call goes to ComfyUI's function
                if is_cuda_error(e):
                    raise
                run_stats.count("captured_errors")
                run_stats.once(("capture-error", plan.kernel, type(e).__name__), logging.WARNING,
                            "SafeSage: %s raised during CUDA-graph capture (%s: %s); ComfyUI's own function runs "
                            "this call", plan.kernel, type(e).__name__, e)
            else:
                run_stats.count("captured_guarded")
                return n.finish(*out)
        return self._passthrough(func, args, kwargs, compiled=False)

    def _captured_plan(self, n, func: Callable, key: tuple | None):
        """The plan prepared earlier for this signature (``key``: its raw signature, else the
        normalised one) when it can run under capture, else None."""
        q = n.q
        if q.shape[2] == 0 or (q.device.type == "cuda" and self.rt.arch is not None
                               and q.device.index not in (None, self._home)
                               and self._guards.get(q.device.index) is not self):
            return None
        p = self._prepared.get(self._call_key(n, func) if key is None else key)
        if p is None or p.func is not func:
            return None
        plan = p.run.get(compiler.run_id()) or p.plan     # this run's plan under ComfyUI's compiler
        kern = self.kernels.get(plan.kernel)
        if plan.kind == "sdpa" or kern is None or kern.envelope.launches_on_legacy_stream:
            return None                 # ComfyUI's own, or a kernel that would need a stream hop
        ck = p.class_keys.get(plan.kernel)
        # checked earlier (no check runs under capture), and may run it: the one rule (PlanChoice.usable)
        if ck is None or self.verifier.needs_probe(ck) or not self.usable(plan.kernel, p.call):
            return None
        return plan
