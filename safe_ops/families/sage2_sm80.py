"""SageAttention 2.2 family ``sage2_sm80``: sm80: fp16 PV CUDA attention (what ``sageattn`` runs on sm80).

Its limits (index terms cited to SageAttention@v2.2.0), temporaries (``sage2_temp_bytes``),
adapter, tolerance and the archs it runs on; what the sage 2.2 families share: ``sage2``.
"""
from __future__ import annotations

from . import sage2_temp_bytes as B
from .envelope import Envelope, register
from .sage2 import ROLES, SAGE2_LSE, SM80, SOURCE, cuda_attn_qo, index_terms, per_thread_triton, sage2_family

_t, _d = per_thread_triton()
SAGE2_SM80 = register(Envelope(
    family="sage2_sm80",
    **SAGE2_LSE,
    source=SOURCE,
    head_dims=(64, 128),                   # dispatch_utils.h:23-34 (core.py:560-570 pads others)
    dtypes=("float16", "bfloat16"),        # core.py:541
    supports_mask=False,                   # no attn_mask parameter; sageattn drops kwargs
    terms=_t + cuda_attn_qo("qk_int_sv_f16_attn_kernel", f"{SM80}:198", f"{SM80}:199", f"{SM80}:634")
    + _d
    # V (fp16, last dim contiguous only, :695) by (b, h) + one tile (:200, :256-257)
    + index_terms("qk_int_sv_f16_attn_kernel", "v_fp16", "bh", "u32", f"{SM80}:200"),
    roles=ROLES,
    launches_on_legacy_stream=True,        # qk_int_sv_f16_cuda_sm80.cu:822 <<<grid, block, smem>>>
    temp_bytes=B.sm80_temp_bytes,
    note=("sageattn on sm80: sageattn_qk_int8_pv_fp16_cuda(qk_quant_gran='per_thread' (default), "
          "pv_accum_dtype='fp32') (core.py:145). Triton quant on the current stream, CUDA attention "
          "on the legacy default stream."),
))

KERNEL_FAMILY = sage2_family(
    SAGE2_SM80, "sageattn_qk_int8_pv_fp16_cuda", {"qk_quant_gran": "per_thread", "pv_accum_dtype": "fp32"},
    runs_on=((8, 0), (8, 6), (8, 9), (9, 0), (12, 0)),
    tolerance=0.05,     # fp16 PV: same int8 QK error as sage 1
    drift_rank=1,       # per-thread int8 QK + fp16 PV (attention.move_order.DRIFT_RANKS)
    benign_error=0.0116,  # random H3-shaped inputs at 99,865-99,866 tokens (bench/results/stress_sage22_sm80_h200.json)
)
