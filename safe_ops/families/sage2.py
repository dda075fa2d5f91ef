"""SageAttention 2.2 kernel families as data (which one runs where: ``sage_dispatch``).

Read from thu-ml/SageAttention tag ``v2.2.0`` (commit eb615cf6cf4d, 2025-10-28; its
``csrc/`` and ``sageattention/triton/`` are byte-identical to 0d30f5c, 2025-06-27, the
2.2.0 sources users built wheels from). Citations read ``SageAttention@v2.2.0:path:line``.

What ``sageattn`` (core.py:143-155) runs, by compute capability -- *not* what one might
guess from the README:

==========  =====================================  ======================================
arch        function, arguments                    index arithmetic
==========  =====================================  ======================================
sm80        qk_int8_pv_fp16_cuda, per_thread,      Triton quant (i32) + CUDA attn (u32)
            pv fp32
sm86        qk_int8_pv_fp16_triton                 Triton quant + Triton attn (i32)
sm89        qk_int8_pv_fp8_cuda, **per_thread**,   Triton quant (i32) + CUDA V fp8 + attn
            pv fp32+fp16                           (u32)
sm90        qk_int8_pv_fp8_cuda_sm90, per_thread   Triton quant (i32) + CUDA V fp8 (u32)
                                                   + TMA attn (strides passed as int)
sm120       qk_int8_pv_fp8_cuda, per_warp,         CUDA quant + V fp8 + attn, all u32
            pv fp32+fp16
other       ValueError (sm87, sm100, sm121 at the tag; main after the tag adds sm121)
==========  =====================================  ======================================

The sm80/sm89/sm90 paths quantise q/k with the Triton ``per_thread`` kernel because
``qk_quant_gran`` defaults to "per_thread" (core.py:455, :640, :833) and ``sageattn`` does
not override it; only sm120 passes "per_warp" (core.py:153). ``sageattn`` does not forward
``**kwargs`` (core.py:143-155): ``smooth_k=False``, ``qk_quant_gran`` etc. given to
``sageattn`` are silently ignored, so smooth_k is always True through ``sageattn``.

Model (same as envelope.py): every ``index * stride`` product a kernel computes must fit
its integer type on its own; pointer additions are 64-bit. In the CUDA kernels the host
casts each ``int64`` stride to ``int`` (e.g. fused.cu:455-478) and passes it to a
``const uint32_t`` parameter (fused.cu:65-69), the index is ``uint32_t`` (fused.cu:84-89)
and ``ptr + u32*u32`` wraps the product at 2**32 before the 64-bit pointer add
(fused.cu:90-92). The int truncation is harmless there (same bits as uint32) unless the
product itself passes 2**32. The sm90 attention kernel instead hands the strides to
``cuTensorMapEncodeTiled`` as ``(uint64_t)int`` (qattn/qk_int_sv_f8_cuda_sm90.cu:38):
a stride above INT_MAX sign-extends and the descriptor encode fails its ``assert``
(:48, asserts are live: setup.py builds without -DNDEBUG) -- so there *every stride* of
q_int8 / k_int8 / v_fp8 must fit in int32, even a batch stride multiplied by index 0
(encode failure measured; the ``stride_only`` terms of ``sage2_sm90``).

The CUDA attention kernels advance K/V pointers by ``CTA_K * stride`` per tile
(qattn/attn_utils.cuh:115-141, 64-bit pointer increments), so their K/V token index is at
most one tile: only the Q/O token index spans the whole sequence there.

Every term is an ordinary :class:`IndexTerm` in ``Envelope.terms``, on a role of the call:
the caller's q/k/v, ``x:alloc`` (torch.empty(x.shape)), or one of the tensors sage makes
from the call (k - km, the fp16 V, the transposed/padded V and its fp8 copy, sm90's
128-padded V), listed in :data:`ROLES` -- one ``envelope.check`` evaluates them all.

Boundaries (b=1, 56 heads, d=128; first unsafe length, index rules only):

=====================  ==============  ===============  ===============  =====================
family                 H3 view         contiguous HND   contiguous NHD   limiting term
                       (stride 21504)
=====================  ==============  ===============  ===============  =====================
sage2_sm80             99,866          305,041          299,595          Triton quant, i32
sage2_sm86_triton      99,866          305,041          299,595          Triton quant, i32
sage2_sm89_fp8pv       99,866          305,041          299,595          Triton quant, i32
sage2_sm90             99,866          299,521          299,521          H3: Triton i32;
                                                                         contig: v_fp8 batch
                                                                         stride as int (TMA)
sage2_fp8pv_perwarp    199,730         610,049          599,188          CUDA u32 (q/k/v
                                                                         token; v_fp8 head)
sage2_sm120_fp8pv      150,000 (#388 length rule; index terms as sage2_fp8pv_perwarp)
=====================  ==============  ===============  ===============  =====================

HAZARDS.md's "uint32 wrap at S = 199,728" is U32_MAX // 21504, the largest *index* that
fits; the first wrapped *length* is 199,730 (what was measured to degrade). KJNodes PR #748's
200,064 is the length of the run it reproduced, not a boundary (its sum-of-spans test gives
the same 199,730).

Head dims: the CUDA kernels and the Triton per_thread quantiser take 64 and 128 only
(csrc/dispatch_utils.h:23-34); ``sageattn`` zero-pads other dims <= 128 to 64/128 with a
fresh contiguous copy (core.py:560-570) -- that copy changes every stride, so the
envelopes list the native dims (64, 128) only and a caller wanting d=96 should pad itself.
"""
from __future__ import annotations

from typing import Callable

from .envelope import AttnCall, Envelope, IndexTerm, TensorDesc, register
from . import sage2_temp_bytes as B
from .sage2_temp_bytes import ceil_to
from .rules import KvLenRule

TAG = "v2.2.0"
TAG_COMMIT = "eb615cf6cf4d221338033340ee2de1c37fbdba4a"
SOURCE = f"sageattention-2.2.0 (thu-ml/SageAttention@{TAG}, {TAG_COMMIT[:12]})"


def cite(where: str) -> str:
    return f"SageAttention@{TAG}:{where}"


PT = "sageattention/triton/quant_per_thread.py"
PB = "sageattention/triton/quant_per_block.py"
TATTN = "sageattention/triton/attn_qk_int8_per_block.py"
FUSED = "csrc/fused/fused.cu"
SM80 = "csrc/qattn/qk_int_sv_f16_cuda_sm80.cu"
SM89 = "csrc/qattn/qk_int_sv_f8_cuda_sm89.cuh"
SM90 = "csrc/qattn/qk_int_sv_f8_cuda_sm90.cu"

#: sage 2.2.0's ``return_lse=True`` kernel variant vs the plain one, same inputs: 2,217 vs 2,115 ms
#: (sage2_fp8pv_perwarp, 169,000 H3 tokens, H200; bench/results/kv_anatomy_h200.json). Measured
#: on the sm89 FP8 kernel; assumed for the other sage 2 kernels until they are measured.
LSE_TIME_FACTOR = 1.048
#: what every sage 2 kernel shares for kv_chunks: ``return_lse`` and ``smooth_k`` (core.py, see the
#: LSE note) and the LSE variant's time
SAGE2_LSE = dict(returns_lse=True, lse_centred_k=True, lse_time_factor=LSE_TIME_FACTOR)
FP8_SM120_MAX_KV_LEN = 150_000     # exclusive: kv_len must be < this (SageAttention #388)


# LSE (``return_lse=True``, every 2.2.0 function): the CUDA kernels scale by
# sm_scale*log2(e) (e.g. qk_int_sv_f16_cuda_sm80.cu:92) and write log2(d) + m per query row
# into a fresh fp32 [B, H, Sq] tensor (:657-666; sm89 .cuh:691-701; sm90 .cu:553-563) -- the
# fp8 kernels' S_FP8_OFFSET shift (attn_utils.cuh:379) is inside both m and d and cancels.
# core.py then returns ``lse / 1.44269504`` (natural log) and, with smooth_k, adds
# ``q @ km^T * sm_scale`` computed in the input dtype (:287-291, :326-327 and the same lines
# of each function). That correction is rounded to bf16, i.e. off by up to ~2**-9 of q.km,
# differently per key chunk. kv_chunks therefore subtracts the full sequence's mean itself
# and calls with smooth_k=False: the keys are quantised exactly as in the unchunked call and
# the LSE carries no rounded correction (Envelope.lse_centred_k).

# ------------------------------------------------------------- roles (tensors sage makes)
def dense_like(t: TensorDesc) -> TensorDesc:
    """Strides of a dense tensor that keeps ``t``'s dimension order.

    What ``k - km`` (quant_per_thread.py:159, quant_per_block.py:54) and ``v.to(fp16)``
    (core.py:296, :611) return: TensorIterator / preserve_format lays the output out in
    the input's stride order. Ties (size-1 dims) keep the inner dim inner.
    """
    order = sorted(range(4), key=lambda i: (t.stride[i], -i))     # innermost first
    strides = [0, 0, 0, 0]
    acc = 1
    for i in order:
        strides[i] = acc
        acc *= max(t.shape[i], 1)
    return TensorDesc(t.shape, tuple(strides))


def v_transposed(call: AttnCall, src: TensorDesc, pad_to: int = 64) -> TensorDesc:
    """``per_channel_fp8``'s transposed/padded V (quant.py:271-281) and its fp8 copy
    (quant.py:283), in canonical (b, h, s, d) order.

    HND: torch.empty((b, h, d, Spad)) -> strides b=h*d*Spad, h=d*Spad, s=1, d=Spad.
    NHD: torch.empty((b, d, h, Spad)) -> strides b=d*h*Spad, h=Spad, s=1, d=h*Spad.
    Spad = ceil(kv_len / 64) * 64 (quant.py:273, :278; fused.cu:884, :897).
    """
    b, h, s, d = src.shape
    sp = ceil_to(s, pad_to)
    if call.layout == "NHD":
        return TensorDesc((b, h, sp, d), (d * h * sp, sp, 1, h * sp))
    return TensorDesc((b, h, sp, d), (h * d * sp, d * sp, 1, sp))


def _v_sm90_in(call: AttnCall) -> TensorDesc:
    """V as it enters per_channel_fp8 on the sm90 path: torch.cat-padded to a multiple
    of 128 (a new layout-contiguous tensor) when kv_len % 128 != 0, else the caller's v
    (core.py:971-981)."""
    b, h, s, d = call.v.shape
    if s % 128 == 0:
        return call.v
    return TensorDesc.contiguous((b, h, ceil_to(s, 128), d), call.layout)


# The tensors sage 2.2 makes from the call, as roles its terms name (Envelope.roles).
ROLES: dict[str, Callable[[AttnCall], TensorDesc]] = {
    # k - km (smooth_k, always on through sageattn), dense in k's dimension order
    "k_smooth": lambda c: dense_like(c.k),
    # v.to(torch.float16): the same tensor for fp16 input, a dense copy otherwise
    "v_fp16": lambda c: c.v if c.dtype == "float16" else dense_like(c.v),
    # per_channel_fp8 on the caller's v (sm89/sm120 paths)
    "v_t": lambda c: v_transposed(c, c.v),
    # sm90 path: V padded to 128 first, then transposed (Spad already a multiple of 128)
    "v_pad128": _v_sm90_in,
    "v_t128": lambda c: v_transposed(c, _v_sm90_in(c)),
}


# ------------------------------------------------------------- term builders
def _terms(kernel: str, tensor: str, axes: str, itype: str, where: str) -> tuple[IndexTerm, ...]:
    return tuple(IndexTerm(kernel, tensor, a, itype, cite(where)) for a in axes)


# Triton per_thread quantiser (quant_per_thread.py). off_b/off_h are tl.program_id (i32,
# :29-30, :56-57), offs_n = off_blk*BLK + arange (i32, :32, :75-76); each times an i32 stride.
def _per_thread_triton() -> tuple[tuple[IndexTerm, ...], tuple[IndexTerm, ...]]:
    k = "quant_per_thread_int8"
    terms = (
        _terms(k, "q", "bhs", "i32", f"{PT}:35")            # input_ptrs, caller's q
        + _terms(k, "q:alloc", "bhs", "i32", f"{PT}:36")    # q_int8 = torch.empty(q.shape) :155
        # The caller's k is never indexed here: smooth_k (on in every SAGEATTN_CALL call, the
        # functions' default) makes per_thread_int8 quantise `k - km` (:158-159), a fresh dense
        # tensor (k_smooth below); kv_chunks' smooth_k=False calls get a dense centred copy,
        # whose strides are k_smooth's. (Until issue 11 the caller's k was listed too, which
        # made every strided H3 call past 99,865 copy k for nothing.)
        + _terms(k, "k:alloc", "bhs", "i32", f"{PT}:81")    # k_int8 :156
    )
    smooth = _terms(k, "k_smooth", "bhs", "i32", f"{PT}:159")   # k = k - km, then :79-80
    # scales (:180-181, :37, :83): per (b, h) at most ceil(S/BLKQ)*(BLKQ/WARPQ)*8 <= S/4+32
    # floats, always far below q_int8's own terms; not listed.
    return terms, smooth


# Triton per_block quantiser, 2.2.0 copy (quant_per_block.py:28-36), used by sm86.
def _per_block_triton() -> tuple[tuple[IndexTerm, ...], tuple[IndexTerm, ...]]:
    k = "quant_per_block_int8"
    terms = (
        _terms(k, "q", "bhs", "i32", f"{PB}:35")
        + _terms(k, "q:alloc", "bhs", "i32", f"{PB}:36")
        # caller's k: not indexed, `k - km` is (quant_per_block.py:52-53; see _per_thread_triton)
        + _terms(k, "k:alloc", "bhs", "i32", f"{PB}:36")
    )
    smooth = _terms(k, "k_smooth", "bhs", "i32", f"{PB}:54")
    return terms, smooth


# CUDA per_warp q quant + per_block(+sub_mean) k quant (quant.py:172-176 ->
# fused.cu:752 / :667): QuantInt8Kernel, u32 indices and strides (fused.cu:65-92).
def _per_warp_cuda() -> tuple[IndexTerm, ...]:
    k = "QuantInt8Kernel"
    return (
        _terms(k, "q", "bhs", "u32", f"{FUSED}:90")          # input_ptr_base
        + _terms(k, "q:alloc", "bhs", "u32", f"{FUSED}:92")  # output_ptr_base (q_int8, quant.py:153)
        + _terms(k, "k", "bhs", "u32", f"{FUSED}:90")        # fused sub-mean reads the caller's k
        + _terms(k, "k:alloc", "bhs", "u32", f"{FUSED}:92")  # k_int8 (quant.py:154)
    )


# per_channel_fp8 (quant.py:224-293): TransposePadPermuteKernel (fused.cu:262-313,
# launched :914) reads V by (b, h, token) and writes the transposed copy by (b, h, d);
# MeanScaleKernel (fused.cu:316-427, launched :987) reads/writes it by (b, h, d).
def _v_fp8_terms(src: str, vt: str) -> tuple[IndexTerm, ...]:
    return (
        _terms("TransposePadPermuteKernel", src, "bhs", "u32", f"{FUSED}:281")
        + _terms("TransposePadPermuteKernel", vt, "bhd", "u32", f"{FUSED}:282")
        + _terms("MeanScaleKernel", vt, "bhd", "u32", f"{FUSED}:338-339")
    )


# CUDA attention kernels (sm80 / sm89): Q and O by (b, h, token) over the whole sequence,
# K by (b, h) + one CTA_K tile (pointer advanced per tile, attn_utils.cuh:136-140).
def _cuda_attn_qo(kernel: str, where_q: str, where_k: str, where_o: str) -> tuple[IndexTerm, ...]:
    return (
        _terms(kernel, "q:alloc", "bhs", "u32", where_q)     # q_int8
        + _terms(kernel, "k:alloc", "bh", "u32", where_k)    # k_int8
        + _terms(kernel, "q:alloc", "bhs", "u32", where_o)   # o = torch.empty(q.size())
    )


# ------------------------------------------------------------------ families
_t, _d = _per_thread_triton()
SAGE2_SM80 = register(Envelope(
    family="sage2_sm80",
    **SAGE2_LSE,
    source=SOURCE,
    head_dims=(64, 128),                   # dispatch_utils.h:23-34 (core.py:560-570 pads others)
    dtypes=("float16", "bfloat16"),        # core.py:541
    supports_mask=False,                   # no attn_mask parameter; sageattn drops kwargs
    terms=_t + _cuda_attn_qo("qk_int_sv_f16_attn_kernel", f"{SM80}:198", f"{SM80}:199", f"{SM80}:634")
    + _d
    # V (fp16, last dim contiguous only, :695) by (b, h) + one tile (:200, :256-257)
    + _terms("qk_int_sv_f16_attn_kernel", "v_fp16", "bh", "u32", f"{SM80}:200"),
    roles=ROLES,
    launches_on_legacy_stream=True,        # qk_int_sv_f16_cuda_sm80.cu:822 <<<grid, block, smem>>>
    temp_bytes=B.sm80_temp_bytes,
    note=("sageattn on sm80: sageattn_qk_int8_pv_fp16_cuda(qk_quant_gran='per_thread' (default), "
          "pv_accum_dtype='fp32') (core.py:145). Triton quant on the current stream, CUDA attention "
          "on the legacy default stream."),
))


_t, _d = _per_block_triton()
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


_FP8_ATTN_Q = _cuda_attn_qo("qk_int_sv_f8_attn_kernel", f"{SM89}:200", f"{SM89}:201", f"{SM89}:668")
# V fp8 (b, h, d) + tokens by pointer increments (qk_int_sv_f8_cuda_sm89.cuh:203, :263-264);
# the launcher (csrc/qattn/sm89_qk_int8_sv_f8_accum_f16_fuse_v_scale_attn_inst_buf.cu) does
# CHECK_CONTIGUOUS(value) (:26) and asserts value.size(3) >= ceil(kv_len/64)*64 (:130), which
# per_channel_fp8's pad-to-64 meets.
_FP8_ATTN_V = _terms("qk_int_sv_f8_attn_kernel", "v_t", "bhd", "u32", f"{SM89}:203")

_t, _d = _per_thread_triton()
SAGE2_SM89_FP8PV = register(Envelope(
    family="sage2_sm89_fp8pv",
    **SAGE2_LSE,
    source=SOURCE,
    head_dims=(64, 128),
    dtypes=("float16", "bfloat16"),        # core.py:725
    supports_mask=False,
    terms=_t + _FP8_ATTN_Q + _d + _v_fp8_terms("v", "v_t") + _FP8_ATTN_V,
    roles=ROLES,
    launches_on_legacy_stream=True,        # fused.cu:914, :987; sm89_..._inst_buf.cu:162
    temp_bytes=lambda c: B.fp8_temp_bytes(c, per_thread=True),
    note=("sageattn on sm89: sageattn_qk_int8_pv_fp8_cuda(qk_quant_gran='per_thread' (default!), "
          "pv_accum_dtype='fp32+fp16') (core.py:149) -> Triton per_thread quant (core.py:790-791), "
          "CUDA per_channel_fp8 (core.py:807), sm89 fp8 kernel accum f16 inst_buf (core.py:816-817)."),
))

_FP8_PERWARP = _per_warp_cuda() + _FP8_ATTN_Q + _v_fp8_terms("v", "v_t") + _FP8_ATTN_V
SAGE2_FP8PV_PERWARP = register(Envelope(
    family="sage2_fp8pv_perwarp",
    **SAGE2_LSE,
    source=SOURCE,
    head_dims=(64, 128),
    dtypes=("float16", "bfloat16"),
    supports_mask=False,
    terms=_FP8_PERWARP,
    roles=ROLES,
    launches_on_legacy_stream=True,        # fused.cu:752, :667, :914, :987; sm89_..._inst_buf.cu:162
    temp_bytes=lambda c: B.fp8_temp_bytes(c, per_thread=False),
    note=("Direct call sageattn_qk_int8_pv_fp8_cuda(qk_quant_gran='per_warp', pv_accum_dtype='fp32+fp16'): "
          "all-CUDA u32 arithmetic. Runs where _qattn_sm89 is built (sm89, sm90, sm120; setup.py:178). "
          "What sageattn runs on sm120 (minus the #388 length rule)."),
))

SAGE2_SM120_FP8PV = register(Envelope(
    family="sage2_sm120_fp8pv",
    **SAGE2_LSE,
    source=SOURCE,
    head_dims=(64, 128),
    dtypes=("float16", "bfloat16"),
    supports_mask=False,
    terms=_FP8_PERWARP,
    roles=ROLES,
    extra_rules=(
        KvLenRule("sage2_sm120_fp8pv", FP8_SM120_MAX_KV_LEN,
                  "SageAttention #388 (RTX PRO 6000 sm_120, sage 2.2.0, MiniMax H3: clean <~154k, noise "
                  ">~160k; also #391/#403, ComfyUI #15263); evidence-based, mechanism unknown (HAZARDS.md H-1, H-6)",
                  "FP8-PV on sm_120 reported to turn to noise without an error"),
    ),
    launches_on_legacy_stream=True,
    temp_bytes=lambda c: B.fp8_temp_bytes(c, per_thread=False),
    note=("sageattn on sm120 (and sm121 on main after the tag): sageattn_qk_int8_pv_fp8_cuda("
          "qk_quant_gran='per_warp', pv_accum_dtype='fp32+fp16') (core.py:153)."),
))


_t, _d = _per_thread_triton()
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
    ) + _d + _v_fp8_terms("v_pad128", "v_t128") + _SM90_INT_STRIDES,
    roles=ROLES,
    launches_on_legacy_stream=True,        # fused.cu:914, :987; qk_int_sv_f8_cuda_sm90.cu:898
    temp_bytes=B.sm90_temp_bytes,
    note=("sageattn on sm90: sageattn_qk_int8_pv_fp8_cuda_sm90(qk_quant_gran='per_thread', "
          "pv_accum_dtype='fp32+fp32') (core.py:151): Triton quant BLKQ=64/WARPQ=16/BLKK=WARPK=128 "
          "(core.py:966-967), V padded to 128 by torch.cat (core.py:971-979) so the kv_len % 128 assert "
          "(qk_int_sv_f8_cuda_sm90.cu:868) cannot fire here. HAZARDS.md H-6: a 2.2.0 sm_90a build computed "
          "garbage on an H200 with no error -- verify before trusting."),
))

SAGE2_FAMILIES = (SAGE2_SM80, SAGE2_SM86_TRITON, SAGE2_SM89_FP8PV, SAGE2_FP8PV_PERWARP,
                  SAGE2_SM120_FP8PV, SAGE2_SM90)
