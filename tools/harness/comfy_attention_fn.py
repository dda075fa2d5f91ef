"""ComfyUI's own wrap_attn-wrapped ``attention_pytorch`` for the unit tests (CPU), or a stand-in.

With COMFYUI_PATH pointing at a ComfyUI tree, ``attention()`` is that tree's
``comfy.ldm.modules.attention.attention_pytorch`` (imported with ``--cpu``); without one, a
stand-in with the same contract: ``wrap_attn`` (modelled on ComfyUI's: hands the call to
``transformer_options["optimized_attention_override"](func, ...)`` once, marking the kwargs
with ``_inside_attn_wrapper``) around PyTorch SDPA.
"""
from __future__ import annotations

import functools
import os
import sys

import torch


def _real():
    path = os.environ.get("COMFYUI_PATH")
    if not path or not os.path.isfile(os.path.join(path, "comfy", "ldm", "modules", "attention.py")):
        return None, "COMFYUI_PATH not set"
    if path not in sys.path:
        sys.path.insert(0, path)
    try:
        import comfy.cli_args
        comfy.cli_args.args.cpu = True          # before comfy.model_management is imported
        import comfy.ldm.modules.attention as att
    except Exception as e:  # noqa: BLE001 - the stand-in is used, and the reason printed
        return None, f"ComfyUI's attention module does not import: {e!r}"
    f = getattr(att, "attention_pytorch", None)
    if f is None or getattr(f, "__wrapped__", None) is None:
        return None, "this ComfyUI's attention_pytorch is not wrap_attn-wrapped"
    return f, None


def wrap_attn(func):
    """Stand-in for ComfyUI's wrap_attn (comfy/ldm/modules/attention.py)."""
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        remove = False
        try:
            if "_inside_attn_wrapper" not in kwargs:
                to = kwargs.get("transformer_options", None)
                remove = True
                kwargs["_inside_attn_wrapper"] = True
                if to is not None and "optimized_attention_override" in to:
                    return to["optimized_attention_override"](func, *args, **kwargs)
            return func(*args, **kwargs)
        finally:
            if remove:
                del kwargs["_inside_attn_wrapper"]
    return wrapper


@wrap_attn
def attention_pytorch(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                      skip_output_reshape=False, **kwargs):
    """Stand-in for ComfyUI's attention_pytorch: SDPA, [B,S,H*D] or [B,H,S,D] in and out."""
    if not skip_reshape:
        b, _, hd = q.shape
        d = hd // heads
        q, k, v = (t.view(b, -1, t.shape[-1] // d, d).transpose(1, 2) for t in (q, k, v))
    sdpa_extra = {kk: vv for kk, vv in kwargs.items() if kk in ("scale", "enable_gqa")}
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, **sdpa_extra)
    if not skip_output_reshape:
        out = out.transpose(1, 2).reshape(out.shape[0], -1, out.shape[1] * out.shape[3])
    return out


_REAL, WHY_STAND_IN = _real()


def attention():
    """(ComfyUI's attention_pytorch or the stand-in, a label saying which)."""
    if _REAL is not None:
        return _REAL, "ComfyUI's attention_pytorch (%s)" % os.environ.get("COMFYUI_PATH")
    return attention_pytorch, "stand-in attention_pytorch (%s)" % WHY_STAND_IN
