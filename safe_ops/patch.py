"""Apply SafeSage to a ComfyUI ModelPatcher: clone, override attention, patch H3 MLPs, drain fences.

ComfyUI is imported lazily and every hook is looked up with ``getattr`` so the
pack loads on ComfyUI 0.3.75 (no MiniMax H3, no dynamic VRAM) and on 0dd9b154+.
Idempotent: applying twice (or to a clone of a patched model) replaces the
pack's own hooks under fixed keys; another pack's attention override is
reported, not silently dropped.
"""
from __future__ import annotations

import logging
from typing import Any

from . import report
from .attention import SafeAttention
from .fences import GLOBAL_FENCES
from .mlp_patch import install_h3_mlp_patches
from .policy import Policy
from .runtime import explain_auto, runtime

log = logging.getLogger("SafeSage")

OVERRIDE_KEY = "optimized_attention_override"
WRAPPER_KEY = "safesage"


class SafeSageError(RuntimeError):
    """A choice on the node that cannot be honoured here; the message says what to do."""


def _poll_wrapper(executor, *args, **kwargs):
    """DIFFUSION_MODEL wrapper: run the forward, then release the fences whose work is done."""
    try:
        return executor(*args, **kwargs)
    finally:
        GLOBAL_FENCES.poll()
        report.count("forwards")


def _drain_wrapper(executor, *args, **kwargs):
    """OUTER_SAMPLE wrapper: run the sampling, then wait for and release every fence, so no
    memory held for a kernel outlives the run (also when sampling raised)."""
    try:
        return executor(*args, **kwargs)
    finally:
        GLOBAL_FENCES.drain()
        report.count("sampling_runs")


# wrapper type (name in comfy.patcher_extension.WrappersMP) -> wrapper
WRAPPERS = {"DIFFUSION_MODEL": _poll_wrapper, "OUTER_SAMPLE": _drain_wrapper}


def apply_safesage(model_patcher: Any, policy: Policy = Policy()) -> tuple[Any, dict]:
    """Return a patched clone of ``model_patcher`` and a summary (``summary["text"]`` for humans)."""
    rt = runtime()
    lines = [f"SafeSage: {rt.summary()}"]
    warnings: list[str] = []
    if policy.kernel == "sage" and rt.sage_family is None:
        raise SafeSageError(
            f"kernel='sage' was chosen but SageAttention cannot run here: {rt.sage_error}. "
            "Install a sageattention build that matches your torch/CUDA (see the pack README), "
            "or set kernel to 'auto' (uses SageAttention when it is usable, else PyTorch SDPA).")

    m = model_patcher.clone()
    to = m.model_options.setdefault("transformer_options", {})
    prev = to.get(OVERRIDE_KEY)
    if prev is not None and not isinstance(prev, SafeAttention):
        warnings.append(f"replaced another attention override ({getattr(prev, '__qualname__', prev)!r}); "
                        "put SafeSage after that node only if you want SafeSage to decide attention")
    attn = SafeAttention(policy, fences=GLOBAL_FENCES, rt=rt)
    to[OVERRIDE_KEY] = attn

    # Poll fences after every diffusion-model forward and drain them when sampling ends
    # (idempotent: removed, then added under a fixed key).
    wrappers_mp = None
    try:
        from comfy.patcher_extension import WrappersMP as wrappers_mp  # type: ignore
    except Exception:
        pass
    installed = []
    if wrappers_mp is not None and hasattr(m, "add_wrapper_with_key"):
        for name, fn in WRAPPERS.items():
            wtype = getattr(wrappers_mp, name, None)
            if wtype is None:
                continue
            if hasattr(m, "remove_wrappers_with_key"):
                m.remove_wrappers_with_key(wtype, WRAPPER_KEY)
            m.add_wrapper_with_key(wtype, WRAPPER_KEY, fn)
            installed.append(name)
    if "OUTER_SAMPLE" not in installed:
        warnings.append("this ComfyUI has no OUTER_SAMPLE wrapper; fences are released by polling and "
                        "their count/byte caps only")

    # Always called: with "off" it removes MLP patches an earlier SafeSage node left on this model.
    setting: Any = policy.mlp_chunk_tokens if policy.mlp_chunking == "tokens" else policy.mlp_chunking
    mlp_summary = install_h3_mlp_patches(m, setting)
    if policy.mlp_chunking == "off":
        mlp_summary["skipped"] = "MLP chunking off" + (f" (removed {mlp_summary['removed']} earlier patches)"
                                                       if mlp_summary.get("removed") else "")
    for c in mlp_summary.get("conflicts", []) or []:
        warnings.append(f"MLP patch conflict: {c}")
    report.set_info("mlp_patched", mlp_summary.get("patched", 0))

    # ComfyUI's own choice (--use-sage-attention / --use-ck-attention) read from its flags
    cand = attn.candidates(None)
    lines.append(f"kernel policy '{policy.kernel}': preference {' > '.join(cand)}")
    lines.append(explain_auto(rt, [f for f in attn.kernels if f != "sdpa"], None, policy.kernel))
    if rt.sage_family is None and policy.kernel == "auto":
        lines.append(f"SageAttention not used: {rt.sage_error}"
                     + ("; attention runs on PyTorch SDPA" if cand[0] == "sdpa" else ""))
    lines.append(f"verify: {policy.verify}; debug_sync: {'on' if policy.debug_sync else 'off'}")
    if mlp_summary.get("patched"):
        lines.append(f"H3 MLPs patched: {mlp_summary['patched']} (chunking {policy.mlp_chunking})")
    else:
        lines.append(f"H3 MLPs not patched: {mlp_summary.get('skipped')}")
    for w in warnings:
        lines.append("WARNING: " + w)
        log.warning("SafeSage: %s", w)
    text = "\n".join(lines)
    log.info("%s", text)
    return m, {"text": text, "runtime": rt.summary(), "candidates": cand, "mlp": mlp_summary,
               "warnings": warnings}
