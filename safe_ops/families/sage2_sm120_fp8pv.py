"""SageAttention 2.2 family ``sage2_sm120_fp8pv``: sm120/sm121: per_warp fp8 PV plus the #388 key-length rule (what ``sageattn`` runs there).

Its limits (index terms cited to SageAttention@v2.2.0), temporaries (``sage2_temp_bytes``),
adapter, tolerance and the archs it runs on; what the sage 2.2 families share: ``sage2``.
"""
from __future__ import annotations

import dataclasses

from .envelope import register
from .rules import KvLenRule
from .sage2 import FP8_SM120_MAX_KV_LEN, sage2_family
from .sage2_fp8pv_perwarp import SAGE2_FP8PV_PERWARP

# the per_warp fp8-PV kernel (its index terms, roles, temporaries, stream) plus #388's key-length rule
SAGE2_SM120_FP8PV = register(dataclasses.replace(
    SAGE2_FP8PV_PERWARP,
    family="sage2_sm120_fp8pv",
    extra_rules=(
        KvLenRule("sage2_sm120_fp8pv", FP8_SM120_MAX_KV_LEN,
                  "SageAttention #388 (RTX PRO 6000 sm_120, sage 2.2.0, MiniMax H3: clean <~154k, noise "
                  ">~160k; also #391/#403, ComfyUI #15263); evidence-based, mechanism unknown (HAZARDS.md H-1, H-6)",
                  "FP8-PV on sm_120 reported to turn to noise without an error"),
    ),
    note=("sageattn on sm120 (and sm121 on main after the tag): sageattn_qk_int8_pv_fp8_cuda("
          "qk_quant_gran='per_warp', pv_accum_dtype='fp32+fp16') (core.py:153)."),
))

KERNEL_FAMILY = sage2_family(
    SAGE2_SM120_FP8PV, "sageattn_qk_int8_pv_fp8_cuda", {"qk_quant_gran": "per_warp", "pv_accum_dtype": "fp32+fp16"},
    runs_on=((12, 0), (12, 1)),
    tolerance=0.12,     # fp8 PV (HAZARDS.md H-1)
    drift_rank=2,       # int8 QK + fp8 PV (attention.move_order.DRIFT_RANKS)
    # the per-warp fp8-PV call of sage2_fp8pv_perwarp (same function and arguments), whose random-input
    # error it takes: 0.0393-0.0397 (stress_sage22_perwarp*_h200.json); not measured on an sm_120 card
    benign_error=0.0397,
)
