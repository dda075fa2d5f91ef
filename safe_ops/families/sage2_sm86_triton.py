"""SageAttention 2.2 family ``sage2_sm86_triton``: sm86: all Triton (what ``sageattn`` runs on sm86).

Its limits (index terms cited to SageAttention@v2.2.0), temporaries (``sage2_temp_bytes``),
adapter, tolerance and the archs it runs on; what the sage 2.2 families share: ``sage2``.
"""
from __future__ import annotations

from . import sage2_temp_bytes as B
from .envelope import Envelope, IndexTerm, register
from .sage2 import ROLES, SAGE2_LSE, SOURCE, TATTN, cite, per_block_triton, sage2_family

_t, _d = per_block_triton()
SAGE2_SM86_TRITON = register(Envelope(
    family="sage2_sm86_triton",
    **SAGE2_LSE,
    source=SOURCE,
    head_dims=(64, 128),                   # tl.arange(0, C) needs a power of two; core.py:260-269 pads
    dtypes=("float16", "bfloat16"),        # core.py:242
    supports_mask=False,                   # the function takes attn_mask, sageattn never passes one
    terms=_t + (
        # attn_qk_int8_per_block.py:91-92 cast off_z/off_h to i64: b/h terms are i64.
        # offs_m (i32) * stride_qn (i32) for q_int8 (:100) and o (:105, o = empty(q.shape) :135)
        IndexTerm("attn_qk_int8_per_block", "q:alloc", "s", "i32", cite(f"{TATTN}:100")),
        IndexTerm("attn_qk_int8_per_block", "q:alloc", "b", "i64", cite(f"{TATTN}:91")),
        IndexTerm("attn_qk_int8_per_block", "q:alloc", "h", "i64", cite(f"{TATTN}:92")),
        # K/V: (b, h) in i64, tokens one BLOCK_N tile then pointer increments (:70-72, :102-104)
    ) + _d,
    roles=ROLES,
    launches_on_legacy_stream=False,       # Triton only: torch's current stream
    temp_bytes=B.sm86_temp_bytes,
    note="sageattn on sm86: sageattn_qk_int8_pv_fp16_triton (core.py:147), all Triton.",
))

KERNEL_FAMILY = sage2_family(
    SAGE2_SM86_TRITON, "sageattn_qk_int8_pv_fp16_triton", {"quantization_backend": "triton"},
    runs_on=((8, 0), (8, 6), (8, 9), (9, 0)),
    tolerance=0.05,     # fp16 PV, Triton
    drift_rank=3,       # per-block int8 QK (sage 1's quantiser design) + fp16 PV (move_order.DRIFT_RANKS)
    benign_error=0.0136,  # random H3-shaped inputs at 99,865-99,866 tokens (bench/results/stress_sage22_sm86_h200.json)
)
