"""The hook at yunchang's kernel selection: where xFuser's and yunchang's ranks pick sage.

Every sequence-parallel attention of xFuser (``xFuserLongContextAttention`` -> its ring function,
also at ring degree 1) and of yunchang (``LongContextAttention`` -> ``ring_flash_attn_func``) gets its
per-rank kernel from ``yunchang.kernels.select_flash_attn_impl(attn_type, stage="fwd-only")``, once
per key chunk; for yunchang's sage ``AttnType``s that is a ``functools.partial`` of a sageattention
function with ``tensor_layout="NHD", return_lse=True``. :func:`install` wraps that selection -- in
``yunchang.kernels`` and in every loaded module that imported the name (xFuser's ring module does:
``from yunchang.kernels import select_flash_attn_impl``; modules imported later take the wrapped one)
-- and hands back a :class:`~.rank_kernel.GuardedRankKernel` around the selected sage function,
holding it to the SafeSage family that runs the same kernels:

  sageattn                              the family sageattn dispatches to on the GPU (facts.devices)
  sageattn_qk_int8_pv_fp16_cuda         sage2_sm80 (yunchang: per_thread, pv fp32, as sageattn on sm80)
  sageattn_qk_int8_pv_fp16_triton       sage2_sm86_triton
  sageattn_qk_int8_pv_fp8_cuda          sage2_sm89_fp8pv; with qk_quant_gran='per_warp' sage2_fp8pv_perwarp
  sageattn_qk_int8_pv_fp8_cuda_sm90     sage2_sm90

(yunchang's fp8 types ask for pv_accum_dtype 'fp32+fp32' where sageattn uses 'fp32+fp16': the same
kernels and index arithmetic, another accumulator; the tolerance checked is the family's.) Any other
selection -- flash-attn, torch, another stage -- is handed back untouched. The mapping reads the
selected function's name, not the ``AttnType`` name, so it holds across yunchang's renamings
(raylight names ``SAGE_FP8_CUDA``). Install is idempotent (the wrapper remembers the original);
:func:`uninstall` restores every module it changed.
"""
from __future__ import annotations

import functools
import logging
import sys
import threading
from typing import Any, Callable

from .rank_kernel import GuardedRankKernel, default_agree

log = logging.getLogger("SafeSage")

SELECT = "select_flash_attn_impl"
MODULE = "yunchang.kernels"

#: sage function -> SafeSage family name (None: sageattn, the GPU's dispatch family)
SAGE_FUNCTIONS: dict[str, str | None] = {
    "sageattn": None,
    "sageattn_qk_int8_pv_fp16_cuda": "sage2_sm80",
    "sageattn_qk_int8_pv_fp16_triton": "sage2_sm86_triton",
    "sageattn_qk_int8_pv_fp8_cuda": "sage2_sm89_fp8pv",
    "sageattn_qk_int8_pv_fp8_cuda_sm90": "sage2_sm90",
}

_lock = threading.Lock()
_state: dict[str, Any] = {"original": None, "patched": [], "wrapper": None}


def family_name(fn: Any) -> tuple[bool, str | None]:
    """(is a sage function SafeSage guards, its family name or None for sageattn's dispatch)."""
    if not isinstance(fn, functools.partial):
        return False, None
    name = getattr(fn.func, "__name__", "")
    if name not in SAGE_FUNCTIONS:
        return False, None
    fam = SAGE_FUNCTIONS[name]
    if fam == "sage2_sm89_fp8pv" and fn.keywords.get("qk_quant_gran") == "per_warp":
        fam = "sage2_fp8pv_perwarp"
    return True, fam


def _shipped_family(name: str | None) -> Callable:
    """``device -> KernelFamily | None`` for a family name (None: the runtime's sage family)."""
    def resolve(device):
        from ..facts.devices import runtime
        from ..families.registry import family
        fam = name if name is not None else runtime(device).sage_family
        return family(fam)
    return resolve


def _site(device, family: str) -> str:
    if device.type != "cuda":
        return device.type
    from ..facts.devices import runtime
    return runtime(device).kernel_site(family)


def make_select(original: Callable, families: dict | None = None, agree: Callable | None = None) -> Callable:
    """The wrapped ``select_flash_attn_impl``. ``families``: sage function name -> KernelFamily, for
    families SafeSage does not ship (the CPU tests' scaled-down ones); otherwise SAGE_FUNCTIONS."""
    verdicts: dict = {}                       # one per hook: a class checked once for every selection
    kernels: dict = {}
    agree = agree or default_agree()

    @functools.wraps(original)
    def select_flash_attn_impl(impl_type, stage="fwd-bwd", attn_processor=None, *args, **kwargs):
        fn = original(impl_type, stage, attn_processor, *args, **kwargs)
        try:
            if stage != "fwd-only":
                return fn
            guarded, fam = family_name(fn)
            if not guarded:
                return fn
            name = fn.func.__name__
            kk = (name, id(fn.func), tuple(sorted(fn.keywords.items())))
            g = kernels.get(kk)
            if g is None:
                given = (families or {}).get(name)
                resolve = given if given is not None else _shipped_family(fam)
                g = kernels[kk] = GuardedRankKernel(fn, resolve, site=_site, agree=agree, verdicts=verdicts)
            return g
        except Exception as e:  # noqa: BLE001 - never fail yunchang's selection: its own fn runs
            from .. import contain
            contain.internal_error(e, "the sequence-parallel kernel selection", "the sage kernel runs unguarded")
            return fn

    select_flash_attn_impl._safesage_original = original
    return select_flash_attn_impl


def install(families: dict | None = None, agree_group: Any = None, agree: Callable | None = None) -> bool:
    """Guard yunchang's sage selections in this process (module docstring). False when yunchang is
    not importable here (nothing to guard). ``agree_group``: the ranks that agree on a first-call
    verdict (None: torch.distributed's default group -- every rank runs the same calls)."""
    try:
        import yunchang.kernels as kernels_mod       # MODULE
    except Exception as e:  # noqa: BLE001 - no yunchang (or a broken one): nothing runs sage there
        log.info("SafeSage: %s not importable (%s: %s): no sequence-parallel attention to guard",
                 MODULE, type(e).__name__, e)
        return False
    with _lock:
        current = getattr(kernels_mod, SELECT)
        original = getattr(current, "_safesage_original", current)
        if _state["wrapper"] is not None:
            _uninstall_locked()
        wrapper = make_select(original, families, agree or default_agree(agree_group))
        patched = []
        for mod in list(sys.modules.values()):
            name = getattr(mod, "__name__", "") or ""
            if not name.startswith(("yunchang", "xfuser")):
                continue
            held = getattr(mod, SELECT, None)
            if held is original or getattr(held, "_safesage_original", None) is original:
                setattr(mod, SELECT, wrapper)
                patched.append(mod)
        _state.update(original=original, patched=patched, wrapper=wrapper)
    log.info("SafeSage: guarding sage in sequence-parallel attention (%s in %d module(s))",
             SELECT, len(patched))
    return True


def _uninstall_locked() -> None:
    for mod in _state["patched"]:
        if getattr(mod, SELECT, None) is _state["wrapper"]:
            setattr(mod, SELECT, _state["original"])
    _state.update(original=None, patched=[], wrapper=None)


def uninstall() -> None:
    """Give every module its own ``select_flash_attn_impl`` back."""
    with _lock:
        _uninstall_locked()


def installed() -> bool:
    return _state["wrapper"] is not None
