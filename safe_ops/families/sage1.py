"""SageAttention 1.x (``sageattn`` of sageattention 1.0.6): Triton quantisation and attention.

Read from sageattention 1.0.6 (``core.py``, ``quant_per_block.py``, ``attn_qk_int8_per_block.py``;
line citations below). Every launch is Triton, on torch's current stream; it returns no LSE, so
past a limit only repacks, head groups and query chunks apply (no key chunks).
"""
from __future__ import annotations

from .envelope import AttnCall, Envelope, IndexTerm, register
from .family import KernelFamily

_Q1 = "sageattention-1.0.6"


def _sage1_temp_bytes(call: AttnCall) -> int:
    b, h, sq, d = call.q.shape
    _, hk, sk, _ = call.k.shape
    n = b * h * sq * d + b * hk * sk * d          # q_int8, k_int8 (1 byte)
    n += 4 * (b * h * (-(-sq // 128)) + b * hk * (-(-sk // 64)))   # fp32 scales
    if call.dtype != "float16":
        n += 2 * b * hk * sk * d                  # v.to(float16)
    n += call.elt_bytes * b * h * sq * d          # output
    return n


SAGE1_TRITON = register(Envelope(
    family="sage1_triton",
    source=_Q1,
    head_dims=(64, 96, 128),                     # core.py:85-86 assert headdim in [64, 96, 128]
    dtypes=("float16", "bfloat16", "float32"),   # core.py:79
    supports_mask=False,                         # sageattn(**kwargs) ignores attn_mask silently
    terms=(
        # quant_per_block.py:12-20 (hd96: quant_per_block_hd96.py:13-21): off_b/off_h are
        # tl.program_id (i32), offs_n = off_blk*BLK + arange (i32); each multiplied by an i32 stride.
        IndexTerm("quant_per_block", "q", "b", "i32", "quant_per_block.py:19"),
        IndexTerm("quant_per_block", "q", "h", "i32", "quant_per_block.py:19"),
        IndexTerm("quant_per_block", "q", "s", "i32", "quant_per_block.py:19"),
        IndexTerm("quant_per_block", "k", "b", "i32", "quant_per_block.py:19"),
        IndexTerm("quant_per_block", "k", "h", "i32", "quant_per_block.py:19"),
        IndexTerm("quant_per_block", "k", "s", "i32", "quant_per_block.py:19"),
        # output q_int8/k_int8 = torch.empty(x.shape) (quant_per_block.py:34-35), same arithmetic
        IndexTerm("quant_per_block", "q:alloc", "b", "i32", "quant_per_block.py:20"),
        IndexTerm("quant_per_block", "q:alloc", "h", "i32", "quant_per_block.py:20"),
        IndexTerm("quant_per_block", "q:alloc", "s", "i32", "quant_per_block.py:20"),
        IndexTerm("quant_per_block", "k:alloc", "b", "i32", "quant_per_block.py:20"),
        IndexTerm("quant_per_block", "k:alloc", "h", "i32", "quant_per_block.py:20"),
        IndexTerm("quant_per_block", "k:alloc", "s", "i32", "quant_per_block.py:20"),
        # attn_qk_int8_per_block.py:53-54 casts off_z/off_h to i64 (b/h terms safe); the
        # token term offs_m*stride_qn (i32) remains for q_int8 (:62) and the output o (:67,
        # o = torch.empty(q.shape) :88). K/V advance by pointer increments (:34-36, 64-bit).
        IndexTerm("attn_qk_int8_per_block", "q:alloc", "s", "i32", "attn_qk_int8_per_block.py:62"),
        IndexTerm("attn_qk_int8_per_block", "q:alloc", "b", "i64", "attn_qk_int8_per_block.py:53"),
        IndexTerm("attn_qk_int8_per_block", "q:alloc", "h", "i64", "attn_qk_int8_per_block.py:54"),
        IndexTerm("attn_qk_int8_per_block", "v", "b", "i64", "attn_qk_int8_per_block.py:66"),
        IndexTerm("attn_qk_int8_per_block", "v", "h", "i64", "attn_qk_int8_per_block.py:66"),
    ),
    temp_bytes=_sage1_temp_bytes,
    note="Triton kernels launch on torch's current stream.",
))
# The output o is allocated like q (attn_qk_int8_per_block.py:88) so its token term equals
# q:alloc's above; it is not listed twice.


def _call():
    """``sageattn`` with ``smooth_k=False`` (as ComfyUI calls it; 1.x would otherwise subtract the
    mean from the caller's k in place), no LSE; None when sageattention is not installed."""
    try:
        import sageattention
    except Exception:
        return None
    sageattn = getattr(sageattention, "sageattn", None)
    if sageattn is None:
        return None

    def fn(q, k, v, layout, scale):
        return sageattn(q, k, v, tensor_layout=layout, is_causal=False, sm_scale=scale, smooth_k=False)

    return fn, None


KERNEL_FAMILY = KernelFamily(
    SAGE1_TRITON, kind="sage",
    tolerance=0.05,      # measured 0.013-0.014 on H3 shapes (bench/results/stress_h200.json)
    call=_call, function="sageattention.sageattn", arguments={"smooth_k": False},
    drift_rank=3,        # per-block int8 QK + fp16 PV: 0.22-0.66 on drifting blocks (move_order.DRIFT_RANKS)
    benign_error=0.0136,  # random H3-shaped inputs, 38k-305k tokens: 0.0134-0.0136 (bench/results/stress_h200.json)
)
