"""What a refused rank call runs, and the LSE half of its first-call check.

A sequence-parallel kernel call must give back ``(out, lse)`` as sage does with ``return_lse=True``
(``tensor_layout="NHD"``): ``out`` [B, S, H, D] in the inputs' dtype, ``lse`` float32 [B, H, S], the
natural log of each query row's softmax denominator over the keys it was given, which the ring
merges chunk by chunk (yunchang's ``update_out_and_lse``). :func:`sdpa_with_lse` is PyTorch's own
attention with its log-sum-exp -- the memory-efficient kernel on CUDA, the flash kernel on CPU, the
ops PyTorch's SDPA dispatches to (64-bit indexing, like the ``sdpa`` family) -- called, not copied.
:func:`lse_error` compares a kernel's LSE with a float32 one on the verifier's probe rows.
"""
from __future__ import annotations

import torch

from ..attention.verification import PROBE_MAX_BYTES, probe_heads, probe_rows

#: the largest |lse - reference| (nats) a kernel's first call may show on the probe rows. Not
#: measured: a chosen bound -- exp(0.1) = 1.105, a key chunk weighted 10 % off in the ring's merge --
#: that a kernel whose output passes its tolerance shows far below (sage quantises q.k to int8, the
#: output's own error is a few per cent), and that a wrong or uninitialised LSE is far above.
LSE_TOLERANCE = 0.1


def _gqa(k: torch.Tensor, heads: int) -> torch.Tensor:
    """k/v [B, H_kv, S, D] repeated to ``heads`` heads (GQA)."""
    return k if k.shape[1] == heads else k.repeat_interleave(heads // k.shape[1], dim=1)


def sdpa_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's attention of NHD ``q``/``k``/``v`` with its log-sum-exp: ``(out NHD, lse [B,H,S] f32)``."""
    qh = q.transpose(1, 2)
    kh, vh = (_gqa(t.transpose(1, 2), qh.shape[1]) for t in (k, v))
    if q.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            qh, kh, vh, None, True, 0.0, causal, scale=scale)[:2]
        lse = lse[..., :qh.shape[2]]            # padded to a multiple of 32 rows on some versions
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qh, kh, vh, 0.0, causal, scale=scale)[:2]
    return out.transpose(1, 2).to(q.dtype), lse.float()


def reference_lse(qs: torch.Tensor, ks: torch.Tensor, scale: float,
                  max_bytes: int = PROBE_MAX_BYTES) -> torch.Tensor:
    """float32 log-sum-exp of query rows ``qs`` [r, D] over keys ``ks`` [S, D], in key blocks."""
    r, d = qs.shape
    kb = max(1024, int(max_bytes) // ((r + d) * 4))
    q32 = qs.float()
    parts = [(q32 @ ks[c0:c0 + kb].float().T).mul_(scale).logsumexp(dim=-1) for c0 in range(0, ks.shape[0], kb)]
    return torch.stack(parts).logsumexp(dim=0)


def lse_error(lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, scale: float) -> float:
    """The largest |lse - float32 reference| on the probe rows and heads of every batch element
    (NHD ``q``/``k``, ``lse`` [B,H,S]); inf for a non-finite LSE where the reference is finite.
    One host read."""
    B, S, H, _ = q.shape
    rows = probe_rows(S).to(q.device)
    ratio = max(H // max(k.shape[2], 1), 1)
    worst = []
    for b in range(B):
        for h in probe_heads(H):
            ref = reference_lse(q[b, :, h].index_select(0, rows), k[b, :, h // ratio], scale)
            got = lse[b, h].index_select(0, rows).float()
            ok = torch.isfinite(ref)
            diff = (got - ref).abs().where(ok, 0.0)
            worst.append(torch.where(torch.isfinite(diff), diff, torch.full_like(diff, float("inf"))).amax())
    return float(torch.stack(worst).amax().item()) if worst else 0.0
