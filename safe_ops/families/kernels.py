"""Kernel adapters: each kernel family as ``fn(q, k, v, layout, scale)`` (+ ``fn_lse``) with its envelope.

SageAttention 1.x / 2.x families and comfy-kitchen's ``int8_attention``, called exactly as the
envelope that was checked describes them. ``SDPA_KERNEL`` is PyTorch's attention, the
verifier's reference and the stand-in for "no guarded kernel" in the planner.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from . import ck_int8, sage2  # noqa: F401  (register the comfy-kitchen and sage 2.x families)
from .envelope import FAMILIES, SDPA, Envelope
from .rules import KvLenRule
from ..attention.verification import DEFAULT_TOLERANCE, TOLERANCE
from ..facts.devices import Runtime, measured_tflops, runtime
from .sage_dispatch import SAGE1, runs_on, sage_fns

KernelFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, str, "float | None"], torch.Tensor]
KernelLseFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, str, "float | None"],
                       "tuple[torch.Tensor, torch.Tensor]"]


@dataclass
class Kernel:
    """An executable kernel family: its envelope and ``fn(q, k, v, layout, scale) -> out``.

    ``fn`` receives tensors in ``layout`` order (HND ``[B,H,S,D]`` or NHD
    ``[B,S,H,D]``) and returns the output in the same layout.

    ``fn_lse`` (optional, same arguments) returns ``(out, lse)``: ``lse`` float32
    ``[B,H,Sq]`` whatever the layout, the natural log of ``sum_j exp(scale * q.k_j)`` over
    the keys it was given, up to a per-row constant that is the same for every slice of
    the keys of one call (what key/value-chunked plans need to merge exactly). Without it
    the envelope's ``returns_lse`` is switched off, so the planner never makes kv_chunks.
    """
    envelope: Envelope
    fn: KernelFn
    tolerance: float = DEFAULT_TOLERANCE
    fn_lse: KernelLseFn | None = None

    def __post_init__(self):
        if self.fn_lse is None and self.envelope.returns_lse:
            self.envelope = replace(self.envelope, returns_lse=False)

    @property
    def family(self) -> str:
        return self.envelope.family


def _sdpa_fn(q, k, v, layout, scale, mask=None):
    if layout == "NHD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    kw = {} if scale is None else {"scale": scale}
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    return out.transpose(1, 2) if layout == "NHD" else out


SDPA_KERNEL = Kernel(SDPA, _sdpa_fn, TOLERANCE["sdpa"])


def sage_kernel(rt: Runtime) -> Kernel | None:
    """The installed sageattention as a Kernel, or None (reason in ``rt.sage_error``): the family
    ``sageattn`` dispatches to here, called as ``sage_dispatch.sage_fns`` says."""
    return sage2_kernel(rt.sage_family) if rt.sage_family is not None else None


def sage2_kernel(fam: str) -> Kernel | None:
    """The sage family ``fam`` as a Kernel (None when this build lacks its function).

    ``fn_lse`` (sage 2.2, for kv_chunks): see ``sage_dispatch.sage_fns``."""
    if fam not in FAMILIES:
        return None
    fns = sage_fns(fam)
    if fns is None:
        return None
    fn, fn_lse = fns
    return Kernel(FAMILIES[fam], fn, TOLERANCE.get(fam, DEFAULT_TOLERANCE), fn_lse)


def ck_kernel(rt: Runtime | None = None) -> Kernel | None:
    """comfy-kitchen's ``int8_attention`` as a Kernel, or None (reason in ``rt.ck_error``).

    It takes ``[B,H,L,D]`` with any strides, so an NHD plan hands it transposed views; it
    returns no LSE (``Envelope.returns_lse`` False: no kv_chunks)."""
    rt = rt or runtime()
    fam = rt.ck_family
    if fam not in FAMILIES:
        return None
    try:
        import comfy_kitchen
        f = comfy_kitchen.int8_attention
    except Exception:
        return None

    def fn(q, k, v, layout, scale):
        if layout == "NHD":
            return f(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale).transpose(1, 2)
        return f(q, k, v, scale=scale)

    return Kernel(FAMILIES[fam], fn, TOLERANCE.get(fam, DEFAULT_TOLERANCE))


def installed_kernels(rt: Runtime) -> list[Kernel]:
    """Every usable kernel family here, in ``kernel=sage`` preference order: the family
    ``sageattn`` dispatches to; then (sage 2.2) the other sage-2 families this build runs on
    this arch *that kernel_table.json measured on it* (only verified families are written
    there; an unmeasured family could shadow the dispatch family's evidence-based rules, e.g.
    per_warp FP8-PV on sm_120 without #388's length rule), fastest first; then comfy-kitchen."""
    first = sage_kernel(rt)
    out = [first]
    if (first is not None and first.family != SAGE1 and rt.arch is not None
            and not any(isinstance(r, KvLenRule) for r in first.envelope.extra_rules)):
        tflops = measured_tflops(rt.arch_name)
        for fam in sorted(tflops, key=lambda f: -tflops[f]):
            if fam != first.family and runs_on(fam, rt.arch):
                out.append(sage2_kernel(fam))
    out.append(ck_kernel(rt))
    return [kk for kk in out if kk is not None]

