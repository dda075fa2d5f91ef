"""Which SageAttention kernel family runs for (sage version, GPU arch), and how it is called.

The one place that maps an installed ``sageattention`` to envelope family names
(``envelope.py`` / ``envelope_sage2.py`` describe those families) and to the function and
arguments that run exactly that family. ``runtime`` asks :func:`sage_family_for`; ``kernels``
asks :func:`sage_fns` and :func:`runs_on`.

Read from sageattention 1.0.6 and thu-ml/SageAttention tag ``v2.2.0`` (``core.py`` lines
below; see ``envelope_sage2`` for the source commit).
"""
from __future__ import annotations

from typing import Callable

from ..facts.versions import version_tuple

# What sageattn 2.2.0 runs, by compute capability.
_SAGE22_DISPATCH: dict[tuple[int, int], str] = {
    (8, 0): "sage2_sm80",            # core.py:144-145
    (8, 6): "sage2_sm86_triton",     # core.py:146-147
    (8, 9): "sage2_sm89_fp8pv",      # core.py:148-149
    (9, 0): "sage2_sm90",            # core.py:150-151
    (12, 0): "sage2_sm120_fp8pv",    # core.py:152-153
    # sm121: ValueError at the v2.2.0 tag (core.py:154-155); main after the tag (c03f15f,
    # still version "2.2.0") dispatches it exactly like sm120. If a tag build raises, nothing
    # was launched (a Python ValueError), so mapping it is safe.
    (12, 1): "sage2_sm120_fp8pv",
}

# What to call so that the executed kernel is exactly the envelope (sageattention 2.2.0).
# Signatures (core.py): every function is
#   f(q, k, v, tensor_layout="HND", is_causal=False, [qk_quant_gran=...], sm_scale=None,
#     [pv_accum_dtype=...], smooth_k=True, [smooth_v=False], return_lse=False, **kwargs)
SAGEATTN_CALL: dict[str, tuple[str, dict]] = {
    "sage2_sm80": ("sageattn_qk_int8_pv_fp16_cuda", {"qk_quant_gran": "per_thread", "pv_accum_dtype": "fp32"}),
    "sage2_sm86_triton": ("sageattn_qk_int8_pv_fp16_triton", {"quantization_backend": "triton"}),
    "sage2_sm89_fp8pv": ("sageattn_qk_int8_pv_fp8_cuda", {"qk_quant_gran": "per_thread", "pv_accum_dtype": "fp32+fp16"}),
    "sage2_fp8pv_perwarp": ("sageattn_qk_int8_pv_fp8_cuda", {"qk_quant_gran": "per_warp", "pv_accum_dtype": "fp32+fp16"}),
    "sage2_sm120_fp8pv": ("sageattn_qk_int8_pv_fp8_cuda", {"qk_quant_gran": "per_warp", "pv_accum_dtype": "fp32+fp16"}),
    "sage2_sm90": ("sageattn_qk_int8_pv_fp8_cuda_sm90", {"qk_quant_gran": "per_thread", "pv_accum_dtype": "fp32+fp32"}),
}

# Archs whose extension carries each family's kernels in a 2.2.0 build (setup.py:166, :178, :196).
RUNS_ON: dict[str, tuple[tuple[int, int], ...]] = {
    "sage2_sm80": ((8, 0), (8, 6), (8, 9), (9, 0), (12, 0)),
    "sage2_sm86_triton": ((8, 0), (8, 6), (8, 9), (9, 0)),
    "sage2_sm89_fp8pv": ((8, 9), (9, 0), (12, 0)),
    "sage2_fp8pv_perwarp": ((8, 9), (9, 0), (12, 0)),
    "sage2_sm120_fp8pv": ((12, 0), (12, 1)),
    "sage2_sm90": ((9, 0),),
}

SAGE1 = "sage1_triton"


def sage_family_for(version: str | None, arch: tuple[int, int] | None) -> str | None:
    """Which envelope family ``sageattn`` of ``version`` runs on compute capability ``arch``.

    1.x -> "sage1_triton" (Triton; int8 tl.dot needs sm80+). 2.2.x -> the table above. 2.0.x/2.1.x
    have other dispatchers and kernels (2.1.0 sends sm89 to pv fp32+fp32, 2.0.1 sends sm90 to the
    fp16 CUDA kernel) and were not read: None, i.e. not known to be safe. None for an unsupported
    arch, an unparsable version, or no arch.
    """
    v = version_tuple(version)
    if not v or arch is None:
        return None
    arch = (int(arch[0]), int(arch[1]))
    if v[0] == 1:
        return SAGE1 if arch >= (8, 0) else None
    if v[:2] == (2, 2):
        return _SAGE22_DISPATCH.get(arch)
    return None


def runs_on(family: str, arch: tuple[int, int] | None) -> bool:
    """Whether a sage 2.2 build carries ``family``'s kernels on ``arch`` (callable directly,
    whatever ``sageattn`` itself dispatches to there)."""
    return arch is not None and tuple(arch) in RUNS_ON.get(family, ())


def sage_fns(family: str) -> tuple[Callable, Callable | None] | None:
    """``(fn, fn_lse)`` running exactly ``family`` through the installed sageattention, each
    ``f(q, k, v, layout, scale)``; None when it is not installed or lacks the function.

    sage 1.x: ``sageattn`` with ``smooth_k=False`` (as ComfyUI calls it; 1.x would otherwise
    subtract the mean from the caller's k in place), no LSE. sage 2.2: the per-family function
    ``sageattn`` itself dispatches to, with explicit arguments (:data:`SAGEATTN_CALL`); 2.2's
    ``sageattn`` drops ``smooth_k``, so the functions' own default (on) is kept, as in ComfyUI.
    ``fn_lse`` (for kv_chunks) calls the same function with ``return_lse=True`` and
    ``smooth_k=False`` on keys the plan already centred (``Envelope.lse_centred_k``).
    """
    try:
        import sageattention
    except Exception:
        return None
    if family == SAGE1:
        sageattn = getattr(sageattention, "sageattn", None)
        if sageattn is None:
            return None

        def fn1(q, k, v, layout, scale):
            return sageattn(q, k, v, tensor_layout=layout, is_causal=False, sm_scale=scale, smooth_k=False)

        return fn1, None
    if family not in SAGEATTN_CALL or not hasattr(sageattention, SAGEATTN_CALL[family][0]):
        return None
    name, extra = SAGEATTN_CALL[family]
    f = getattr(sageattention, name)

    def fn(q, k, v, layout, scale):
        return f(q, k, v, tensor_layout=layout, is_causal=False, sm_scale=scale, **extra)

    def fn_lse(q, k, v, layout, scale):
        # keys arrive centred on the whole sequence's mean (Envelope.lse_centred_k): no
        # per-chunk smoothing, and core.py returns lse / log2(e) with no rounded correction
        return f(q, k, v, tensor_layout=layout, is_causal=False, sm_scale=scale,
                 return_lse=True, **{**extra, "smooth_k": False})

    return fn, fn_lse
