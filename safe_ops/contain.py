"""The containment boundary: an error in SafeSage's own code never fails a prompt.

SafeSage's code on a prompt's path is entered in three places, each one boundary: where the SafeSage
Attention node runs (patch.apply_node), and, while sampling, the attention override
(attention.SafeAttention.__call__) and the patched H3 MLP forward
(mlp_patch.H3ChunkedMLPForward.__call__). Each catches what SafeSage's code raised, counts it
(``internal_errors``), logs it once with its traceback, and runs what ComfyUI would have run
instead: the node gives back the model it was given (never a half-patched clone), or the patched
clone with the failed part left out of its status. What ComfyUI's own code raises passes through
untouched -- its ``InterruptProcessingException``, an out-of-memory ComfyUI itself would have
raised -- so every call SafeSage makes into ComfyUI (its attention function, a chained override,
its MLP forward per chunk) goes through :func:`run_comfy`, which marks such an exception as not
SafeSage's. A sticky CUDA error passes through too: nothing can be recomputed after it. (What the
node calls of ComfyUI's -- the model's clone, its wrapper and patch registration -- neither checks
for an interrupt nor allocates: an error there is contained, the model given back unpatched.)

This module and ui/run_stats.py are the boundary's own code (the fault-injection suites,
tests/comfy/test_fault_injection.py for the sampling run and tests/unit/test_node_contained.py for
the node's run, raise in every other function of safe_ops/ and nodes/ that runs during a prompt;
functions marked with :func:`boundary` are excepted as well).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable

from .ui import run_stats
from .attention.errors import is_cuda_error

log = logging.getLogger("SafeSage")

_NOT_OURS = "_safesage_not_ours"
_PACK = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: SafeSage's own code: the shipped safe_ops/ and nodes/ (not bench/ or tests/, whose stand-ins of
#: ComfyUI's functions live in the same checkout)
_OWN = tuple(os.path.join(_PACK, d) + os.sep for d in ("safe_ops", "nodes"))
_in_pack_cache: dict[str, bool] = {}


def boundary(fn: Callable) -> Callable:
    """Mark ``fn`` as part of the containment boundary (the function itself is returned)."""
    fn._safesage_boundary = True
    return fn


def _in_pack(filename: str) -> bool:
    hit = _in_pack_cache.get(filename)
    if hit is None:
        path = os.path.abspath(filename)
        hit = _in_pack_cache[filename] = path.startswith(_OWN)
        run_stats.trim(_in_pack_cache)
    return hit


def _raised_in_pack(e: BaseException) -> bool:
    """The innermost frame of ``e``'s traceback is SafeSage's code (e.g. a SafeSage wrapper that
    ComfyUI's code called), not ComfyUI's or torch's."""
    tb, last = e.__traceback__, None
    while tb is not None:
        last, tb = tb, tb.tb_next
    return last is not None and _in_pack(last.tb_frame.f_code.co_filename)


def run_comfy(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` for ComfyUI's own code (or a chained override) called from inside
    a boundary: an exception it raises is marked as not SafeSage's, so that the boundary lets it
    through untouched -- unless it was raised in SafeSage's own code that ComfyUI's called."""
    try:
        return fn(*args, **kwargs)
    except BaseException as e:
        if not getattr(e, _NOT_OURS, False) and not _raised_in_pack(e):
            try:
                setattr(e, _NOT_OURS, True)
            except Exception:  # noqa: BLE001 - an exception type without attributes: not marked
                pass
        raise


def not_ours(e: BaseException) -> bool:
    """ComfyUI's own exception (raised in code called through :func:`run_comfy`), or a sticky
    CUDA error: the boundary must raise it, not recompute."""
    if getattr(e, _NOT_OURS, False):
        return True
    try:
        return is_cuda_error(e)
    except Exception:  # noqa: BLE001 - the check itself failed: contained as SafeSage's
        return False


def internal_error(e: Exception, what: str, runs: str, stats: run_stats.Section | None = None,
                   where: str = "") -> None:
    """Count (``internal_errors``: the store's, or ``stats``' section's), log once with its
    traceback, and record as a fallback an error of SafeSage's own code in ``what`` (e.g. "the
    attention override"); ``runs`` says what runs instead. Never raises."""
    try:
        if stats is None:
            run_stats.count("internal_errors")
        else:
            stats.bump("internal_errors")
    except Exception:  # noqa: BLE001
        pass
    try:
        key = ("internal", what, type(e).__name__, str(e)[:120])
        if run_stats.once(key, logging.DEBUG, "internal error"):
            log.error("SafeSage: internal error in %s%s (please report it, with this traceback); %s",
                      what, f" on {where}" if where else "", runs, exc_info=e)
        if stats is None:
            run_stats.fallback(f"SafeSage internal error in {what}: {type(e).__name__}: {e}", where or None)
        else:
            stats.fallback(f"SafeSage internal error: {type(e).__name__}: {e}")
    except Exception:  # noqa: BLE001 - the log must not fail the prompt either
        pass
