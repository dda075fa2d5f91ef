"""What the SageAttention 2.2 families share: sources, roles, term builders, LSE facts, the adapter.

One module per family (``sage2_sm80``, ``sage2_sm86_triton``, ``sage2_sm89_fp8pv``,
``sage2_fp8pv_perwarp``, ``sage2_sm120_fp8pv``, ``sage2_sm90``) holds its envelope and
``KERNEL_FAMILY``; which one ``sageattn`` runs where: ``sage_dispatch``.

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

from .envelope import AttnCall, Envelope, IndexTerm, TensorDesc
from .family import KernelFamily
from .sage2_temp_bytes import ceil_to

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
def index_terms(kernel: str, tensor: str, axes: str, itype: str, where: str) -> tuple[IndexTerm, ...]:
    return tuple(IndexTerm(kernel, tensor, a, itype, cite(where)) for a in axes)


# Triton per_thread quantiser (quant_per_thread.py). off_b/off_h are tl.program_id (i32,
# :29-30, :56-57), offs_n = off_blk*BLK + arange (i32, :32, :75-76); each times an i32 stride.
def per_thread_triton() -> tuple[tuple[IndexTerm, ...], tuple[IndexTerm, ...]]:
    k = "quant_per_thread_int8"
    terms = (
        index_terms(k, "q", "bhs", "i32", f"{PT}:35")            # input_ptrs, caller's q
        + index_terms(k, "q:alloc", "bhs", "i32", f"{PT}:36")    # q_int8 = torch.empty(q.shape) :155
        # The caller's k is never indexed here: smooth_k (on in every call the sage 2 families make, the
        # functions' default) makes per_thread_int8 quantise `k - km` (:158-159), a fresh dense
        # tensor (k_smooth below); kv_chunks' smooth_k=False calls get a dense centred copy,
        # whose strides are k_smooth's. (Until issue 11 the caller's k was listed too, which
        # made every strided H3 call past 99,865 copy k for nothing.)
        + index_terms(k, "k:alloc", "bhs", "i32", f"{PT}:81")    # k_int8 :156
    )
    smooth = index_terms(k, "k_smooth", "bhs", "i32", f"{PT}:159")   # k = k - km, then :79-80
    # scales (:180-181, :37, :83): per (b, h) at most ceil(S/BLKQ)*(BLKQ/WARPQ)*8 <= S/4+32
    # floats, always far below q_int8's own terms; not listed.
    return terms, smooth


# Triton per_block quantiser, 2.2.0 copy (quant_per_block.py:28-36), used by sm86.
def per_block_triton() -> tuple[tuple[IndexTerm, ...], tuple[IndexTerm, ...]]:
    k = "quant_per_block_int8"
    terms = (
        index_terms(k, "q", "bhs", "i32", f"{PB}:35")
        + index_terms(k, "q:alloc", "bhs", "i32", f"{PB}:36")
        # caller's k: not indexed, `k - km` is (quant_per_block.py:52-53; see _per_thread_triton)
        + index_terms(k, "k:alloc", "bhs", "i32", f"{PB}:36")
    )
    smooth = index_terms(k, "k_smooth", "bhs", "i32", f"{PB}:54")
    return terms, smooth


# CUDA per_warp q quant + per_block(+sub_mean) k quant (quant.py:172-176 ->
# fused.cu:752 / :667): QuantInt8Kernel, u32 indices and strides (fused.cu:65-92).
def per_warp_cuda() -> tuple[IndexTerm, ...]:
    k = "QuantInt8Kernel"
    return (
        index_terms(k, "q", "bhs", "u32", f"{FUSED}:90")          # input_ptr_base
        + index_terms(k, "q:alloc", "bhs", "u32", f"{FUSED}:92")  # output_ptr_base (q_int8, quant.py:153)
        + index_terms(k, "k", "bhs", "u32", f"{FUSED}:90")        # fused sub-mean reads the caller's k
        + index_terms(k, "k:alloc", "bhs", "u32", f"{FUSED}:92")  # k_int8 (quant.py:154)
    )


# per_channel_fp8 (quant.py:224-293): TransposePadPermuteKernel (fused.cu:262-313,
# launched :914) reads V by (b, h, token) and writes the transposed copy by (b, h, d);
# MeanScaleKernel (fused.cu:316-427, launched :987) reads/writes it by (b, h, d).
def v_fp8_terms(src: str, vt: str) -> tuple[IndexTerm, ...]:
    return (
        index_terms("TransposePadPermuteKernel", src, "bhs", "u32", f"{FUSED}:281")
        + index_terms("TransposePadPermuteKernel", vt, "bhd", "u32", f"{FUSED}:282")
        + index_terms("MeanScaleKernel", vt, "bhd", "u32", f"{FUSED}:338-339")
    )


# CUDA attention kernels (sm80 / sm89): Q and O by (b, h, token) over the whole sequence,
# K by (b, h) + one CTA_K tile (pointer advanced per tile, attn_utils.cuh:136-140).
def cuda_attn_qo(kernel: str, where_q: str, where_k: str, where_o: str) -> tuple[IndexTerm, ...]:
    return (
        index_terms(kernel, "q:alloc", "bhs", "u32", where_q)     # q_int8
        + index_terms(kernel, "k:alloc", "bh", "u32", where_k)    # k_int8
        + index_terms(kernel, "q:alloc", "bhs", "u32", where_o)   # o = torch.empty(q.size())
    )



FP8_ATTN_Q = cuda_attn_qo("qk_int_sv_f8_attn_kernel", f"{SM89}:200", f"{SM89}:201", f"{SM89}:668")
# V fp8 (b, h, d) + tokens by pointer increments (qk_int_sv_f8_cuda_sm89.cuh:203, :263-264);
# the launcher (csrc/qattn/sm89_qk_int8_sv_f8_accum_f16_fuse_v_scale_attn_inst_buf.cu) does
# CHECK_CONTIGUOUS(value) (:26) and asserts value.size(3) >= ceil(kv_len/64)*64 (:130), which
# per_channel_fp8's pad-to-64 meets.
FP8_ATTN_V = index_terms("qk_int_sv_f8_attn_kernel", "v_t", "bhd", "u32", f"{SM89}:203")
FP8_PERWARP = per_warp_cuda() + FP8_ATTN_Q + v_fp8_terms("v", "v_t") + FP8_ATTN_V


# ------------------------------------------------------------------ the adapter
def sage2_call(function: str, arguments: dict):
    """The adapter of a sage 2.2 family: ``call() -> (fn, fn_lse)`` running exactly that family through
    ``sageattention.<function>`` with explicit ``arguments`` (the function ``sageattn`` itself dispatches
    to, as it calls it; 2.2's ``sageattn`` drops ``smooth_k``, so the functions' own default, on, is
    kept, as in ComfyUI), each ``f(q, k, v, layout, scale)``; None when sageattention is not installed
    or lacks the function. ``fn_lse`` (for kv_chunks) calls the same function with ``return_lse=True``
    and ``smooth_k=False`` on keys the plan already centred (``Envelope.lse_centred_k``).

    Signatures (core.py): every function is ``f(q, k, v, tensor_layout="HND", is_causal=False,
    [qk_quant_gran=...], sm_scale=None, [pv_accum_dtype=...], smooth_k=True, [smooth_v=False],
    return_lse=False, **kwargs)``."""
    def call():
        try:
            import sageattention
        except Exception:
            return None
        f = getattr(sageattention, function, None)
        if f is None:
            return None

        def fn(q, k, v, layout, scale):
            return f(q, k, v, tensor_layout=layout, is_causal=False, sm_scale=scale, **arguments)

        def fn_lse(q, k, v, layout, scale):
            # keys arrive centred on the whole sequence's mean (Envelope.lse_centred_k): no
            # per-chunk smoothing, and core.py returns lse / log2(e) with no rounded correction
            return f(q, k, v, tensor_layout=layout, is_causal=False, sm_scale=scale,
                     return_lse=True, **{**arguments, "smooth_k": False})

        return fn, fn_lse
    return call


def sage2_family(envelope: Envelope, function: str, arguments: dict, runs_on: tuple, tolerance: float,
                 drift_rank: int, benign_error: float | None = None) -> KernelFamily:
    """A sage 2.2 family: ``envelope`` called as ``sageattention.<function>(**arguments)``; ``runs_on``:
    the archs whose 2.2.0 extension carries its kernels (setup.py:166, :178, :196); ``drift_rank``: see
    KernelFamily (attention.move_order.DRIFT_RANKS)."""
    return KernelFamily(envelope, kind="sage", tolerance=tolerance, call=sage2_call(function, arguments),
                        function=f"sageattention.{function}", arguments=dict(arguments), runs_on=runs_on,
                        drift_rank=drift_rank, benign_error=benign_error)
