"""SageAttention 2.2 family ``sage2_sm90``: sm90: fp8 PV with TMA attention (what ``sageattn`` runs on sm90).

Its limits (index terms cited to SageAttention@v2.2.0), temporaries (``sage2_temp_bytes``),
adapter, tolerance and the archs it runs on; what the sage 2.2 families share: ``sage2``.
"""
from __future__ import annotations

from . import sage2_temp_bytes as B
from .envelope import Envelope, IndexTerm, register
from .sage2 import ROLES, SAGE2_LSE, SM90, SOURCE, cite, per_thread_triton, v_fp8_terms, sage2_family

_t, _d = per_thread_triton()
# Every stride of q_int8 / k_int8 / v_fp8 reaches a TMA descriptor as a C int (:38 via :788-833
# and :887-889), whatever the extent. Measured on an H200 (driver 580, cuda.bindings, the exact
# create_tensor_map_4D arguments): cuTensorMapEncodeTiled returns CUDA_ERROR_INVALID_VALUE (-> the
# live ``assert`` at :48 aborts) for q_int8 [1,56,S,128] at S = 299,594 (batch stride
# 2,147,489,792) but not at 299,593, and for v_fp8 at Spad = 299,648 but not 299,520; the same
# strides passed as 64-bit encode fine. A stride >= 2**32 wraps to a positive int and encodes,
# wrongly (harmless only for a batch stride with b = 1): every stride > INT_MAX is refused,
# which is conservative for that case only.
_SM90_TMA = "TMA descriptor (sm90, cuTensorMapEncodeTiled)"
_SM90_INT_STRIDES = tuple(
    IndexTerm(_SM90_TMA, role, a, "i32", cite(f"{SM90}:38") + " (int strides from :788-833, maps :887-889)",
              stride_only=True)
    for role, axes in (("q:alloc", "bhs"), ("k:alloc", "bhs"), ("v_t128", "bhd")) for a in axes)
SAGE2_SM90 = register(Envelope(
    family="sage2_sm90",
    **SAGE2_LSE,
    source=SOURCE,
    head_dims=(64, 128),
    dtypes=("float16", "bfloat16"),        # core.py:912
    supports_mask=False,
    terms=_t + (
        # Q/K/V are read by TMA (64-bit strides, int32 coordinates, :241-243, :289, :362).
        # O is written by hand with u32 arithmetic (:517, :528-548), o = empty(q.size()) core.py:969.
        IndexTerm("qk_int8_sv_f8_attn_kernel(sm90)", "q:alloc", "b", "u32", cite(f"{SM90}:517")),
        IndexTerm("qk_int8_sv_f8_attn_kernel(sm90)", "q:alloc", "h", "u32", cite(f"{SM90}:517")),
        IndexTerm("qk_int8_sv_f8_attn_kernel(sm90)", "q:alloc", "s", "u32", cite(f"{SM90}:517")),
    ) + _d + v_fp8_terms("v_pad128", "v_t128") + _SM90_INT_STRIDES,
    roles=ROLES,
    launches_on_legacy_stream=True,        # fused.cu:914, :987; qk_int_sv_f8_cuda_sm90.cu:898
    temp_bytes=B.sm90_temp_bytes,
    note=("sageattn on sm90: sageattn_qk_int8_pv_fp8_cuda_sm90(qk_quant_gran='per_thread', "
          "pv_accum_dtype='fp32+fp32') (core.py:151): Triton quant BLKQ=64/WARPQ=16/BLKK=WARPK=128 "
          "(core.py:966-967), V padded to 128 by torch.cat (core.py:971-979) so the kv_len % 128 assert "
          "(qk_int_sv_f8_cuda_sm90.cu:868) cannot fire here. HAZARDS.md H-6: a 2.2.0 sm_90a build computed "
          "garbage on an H200 with no error -- verify before trusting."),
))

KERNEL_FAMILY = sage2_family(
    SAGE2_SM90, "sageattn_qk_int8_pv_fp8_cuda_sm90", {"qk_quant_gran": "per_thread", "pv_accum_dtype": "fp32+fp32"},
    runs_on=((9, 0),),
    tolerance=0.12,     # fp8 PV (HAZARDS.md H-1, H-6)
    drift_rank=2,       # int8 QK + fp8 PV (attention.move_order.DRIFT_RANKS)
)
