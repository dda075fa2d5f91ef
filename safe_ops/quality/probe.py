"""One block's attention error, measured on sampled query rows of the call itself.

The kernel's real output on :data:`PROBE_ROWS` query rows (all heads, all batch elements) is
compared with ComfyUI's own attention function on those rows against all keys -- what ComfyUI
would have computed (PyTorch SDPA in the call's dtype; its own rounding adds in quadrature:
issue #28 reports 0.0023 rel. L2 for bf16 SDPA at H3's shape, i.e. ~2% high for a kernel at 0.017 --
a number from the issue, not re-measured in this repository). The rows are stratified over the sequence with a per-block offset, made
on the device (no host copy). A candidate family's error is its output on the same rows, run on
those rows alone against all keys (issue #28: within 1.2% of its full-call error on them).

Everything here stays on the device: an error is a 0-d float32 tensor, read by the guard once per
step together with the others (guard.py).
"""
from __future__ import annotations

from typing import Callable

import torch

from ..families.sdpa import sdpa_fn

PROBE_ROWS = 1024
#: memory the reference may use for one launch when SafeSage has no budget (CPU): [B, g, rows, S]
#: float32 scores of the math path
DEFAULT_MAX_BYTES = 256 * 2 ** 20


def sample_rows(q_len: int, device: torch.device, salt: int, n: int = PROBE_ROWS) -> torch.Tensor:
    """``n`` query rows spread evenly over ``q_len`` (every row when ``q_len <= n``), shifted by an
    offset drawn from ``salt`` (one per block), as a LongTensor made on ``device``."""
    if q_len <= n:
        return torch.arange(q_len, device=device)
    jitter = (salt * 2654435761) % max(q_len // n, 1)
    return torch.arange(n, device=device) * q_len // n + jitter


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Relative L2 error of ``got`` vs ``ref`` as a 0-d float32 tensor (inf when ``got`` is not
    finite where ``ref`` is: a NaN must never pass a target)."""
    g, r = got.float(), ref.float()
    err = (g - r).norm() / r.norm().clamp_min(1e-30)
    bad = (~torch.isfinite(g) & torch.isfinite(r)).any()
    return torch.where(bad, torch.full_like(err, float("inf")), err)


def reference(fn: Callable, q_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              scale: float | None, max_bytes: int | None) -> torch.Tensor:
    """ComfyUI's attention ``fn`` on ``q_rows`` [B,H,r,D] against all of ``k``/``v`` (HND), in head
    groups whose math-path scores fit ``max_bytes``; [B,H,r,D]. With no ComfyUI function (``fn``
    None: a bench or test calling SafeSage directly) the pack's own reference adapter runs
    (families/sdpa.py ``sdpa_fn``). A GQA call (fewer key heads) is run by PyTorch's SDPA with
    ``enable_gqa``: no copy of k/v, where ``sdpa_fn`` and ComfyUI 0.3.75's attention_pytorch repeat them."""
    B, H, r, D = q_rows.shape
    S = k.shape[2]
    kw = {} if scale is None else {"scale": scale}
    if k.shape[1] != H:
        return torch.nn.functional.scaled_dot_product_attention(q_rows, k, v, enable_gqa=True, **kw)
    if fn is None:
        def fn(q, k, v, heads, skip_reshape=True, skip_output_reshape=True, scale=None):
            return sdpa_fn(q, k, v, "HND", scale)
    per_head = max(B * r * S * 4, 1)
    g = max(1, min(H, int(max_bytes or DEFAULT_MAX_BYTES) // per_head))
    if g >= H:
        return fn(q_rows, k, v, H, skip_reshape=True, skip_output_reshape=True, **kw)
    out = torch.empty_like(q_rows)
    for h0 in range(0, H, g):
        h1 = min(h0 + g, H)
        out[:, h0:h1] = fn(q_rows[:, h0:h1], k[:, h0:h1], v[:, h0:h1], h1 - h0, skip_reshape=True,
                           skip_output_reshape=True, **kw)
    return out
