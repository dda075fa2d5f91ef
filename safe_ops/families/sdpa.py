"""PyTorch SDPA: the verifier's reference and the stand-in for "no guarded kernel" in the planner.

A call whose plan is ``sdpa`` runs what ComfyUI would run (attention.override); this family's
adapter is what the benches and the verifier's tests call directly.
"""
from __future__ import annotations

import torch

from .envelope import Envelope, register
from .family import Kernel, KernelFamily


def sdpa_envelope() -> Envelope:
    """PyTorch SDPA indexes in int64 and takes any layout, dtype or mask."""
    return Envelope(
        family="sdpa", source="torch", head_dims=tuple(range(1, 1025)),
        dtypes=("float16", "bfloat16", "float32", "float64"), supports_mask=True, terms=(),
        devices=("cuda", "cpu", "mps", "xpu"), last_dim_contiguous=False,
    )


SDPA = sdpa_envelope()


SDPA = register(sdpa_envelope())


def sdpa_fn(q, k, v, layout, scale, mask=None):
    """PyTorch's attention as a kernel adapter (GQA by repeating k/v heads)."""
    if layout == "NHD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    kw = {} if scale is None else {"scale": scale}
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    return out.transpose(1, 2) if layout == "NHD" else out


KERNEL_FAMILY = KernelFamily(SDPA, kind="sdpa", tolerance=0.01, call=lambda: (sdpa_fn, None),
                             function="torch.nn.functional.scaled_dot_product_attention",
                             detect=lambda rt: False)    # never an installed kernel: always there
SDPA_KERNEL = Kernel(SDPA, sdpa_fn, KERNEL_FAMILY.tolerance)
