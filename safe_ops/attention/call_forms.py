"""ComfyUI's attention call -> a normalised call (HND views, no copies), and its result back.

ComfyUI calls ``optimized_attention_override(func, q, k, v, heads, mask=None,
attn_precision=None, skip_reshape=False, skip_output_reshape=False, **kwargs)``; this module
reads those forms (3-d ``[B,S,H*D]`` or, with ``skip_reshape``, 4-d ``[B,H,S,D]``) and shapes a
``[B,H,S,D]`` result the way ComfyUI's attention functions return it.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch

from ..families.envelope import TensorDesc, byte_alignment


def dtype_name(dt: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (how envelopes name dtypes)."""
    return str(dt).replace("torch.", "")


def base_alignment(t: torch.Tensor) -> int:
    """Bytes ``t``'s base pointer is aligned to (at most envelope.ALIGN_CAP): what a kernel that
    checks its base pointer sees (comfy-kitchen's int8 quantisers, #15494). A tensor without an
    address (a fake one) counts its element offset into a storage taken as aligned."""
    if type(t) is not torch.Tensor and _no_address(t):
        return byte_alignment(t.storage_offset() * t.element_size())
    return byte_alignment(t.data_ptr())


def _no_address(t: torch.Tensor) -> bool:
    try:
        from torch._subclasses.fake_tensor import is_fake
        return bool(is_fake(t))
    except Exception:  # noqa: BLE001 - a torch without it: no fake tensors to tell apart
        return False


def describe_tensor(t: torch.Tensor) -> TensorDesc:
    """A tensor's shape, strides and base-pointer alignment, as an envelope sees it."""
    return TensorDesc(tuple(t.shape), tuple(t.stride()), base_alignment(t))


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
    block: int | None = None        # the block it belongs to, while the quality guard runs (quality/)
    run: Any = None                 # the quality guard's state of this sampling run (quality.guard.RunState)

    def finish(self, out_hnd: torch.Tensor) -> torch.Tensor:
        """Shape the [B,H,Sq,D] result the way ComfyUI's attention functions return it."""
        if self.skip_output_reshape:
            return out_hnd
        b, h, s, d = out_hnd.shape
        return out_hnd.transpose(1, 2).reshape(b, s, h * d)


class UnsupportedCall(ValueError):
    """An attention call SafeSage cannot read; it is passed to ComfyUI's own function."""


def call_arguments(args: tuple, kwargs: dict) -> tuple:
    """ComfyUI's ``(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
    skip_output_reshape=False, **kwargs)``, positional or by keyword, as that tuple (plain reads:
    dynamo traces it, see opaque_op.read_call)."""
    na = len(args)
    get = kwargs.get
    return (args[0] if na > 0 else get("q"), args[1] if na > 1 else get("k"), args[2] if na > 2 else get("v"),
            args[3] if na > 3 else get("heads"), args[4] if na > 4 else get("mask"),
            args[5] if na > 5 else get("attn_precision"), args[6] if na > 6 else get("skip_reshape", False),
            args[7] if na > 7 else get("skip_output_reshape", False))


def normalise(args: tuple, kwargs: dict) -> Normalised:
    """ComfyUI's call forms -> HND views of q/k/v (no copies) plus what the output needs."""
    get = kwargs.get
    q, k, v, heads, mask, _, skip_reshape, skip_output_reshape = call_arguments(args, kwargs)
    skip_reshape, skip_output_reshape = bool(skip_reshape), bool(skip_output_reshape)
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


