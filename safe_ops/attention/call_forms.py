"""ComfyUI's attention call -> a normalised call (HND views, no copies), and its result back.

ComfyUI calls ``optimized_attention_override(func, q, k, v, heads, mask=None,
attn_precision=None, skip_reshape=False, skip_output_reshape=False, **kwargs)``; this module
reads those forms (3-d ``[B,S,H*D]`` or, with ``skip_reshape``, 4-d ``[B,H,S,D]``) and shapes a
``[B,H,S,D]`` result the way ComfyUI's attention functions return it.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..families.envelope import TensorDesc


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
    prepared: Any = None            # what attention.SafeAttention worked out for this call signature

    def finish(self, out_hnd: torch.Tensor) -> torch.Tensor:
        """Shape the [B,H,Sq,D] result the way ComfyUI's attention functions return it."""
        if self.skip_output_reshape:
            return out_hnd
        b, h, s, d = out_hnd.shape
        return out_hnd.transpose(1, 2).reshape(b, s, h * d)



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
    if isinstance(heads, bool):              # operator.index(True) is 1
        raise UnsupportedCall(f"heads must be a positive int, got {heads!r}")
    try:
        heads = operator.index(heads)        # an int, or an integer-like such as numpy.int64
    except TypeError:
        raise UnsupportedCall(f"heads must be a positive int, got {heads!r}") from None
    if heads < 1:
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
    if (qh.shape[0] != kh.shape[0] or kh.shape[:3] != vh.shape[:3] or qh.shape[3] != kh.shape[3]
            or vh.shape[3] != qh.shape[3]):
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



# ------------------------------------------------------------------ what ComfyUI would run
#: ComfyUI's own attention functions that run a sage or comfy-kitchen kernel without a guard
#: (comfy/ldm/modules/attention.py), by kind; looked up lazily, where this ComfyUI has them
UNGUARDED = (("attention_sage", "sage"), ("attention3_sage", "sage"), ("attention_comfy_kitchen_int8", "ck"))


def _comfy_attention_module():
    import sys
    return sys.modules.get("comfy.ldm.modules.attention")


def _name_kind(fn: Any) -> str | None:
    """Other packs' wrappers, by name (the rule ComfyUI's own function names follow)."""
    if getattr(fn, "_safesage_guarded", False):
        return None
    name = getattr(fn, "__name__", None)
    names = (name if isinstance(name, str) else type(fn).__name__).lower()
    if "sage" in names:
        return "sage"
    if "kitchen" in names:
        return "ck"
    return None


def unguarded_kind(fn: Any) -> str | None:
    """"sage" / "ck" when calling ``fn`` runs an unguarded SageAttention / comfy-kitchen kernel, else
    None: identity with ComfyUI's own ``attention_sage`` / ``attention3_sage`` /
    ``attention_comfy_kitchen_int8`` (wrapped or inner), or, for other packs' functions and
    overrides, the name rule -- looking through ``__wrapped__`` and one level of closure (core's
    ``set_model_optimized_attention`` override closes over the function it runs)."""
    if fn is None or getattr(fn, "_safesage_guarded", False):
        return None
    att = _comfy_attention_module()
    cands = [fn, getattr(fn, "__wrapped__", None)] + _closed_over(fn)
    for c in cands:
        if c is None:
            continue
        for name, kind in UNGUARDED:
            own = getattr(att, name, None) if att is not None else None
            if own is not None and (c is own or c is getattr(own, "__wrapped__", None)):
                return kind
    for c in cands:
        if c is not None and not _is_comfy_own(c, att):
            kind = _name_kind(c)
            if kind is not None:
                return kind
    return None


def _closed_over(fn) -> list:
    """The callables ``fn`` closes over (one level; empty cells skipped)."""
    out = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:           # an empty cell
            continue
        if callable(value):
            out.append(value)
    return out


def _is_comfy_own(fn, att) -> bool:
    """One of ComfyUI's own attention functions (its name says what it is, and it is not sage)."""
    if att is None:
        return False
    name = getattr(fn, "__name__", None)
    own = getattr(att, name, None) if isinstance(name, str) else None
    return own is not None and (fn is own or fn is getattr(own, "__wrapped__", None))


def comfy_pytorch_attention() -> Callable | None:
    """ComfyUI's own ``attention_pytorch`` (its inner function), or None outside ComfyUI."""
    att = _comfy_attention_module()
    f = getattr(att, "attention_pytorch", None) if att is not None else None
    return getattr(f, "__wrapped__", f)


def comfy_function(func: Callable | None) -> Callable | None:
    """What runs a call that no guarded kernel takes: ComfyUI's ``func`` -- unless ``func`` itself
    runs an unguarded sage / comfy-kitchen kernel, then ComfyUI's own ``attention_pytorch``."""
    if func is None or unguarded_kind(func) is None:
        return func
    return comfy_pytorch_attention() or func


def function_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
