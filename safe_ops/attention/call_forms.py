"""ComfyUI's attention call -> a normalised call (views in the caller's layout, no copies), and
its result back.

ComfyUI calls ``optimized_attention_override(func, q, k, v, heads, mask=None,
attn_precision=None, skip_reshape=False, skip_output_reshape=False, **kwargs)``; this module
reads those forms (3-d ``[B,S,H*D]`` or, with ``skip_reshape``, 4-d ``[B,H,S,D]``) and shapes a
kernel's result the way ComfyUI's attention functions return it. A call is read in full once per
:func:`signature` (:func:`read_form`); the next call of that signature is bound to its
:class:`CallForm` without being read again -- as many view operations as ComfyUI's own sage path
makes (3 views in, 1 flatten out for the 3-d form; none for H3's 4-d views).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch

from ..families.envelope import ALIGN_CAP, TensorDesc, byte_alignment


#: transformer_options: the index of the base model's block running now, None between blocks (set by
#: quality/blocks.py around each H3 block SafeSage marks); a call under another index, or None, is
#: another tower's (the quality guard neither measures nor moves it)
BASE_KEY = "safesage_base_block"


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


@dataclass(frozen=True)
class CallForm:
    """How the calls of one signature are read: what :func:`normalise` found, minus the tensors.
    :meth:`bind` makes the next call's :class:`Normalised` without reading the call again (the
    attention override's fast path: a plan is cached per :func:`signature`)."""
    layout: str                       # the q/k/v views' layout: NHD for the 3-d form, HND for the 4-d one
    heads: int                        # q's heads
    views: tuple | None               # the 3-d form's NHD view shapes of q, k, v; None for the 4-d form
    skip_output_reshape: bool
    low_precision_ok: bool

    def bind(self, a: tuple, kwargs: dict) -> "Normalised":
        """The Normalised of a call (``a``: :func:`call_arguments`) of this form's signature."""
        q, k, v = a[0], a[1], a[2]
        views = self.views
        if views is not None:
            # view(*shape): PyTorch parses varargs faster than one tuple (0.95 vs 1.45 us on this CPU)
            q, k, v = q.view(*views[0]), k.view(*views[1]), v.view(*views[2])
        return Normalised(q, k, v, self.layout, self.heads, a[4], kwargs.get("scale"), self.skip_output_reshape,
                          self.low_precision_ok, self)


class Normalised:
    """One attention call, read: q/k/v as 4-d views in ``layout``, no copies -- NHD [B,S,H,D] for
    ComfyUI's 3-d form (the views ComfyUI's own sage path makes), HND [B,H,S,D] for the 4-d one.
    ``q``/``k``/``v`` are the HND views, made on first use: a kernel run in the caller's layout
    never needs them (:meth:`in_layout`), and its output goes back without a round trip
    (:meth:`finish`)."""

    __slots__ = ("q4", "k4", "v4", "layout", "heads", "mask", "scale", "skip_output_reshape",
                 "low_precision_ok", "form", "prepared", "block", "run", "_hnd")

    def __init__(self, q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, layout: str, heads: int,
                 mask: torch.Tensor | None = None, scale: float | None = None, skip_output_reshape: bool = False,
                 low_precision_ok: bool = True, form: CallForm | None = None):
        self.q4, self.k4, self.v4, self.layout = q4, k4, v4, layout
        self.heads = heads
        self.mask = mask                  # the caller's mask: only its presence matters (no guarded kernel takes one)
        self.scale = scale
        self.skip_output_reshape = skip_output_reshape
        self.low_precision_ok = low_precision_ok   # False: the model asked for full-precision attention
        self.form = form
        self.prepared: Any = None        # what attention.SafeAttention worked out for this call signature
        self.block: int | None = None    # the block it belongs to, while the quality guard runs (quality/)
        self.run: Any = None             # the quality guard's state of this sampling run (quality.guard.RunState)
        self._hnd: tuple | None = None

    @property
    def caller_layout(self) -> str:
        """The layout ComfyUI's own sage path would hand the kernel (the views' layout)."""
        return self.layout

    def hnd(self) -> tuple:
        """q, k, v as HND [B,H,S,D] views (made once per call)."""
        t = self._hnd
        if t is None:
            t = (self.q4, self.k4, self.v4) if self.layout == "HND" else \
                (self.q4.transpose(1, 2), self.k4.transpose(1, 2), self.v4.transpose(1, 2))
            self._hnd = t
        return t

    @property
    def q(self) -> torch.Tensor:
        return self.hnd()[0]

    @property
    def k(self) -> torch.Tensor:
        return self.hnd()[1]

    @property
    def v(self) -> torch.Tensor:
        return self.hnd()[2]

    def in_layout(self, layout: str) -> tuple:
        """q, k, v as views in ``layout`` ("HND" or "NHD")."""
        if layout == self.layout:
            return self.q4, self.k4, self.v4
        if layout == "HND":
            return self.hnd()
        return self.q4.transpose(1, 2), self.k4.transpose(1, 2), self.v4.transpose(1, 2)

    def with_queries(self, q_rows: torch.Tensor) -> "Normalised":
        """The same call with HND query rows ``q_rows`` [B,H,r,D] against all of its keys (the
        quality guard's sampled rows), read as the caller's layout, no mask."""
        q4 = q_rows if self.layout == "HND" else q_rows.transpose(1, 2)
        return Normalised(q4, self.k4, self.v4, self.layout, self.heads, None, self.scale, True,
                          self.low_precision_ok)

    def finish(self, out: torch.Tensor, layout: str = "HND") -> torch.Tensor:
        """The result ``out`` (in ``layout``) shaped the way ComfyUI's attention functions return
        it: [B,H,Sq,D] with skip_output_reshape, else [B,Sq,H*D] (from NHD one flatten: a view
        of a contiguous result, as ComfyUI's sage path's reshape)."""
        if self.skip_output_reshape:
            return out if layout == "HND" else out.transpose(1, 2)
        if layout == "NHD":
            return out.flatten(2)              # a view of a contiguous result, as reshape
        return out.transpose(1, 2).flatten(2)

    @staticmethod
    def to_hnd(out: torch.Tensor, layout: str) -> torch.Tensor:
        """A kernel's result in ``layout`` as an HND view."""
        return out if layout == "HND" else out.transpose(1, 2)


class UnsupportedCall(ValueError):
    """An attention call SafeSage cannot read; it is passed to ComfyUI's own function."""


def call_arguments(args: tuple, kwargs: dict) -> tuple:
    """ComfyUI's ``(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
    skip_output_reshape=False, **kwargs)``, positional or by keyword, as that tuple (plain reads:
    dynamo traces it, see opaque_op.read_call)."""
    na = len(args)
    get = kwargs.get
    if na == 4:                 # how ComfyUI's layers call it: q, k, v, heads, the rest by keyword
        return (args[0], args[1], args[2], args[3], get("mask"), get("attn_precision"), get("skip_reshape", False),
                get("skip_output_reshape", False))
    return (args[0] if na > 0 else get("q"), args[1] if na > 1 else get("k"), args[2] if na > 2 else get("v"),
            args[3] if na > 3 else get("heads"), args[4] if na > 4 else get("mask"),
            args[5] if na > 5 else get("attn_precision"), args[6] if na > 6 else get("skip_reshape", False),
            args[7] if na > 7 else get("skip_output_reshape", False))


ALIGN_MASK = ALIGN_CAP - 1      # a base pointer's low bits: its alignment as an envelope sees it


def signature(func: Any, a: tuple, kwargs: dict, alignment: bool = True) -> tuple | None:
    """A plain call's raw signature (``a``: :func:`call_arguments`): everything :func:`read_form`
    and a plan depend on -- ``func``, heads, the form's flags, whether a mask is given, shapes,
    strides, dtypes, devices and, with ``alignment`` (some family's rule reads it: comfy-kitchen's
    AlignRule), base-pointer alignment of q/k/v -- or None for a call of another kind (q/k/v not
    plain tensors, heads not an int, a mask that is not a tensor), which is read in full each
    time. The attention override's plans are cached under it, so a repeated call is not read
    again (:meth:`CallForm.bind`)."""
    q, k, v, heads, mask = a[0], a[1], a[2], a[3], a[4]
    T = torch.Tensor
    if type(q) is not T or type(k) is not T or type(v) is not T or type(heads) is not int or (
            mask is not None and not isinstance(mask, T)):
        return None
    key = (id(func), heads, mask is None, a[6], a[7], kwargs.get("low_precision_attention", True) is not False,
           q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
           q.device, k.device, v.device)
    if alignment:
        return key + (q.data_ptr() & ALIGN_MASK, k.data_ptr() & ALIGN_MASK, v.data_ptr() & ALIGN_MASK)
    return key


def normalise(args: tuple, kwargs: dict) -> Normalised:
    """ComfyUI's call forms -> views of q/k/v in the caller's layout (no copies) plus what the
    output needs."""
    a = call_arguments(args, kwargs)
    return read_form(a, kwargs).bind(a, kwargs)


def read_form(a: tuple, kwargs: dict) -> CallForm:
    """Check a call (``a``: :func:`call_arguments`) and say how it is read; UnsupportedCall for one
    SafeSage cannot read (ComfyUI's own function runs it)."""
    q, k, v, heads, mask, _, skip_reshape, skip_output_reshape = a
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
    dq = q.device                            # devices, not get_device(): a CPU and a meta tensor both say -1
    if dq != k.device or dq != v.device:
        raise UnsupportedCall("q, k and v are on different devices")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise UnsupportedCall(f"q/k/v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    if skip_reshape:
        if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
            raise UnsupportedCall(f"skip_reshape expects 4-d [B,H,S,D] tensors, got ranks {q.ndim}/{k.ndim}/{v.ndim}")
        qs, ks, vs = tuple(q.shape), tuple(k.shape), tuple(v.shape)          # [B, H, S, D]
        layout, views = "HND", None
    else:
        if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
            raise UnsupportedCall(f"expects 3-d [B,S,H*D] tensors, got ranks {q.ndim}/{k.ndim}/{v.ndim}")
        if q.shape[-1] % heads:
            raise UnsupportedCall(f"q width {q.shape[-1]} not divisible by heads {heads}")
        d = q.shape[-1] // heads
        if k.shape[-1] % d or v.shape[-1] != k.shape[-1]:
            raise UnsupportedCall(f"k/v widths {k.shape[-1]}/{v.shape[-1]} do not fit head_dim {d}")
        views = tuple((t.shape[0], t.shape[1], t.shape[-1] // d, d) for t in (q, k, v))   # [B, S, H, D]
        qs, ks, vs = ((b, h, s, dd) for b, s, h, dd in views)
        layout = "NHD"
    if qs[0] != ks[0] or ks[:3] != vs[:3] or qs[3] != ks[3] or vs[3] != qs[3]:
        raise UnsupportedCall(f"mismatched shapes q{qs} k{ks} v{vs} (HND)")
    if ks[1] == 0 or qs[1] % ks[1]:
        raise UnsupportedCall(f"q heads {qs[1]} not a multiple of kv heads {ks[1]}")
    if mask is not None and not isinstance(mask, torch.Tensor):
        raise UnsupportedCall("mask must be a tensor")
    # ComfyUI's attention_sage runs PyTorch attention when a model passes
    # low_precision_attention=False (e.g. SAM3); keep that contract.
    low_ok = kwargs.get("low_precision_attention", True) is not False
    return CallForm(layout, qs[1], views, skip_output_reshape, low_ok)
