"""SageAttention 2.2 family ``sage2_fp8pv_perwarp``: fp8 PV with per_warp CUDA quant, called directly (all-CUDA u32 arithmetic).

Its limits (index terms cited to SageAttention@v2.2.0), temporaries (``sage2_temp_bytes``),
adapter, tolerance and the archs it runs on; what the sage 2.2 families share: ``sage2``.
"""
from __future__ import annotations

from . import sage2_temp_bytes as B
from .envelope import Envelope, register
from .sage2 import FP8_PERWARP, ROLES, SAGE2_LSE, SOURCE, sage2_family

SAGE2_FP8PV_PERWARP = register(Envelope(
    family="sage2_fp8pv_perwarp",
    **SAGE2_LSE,
    source=SOURCE,
    head_dims=(64, 128),
    dtypes=("float16", "bfloat16"),
    supports_mask=False,
    terms=FP8_PERWARP,
    roles=ROLES,
    launches_on_legacy_stream=True,        # fused.cu:752, :667, :914, :987; sm89_..._inst_buf.cu:162
    temp_bytes=lambda c: B.fp8_temp_bytes(c, per_thread=False),
    note=("Direct call sageattn_qk_int8_pv_fp8_cuda(qk_quant_gran='per_warp', pv_accum_dtype='fp32+fp16'): "
          "all-CUDA u32 arithmetic. Runs where _qattn_sm89 is built (sm89, sm90, sm120; setup.py:178). "
          "What sageattn runs on sm120 (minus the #388 length rule)."),
))

KERNEL_FAMILY = sage2_family(
    SAGE2_FP8PV_PERWARP, "sageattn_qk_int8_pv_fp8_cuda", {"qk_quant_gran": "per_warp", "pv_accum_dtype": "fp32+fp16"},
    runs_on=((8, 9), (9, 0), (12, 0)),
    tolerance=0.12,     # fp8 PV (HAZARDS.md H-1)
    drift_rank=2,       # int8 QK + fp8 PV (attention.move_order.DRIFT_RANKS)
    benign_error=0.0397,  # random H3-shaped inputs, 38k-200k tokens: 0.0393-0.0397 (stress_sage22_perwarp*_h200.json)
)
