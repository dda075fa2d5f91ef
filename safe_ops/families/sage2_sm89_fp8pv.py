"""SageAttention 2.2 family ``sage2_sm89_fp8pv``: sm89: fp8 PV CUDA attention, per_thread Triton quant (what ``sageattn`` runs on sm89).

Its limits (index terms cited to SageAttention@v2.2.0), temporaries (``sage2_temp_bytes``),
adapter, tolerance and the archs it runs on; what the sage 2.2 families share: ``sage2``.
"""
from __future__ import annotations

from . import sage2_temp_bytes as B
from .envelope import Envelope, register
from .sage2 import FP8_ATTN_Q, FP8_ATTN_V, ROLES, SAGE2_LSE, SOURCE, per_thread_triton, v_fp8_terms, sage2_family

_t, _d = per_thread_triton()
SAGE2_SM89_FP8PV = register(Envelope(
    family="sage2_sm89_fp8pv",
    **SAGE2_LSE,
    source=SOURCE,
    head_dims=(64, 128),
    dtypes=("float16", "bfloat16"),        # core.py:725
    supports_mask=False,
    terms=_t + FP8_ATTN_Q + _d + v_fp8_terms("v", "v_t") + FP8_ATTN_V,
    roles=ROLES,
    launches_on_legacy_stream=True,        # fused.cu:914, :987; sm89_..._inst_buf.cu:162
    temp_bytes=lambda c: B.fp8_temp_bytes(c, per_thread=True),
    note=("sageattn on sm89: sageattn_qk_int8_pv_fp8_cuda(qk_quant_gran='per_thread' (default!), "
          "pv_accum_dtype='fp32+fp16') (core.py:149) -> Triton per_thread quant (core.py:790-791), "
          "CUDA per_channel_fp8 (core.py:807), sm89 fp8 kernel accum f16 inst_buf (core.py:816-817)."),
))

KERNEL_FAMILY = sage2_family(
    SAGE2_SM89_FP8PV, "sageattn_qk_int8_pv_fp8_cuda", {"qk_quant_gran": "per_thread", "pv_accum_dtype": "fp32+fp16"},
    runs_on=((8, 9), (9, 0), (12, 0)),
    tolerance=0.12,     # fp8 PV: measured ~0.039-0.046 (HAZARDS.md H-1)
    drift_rank=2,       # int8 QK + fp8 PV (attention.move_order.DRIFT_RANKS)
    benign_error=0.0390,  # random H3-shaped inputs at 99,865-99,866 tokens (bench/results/stress_sage22_sm89_h200.json)
)
