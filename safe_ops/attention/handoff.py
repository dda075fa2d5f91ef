"""What runs a call SafeSage gives to no guarded kernel (a mixin of override.SafeAttention).

* ComfyUI's own function for the call (``func``, or the layer's own ``comfy_attention``), except
  that an unguarded sage / comfy-kitchen function is replaced by ComfyUI's ``attention_pytorch``
  (comfy_functions.comfy_function), looked up once per function.
* The override that was on the model before SafeSage (``previous``, chained) in its place --
  unless it would run an unguarded sage / comfy-kitchen kernel on a call outside that kernel's
  limits, where SafeSage runs ComfyUI's function instead and says so once.
* After an error of SafeSage's own (the containment boundary, contain.py): what ComfyUI would
  run, with as little of SafeSage's code as can be.

Every call into ComfyUI's code from here goes through contain.run_comfy, so that ComfyUI's own
errors pass the boundary untouched.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from .. import contain
from ..families.envelope import FAMILIES, check
from ..ui import run_stats
from .call_forms import Normalised
from .comfy_functions import comfy_function, function_name
from .plans import shape_key
from .special_calls import INSIDE


class ComfyCalls:
    """SafeAttention's calls handed to ComfyUI (see the module docstring)."""

    @contain.boundary
    def _contained(self, e: Exception, func: Callable, kwargs: dict) -> Callable:
        """An error anywhere in SafeSage's code for this call (reading the call, the layer's
        function, the chained override's check, the output's shape, ...): raised again when it is
        ComfyUI's own (its attention function or the chained override raised it) or a sticky CUDA
        error; else counted, logged once, and the call runs what ComfyUI would run -- with as
        little of SafeSage's code as can be: the chained override (ComfyUI's function in its place
        when it runs an unguarded sage / comfy-kitchen kernel, whose limits are not checked here),
        else ComfyUI's ``func`` (ComfyUI's attention_pytorch in place of an unguarded kernel)."""
        if contain.not_ours(e):
            raise e
        contain.internal_error(e, "the attention override", "this call runs ComfyUI's own attention")
        f = func
        try:
            if self.layer_functions:
                f = self._layer_function(kwargs, func)
        except Exception:  # noqa: BLE001 - ComfyUI's func, as ComfyUI hands it
            f = func
        if self.previous is not None and self.previous_kind is None:
            previous = self.previous

            def run_previous(*args, **kw):       # as _run_comfy: a SafeSage below it passes through
                token = INSIDE.set(True)
                try:
                    return previous(f, *args, **kw)
                finally:
                    INSIDE.reset(token)
            return run_previous
        try:
            f = comfy_function(f) or f
        except Exception:  # noqa: BLE001 - what ComfyUI itself would run
            pass
        return f

    def _layer_function(self, kwargs: dict, func: Callable) -> Callable:
        to = kwargs.get("transformer_options") or {}
        f = self.layer_functions.get(to.get("block_index"))
        return func if f is None else f

    def _what_comfy_runs(self, func: Callable | None) -> Callable | None:
        """ComfyUI's ``func``, or ComfyUI's attention_pytorch when ``func`` is unguarded sage/kitchen."""
        hit = self._comfy_fns.get(id(func))
        if hit is None or hit[0] is not func:
            hit = self._remember(self._comfy_fns, id(func), (func, comfy_function(func)))  # bounded
        return hit[1]

    def comfy_runs(self, func: Callable | None) -> Callable | None:
        """What ComfyUI runs for ``func`` (its function; attention_pytorch for an unguarded sage /
        comfy-kitchen one): the quality guard's reference."""
        return self._what_comfy_runs(func)

    def _run_comfy(self, func: Callable, args: tuple, kwargs: dict, n: Normalised | None) -> Any:
        """A call no guarded kernel takes: the chained override, else what ComfyUI would run."""
        if self.previous is not None and not self._previous_unsafe(n, func):
            token = INSIDE.set(True)            # a SafeSage below it passes through (special_calls.py)
            try:
                return contain.run_comfy(self.previous, func, *args, **kwargs)
            finally:
                INSIDE.reset(token)
        return contain.run_comfy(self._what_comfy_runs(func), *args, **kwargs)

    def _previous_unsafe(self, n: Normalised | None, func: Callable) -> bool:
        """The chained override runs an unguarded sage / comfy-kitchen kernel, and this call is
        outside that kernel's limits (the installed family's envelope): then SafeSage decides."""
        kind = self.previous_kind
        if kind is None or n is None:
            return False
        rt = (self._guard_for(n.q4.device) or self).rt      # the facts of the GPU this call runs on
        fam = rt.sage_family if kind == "sage" else rt.ck_family
        env = FAMILIES.get(fam) if fam else None
        if env is None:
            return False            # no such kernel usable here: nothing of its limits to judge
        p = n.prepared
        call = p.call if p is not None else self._describe(n)
        if p is None or p.previous_viol is None:
            viol = check(call, env)           # once per call signature
            if p is not None:
                p.previous_viol = viol
        else:
            viol = p.previous_viol
        if not viol:
            return False
        run_stats.count("previous_overruled")
        run_stats.once(("previous-unsafe", fam, shape_key(call, n)), logging.WARNING,
                    "SafeSage: the attention override before it (%s) would run %s unguarded on %s, outside its "
                    "limits (%s); SafeSage runs %s for this call instead", function_name(self.previous), fam,
                    shape_key(call, n), "; ".join(str(v) for v in viol[:2]),
                    function_name(self._what_comfy_runs(func)))
        return True
