"""comfy-kitchen's ``int8_attention`` (what ComfyUI's ``--use-ck-attention`` runs) as kernel families.

Read from the comfy-kitchen 0.2.40 wheel (``comfy_kitchen/sage_attention.py``; citations
``ck0.2.40:sage_attention.py:LINE``) and from the public comfy-kitchen sources of its CUDA
launchers (the wheel ships them compiled only; the check messages below are the strings in
0.2.40's ``backends/cuda/_C.abi3.so``).

What ``int8_attention(q, k, v, scale=None, attn_mask=None)`` does (sage_attention.py:597-636 ->
``_int8_attention_cuda`` :208-317):

* takes ``[B, H, L, D]`` tensors with any strides, last dim contiguous (:191-192), fp32/fp16/bf16
  (:23, :159-160), GQA (:185-188), any head_dim <= 256 (:189-190; 64/128/256 run in place,
  others are zero-padded into fresh copies, :218-229);
* allocates its own contiguous HND int8 copies of q and k (:260-261), a packed V
  ``[B*H_kv*D, ceil(L_k / cta_k) * cta_k]`` int8 (:277-282, cta_k = 128 for D >= 128 and
  L_k > 1024 without a mask, else 64, :57-65), fp32 scales (:263-283) and the output
  ``[B, H, L_q, D]`` (:286-288);
* runs everything on torch's current stream (:295) and returns no LSE (no such argument) --
  so key/value chunks cannot be merged: past a limit only head groups and query chunks apply.

The limits are host-side checks that raise ``std::overflow_error`` (a Python exception,
nothing launched):

* 0.2.29-0.2.35 (comfy-kitchen #178: "tensor strides exceed int32 range", first failing key
  length 299,521 at 56x128 on an RTX 5090): the batch strides of its own int8 copies must fit
  int32 -- ``H_q*L_q*D``, ``H_kv*L_k*D`` and ``H_kv*D*pad(L_k)`` (the packed V; pad to cta_k is
  why 299,520 passes and 299,521 fails). Evaluated per call, batch size 1 included.
* 0.2.36-0.2.40: the launcher computes batch/head bases in 64 bits when they pass uint32 and checks
  only within-head offsets (``L_q*D``, ``L_k*D``, ``D*pad(L_k)``, ``L_q*D`` for the output:
  "sage_attn: within-head offsets exceed int32 range") plus "sage_attn: within-head strides
  exceed int32 range" -- taken here as the caller's token and channel strides fitting int32.
  At 56x128 that is ~16.7M tokens per head: no H3 length reaches it.

Where the change landed: the ``_C.abi3.so`` of the PyPI wheels 0.2.33, 0.2.34 and 0.2.35 hold
the old message "tensor strides exceed int32 range"; 0.2.36, 0.2.38, 0.2.39 and 0.2.40 hold
"within-head offsets exceed int32 range" instead (0.2.29 is not on PyPI). On the H200
(bench/kernels/gpu_kvchunks.py ``ck_probe``, bench/results/ck239_probe_h200.json and
ck240_probe_h200.json) 0.2.39 and 0.2.40 take 320,000 tokens on either side, in every layout,
with no error and rel. L2 0.008-0.018 vs SDPA; 0.2.35 raises ``OverflowError: sage_sdpa: tensor
strides exceed int32 range`` from 299,521 keys (the packed V, padded to 128) and from 299,594
queries (``56*L_q*128`` > INT_MAX), in every layout, as the rule below predicts
(bench/results/ck235_probe_h200.json; tests/unit/test_ck_envelope_measured.py holds each probe to
the envelope).

Unknown versions (< 0.2.29 has no ``int8_attention``; newer than 0.2.40 unread) get the
0.2.29 rules (conservative: they only cost head groups, 1.0003x at 314,437 tokens on the
H200, bench/results/ck239_families_h200.json).

Alignment (ComfyUI #15494, #15529; rule "align", :class:`AlignRule`): ``sage_sdpa`` hands the
caller's q/k/v (or the zero-padded copies, for a head_dim other than 64/128/256) with their own
strides to two quantisers whose host-side checks throw ``std::runtime_error`` (a Python
``RuntimeError``, before anything reads the tensor) -- both messages are in 0.2.40's
``_C.abi3.so``; the conditions are those of the public sources (``quant_qk_int8.cu``
``launch_quant_qk_per_thread_int8``, ``quant_v_int8.cu`` ``launch_quant_v_int8_kernel``, tag
v0.2.31, unchanged in substance since v0.2.29):

* q and k: ``data_ptr % (4 * element_size) == 0`` (8 bytes for fp16/bf16, 16 for fp32) and, for each
  of the B, H, N axes, ``stride > 0 and stride % 4 == 0`` (elements) --
  "quant_qk_per_thread_int8: Q/K base pointers and B/H/N strides must preserve 4-element alignment";
* v: ``data_ptr % 16 == 0`` and ``stride * element_size % 16 == 0`` (bytes; a zero stride passes) --
  "quant_v_int8: V base pointer and B/H/N strides must be 16-byte aligned".

Since 0.2.31 (comfy-kitchen #112, commit 9816d22) an axis of extent 1 is exempt: torch <= 2.9
rewrites such a stride to 1 on the way through DLPack (pytorch #83069), which is what #15494 and
#15529 hit -- H3's ``[1, 56, S, 128]`` views (strides ``(S*21504, 128, 21504, 1)``, all aligned) arrived
with a batch stride of 1 on torch 2.9.1 with comfy-kitchen 0.2.30. That fix is comfy-kitchen's;
ComfyUI's PR #15518 (``.contiguous()`` in ``_comfy_kitchen_int8_inputs``) was closed unmerged and
ComfyUI moved to 0.2.31 (#15564). The precondition itself stays in 0.2.40: a view at an element
offset that is not a multiple of 4 (8 for v in fp16/bf16), or with such a token/head stride, still
raises. A contiguous copy is aligned, so the planner repacks (``planner.SOFT_RULES``).
"""
from __future__ import annotations

from dataclasses import dataclass

from .envelope import AttnCall, Envelope, IndexTerm, TensorDesc, Violation, register
from .family import DEFAULT_TOLERANCE, KernelFamily
from ..facts.versions import version_tuple

SRC = "ck0.2.40:comfy_kitchen/sage_attention.py"
CK_ISSUE = "comfy-kitchen #178"
LAUNCHER = "comfy-kitchen sage_attn_launcher.cu launch_sage_attn_kernel ('within-head offsets' check)"


def _cite(line: str) -> str:
    return f"{SRC}:{line}"


def kernel_head_dim(d: int) -> int:
    """The tile width the kernel runs (sage_attention.py:219-224)."""
    return 64 if d <= 64 else 128 if d <= 128 else 256


def cta_k(d: int, kv_len: int, has_mask: bool = False) -> int:
    """Key tile (sage_attention.py:57-65)."""
    return 128 if (not has_mask and kernel_head_dim(d) >= 128 and kv_len > 1024) else 64


def packed_v_len(call: AttnCall) -> int:
    c = cta_k(call.head_dim, call.kv_len, call.has_mask)
    return -(-call.kv_len // c) * c


# comfy-kitchen's own copies as roles of the call (:260-288): int8 q and k, contiguous HND at
# the kernel's head dim, and the packed V [B*H_kv*D, pad(L_k)] seen as (b, h_kv, pad(L_k), D).
def _q_int8(call: AttnCall) -> TensorDesc:
    b, h, lq, _ = call.q.shape
    return TensorDesc.contiguous((b, h, lq, kernel_head_dim(call.head_dim)), "HND")


def _k_int8(call: AttnCall) -> TensorDesc:
    b, hk, lk, _ = call.k.shape
    return TensorDesc.contiguous((b, hk, lk, kernel_head_dim(call.head_dim)), "HND")


def _v_int8(call: AttnCall) -> TensorDesc:
    b, hk = call.k.shape[:2]
    dk, pad = kernel_head_dim(call.head_dim), packed_v_len(call)
    return TensorDesc((b, hk, pad, dk), (hk * dk * pad, dk * pad, 1, pad))


ROLES = {"q_int8": _q_int8, "k_int8": _k_int8, "v_int8": _v_int8}


def _stride_terms(kernel: str, axes: tuple[tuple[str, str], ...], cite: str) -> tuple[IndexTerm, ...]:
    """comfy-kitchen's int32 checks are on strides (host-side checks that raise, per launch:
    head groups and query chunks fix them)."""
    return tuple(IndexTerm(kernel, t, a, "i32", cite, stride_only=True) for t, a in axes)


# 0.2.29-0.2.35: every int8 copy's batch stride (H*L*D; the packed V's H_kv*D*pad) fits int32
_BATCH_STRIDES = _stride_terms("sage_sdpa batch stride", (("q_int8", "b"), ("k_int8", "b"), ("v_int8", "b")),
                               f"{CK_ISSUE} (sage_sdpa's int32 stride check); {_cite('260-282')}")
# every version: the within-head offsets L_q*D, L_k*D, D*pad(L_k) (each copy's head stride) and
# the caller's token and channel strides
_WITHIN_HEAD = (
    _stride_terms("sage_attn within-head offset", (("q_int8", "h"), ("k_int8", "h"), ("v_int8", "h")),
                  f"{LAUNCHER}; {_cite('260-288')}")
    + _stride_terms("sage_attn within-head stride", tuple((t, a) for t in "qkv" for a in "sd"),
                    "comfy-kitchen 0.2.40 _C.abi3.so: 'sage_attn: within-head strides exceed int32 range'")
)


ALIGN_ISSUE = "#15494"
QK_ALIGN = ("comfy-kitchen quant_qk_int8.cu launch_quant_qk_per_thread_int8, 0.2.40 _C.abi3.so: "
            "'quant_qk_per_thread_int8: Q/K base pointers and B/H/N strides must preserve 4-element alignment'")
V_ALIGN = ("comfy-kitchen quant_v_int8.cu launch_quant_v_int8_kernel, 0.2.40 _C.abi3.so: "
           "'quant_v_int8: V base pointer and B/H/N strides must be 16-byte aligned'")


@dataclass(frozen=True)
class AlignRule:
    """The quantisers' base-pointer and stride checks (module docstring; ComfyUI #15494).

    ``size_one_exempt``: an axis of extent 1 is not checked (0.2.31+, comfy-kitchen #112). The
    0.2.29-0.2.35 envelope checks it (0.2.29/0.2.30 do), which costs at most a copy."""
    family: str
    size_one_exempt: bool = True

    def __call__(self, call: AttnCall) -> list[Violation]:
        if kernel_head_dim(call.head_dim) != call.head_dim:
            return []                    # zero-padded into fresh copies first (:218-229)
        elt = call.elt_bytes             # the launchers: 4 for fp32, else 2 (sizeof(half))
        out: list[Violation] = []
        for name in ("q", "k", "v"):
            t = getattr(call, name)
            if name == "v":
                base, cite, ok = 16, V_ALIGN, lambda s: s * elt % 16 == 0
                need = "a multiple of 16 bytes"
            else:
                base, cite, ok = 4 * elt, QK_ALIGN, lambda s: s > 0 and s % 4 == 0
                need = "a positive multiple of 4 elements"
            cite = f"{ALIGN_ISSUE}; {cite}"
            if t.align < base:
                out.append(Violation(self.family, "align",
                                     f"{name} base pointer aligned to {t.align} bytes, the quantiser needs {base}",
                                     tensor=name, axis="base", value=t.align, limit=base, cite=cite))
            for ax, axis in enumerate("bhs"):
                if self.size_one_exempt and t.shape[ax] < 2:
                    continue
                if not ok(t.stride[ax]):
                    out.append(Violation(self.family, "align",
                                         f"{name}.{axis} stride {t.stride[ax]:,} (extent {t.shape[ax]:,}) is not {need}",
                                         tensor=name, axis=axis, value=t.stride[ax], cite=cite))
        return out


def _temp_bytes(call: AttnCall) -> int:
    b, h, lq, d = call.q.shape
    hk, lk = call.kv_heads, call.kv_len
    dk = kernel_head_dim(d)
    c = cta_k(d, lk, call.has_mask)
    pad = packed_v_len(call)
    n = b * h * lq * dk + b * hk * lk * dk + b * hk * dk * pad            # int8 q, k, packed v
    n += 4 * (b * h * (-(-lq // 128)) * (64 if dk == 256 else 32))       # q_scale :263-269
    n += 4 * (b * hk * (-(-lk // c)) * 4 + b * hk * dk) + 4 * b * hk     # k_scale, v_scale, anchors
    out_elt = 2                                                           # fp16/bf16 out (:285)
    n += out_elt * b * h * lq * dk
    if dk != d:
        n += call.elt_bytes * (b * h * lq * dk + 2 * b * hk * lk * dk)   # padded copies (:225-229)
    if call.dtype == "float32":
        n += 4 * b * h * lq * d                                          # output.float() (:317)
    return n


def _envelope(family: str, batch_strides: bool, note: str) -> Envelope:
    # batch_strides marks 0.2.29-0.2.35, which also hold the versions without #112's exemption
    return register(Envelope(
        family=family,
        source=f"comfy-kitchen int8_attention ({SRC}; {CK_ISSUE})",
        head_dims=(64, 128, 256),            # run in place; others are padded copies (:218-229)
        dtypes=("float16", "bfloat16", "float32"),
        supports_mask=False,                 # it takes attn_mask, but SafeAttention sends masks to SDPA
        terms=(_BATCH_STRIDES if batch_strides else ()) + _WITHIN_HEAD,
        roles=ROLES,
        launches_on_legacy_stream=False,     # current stream (:295)
        temp_bytes=_temp_bytes,
        returns_lse=False,                   # no LSE: no kv_chunks
        extra_rules=(AlignRule(family, size_one_exempt=not batch_strides),),
        note=note,
    ))


CK_INT8 = _envelope("ck_int8", False,
                    "comfy-kitchen 0.2.36-0.2.40 int8_attention: 64-bit batch/head bases, int32 within-head offsets.")
CK_INT8_PRE236 = _envelope("ck_int8_pre236", True,
                           "comfy-kitchen 0.2.29-0.2.35 int8_attention: every int8 copy's batch stride must "
                           "fit int32 (comfy-kitchen #178: 299,521 keys at 56x128 raise OverflowError).")


#: the comfy-kitchen versions each envelope stands for, as Preflight and the demo name them
VERSION_RANGES = {"ck_int8": "0.2.36-0.2.40", "ck_int8_pre236": "0.2.29-0.2.35"}


def ck_family_for(version: str | None) -> str | None:
    """Envelope family of comfy-kitchen ``version``'s int8_attention; None if it has none."""
    v = version_tuple(version)
    if not v:
        return None
    if v < (0, 2, 29):
        return None                                   # no int8_attention before 0.2.29
    # 0.2.36-0.2.40 checked (wheel strings + H200 probe); newer ones unread: conservative
    return "ck_int8" if (0, 2, 36) <= v[:3] <= (0, 2, 40) else "ck_int8_pre236"


def _call():
    """comfy-kitchen's ``int8_attention`` as ``fn(q, k, v, layout, scale)`` (no LSE), None when not
    installed. It takes ``[B,H,L,D]`` with any strides, so an NHD plan hands it transposed views."""
    try:
        import comfy_kitchen
        f = comfy_kitchen.int8_attention
    except Exception:
        return None

    def fn(q, k, v, layout, scale):
        if layout == "NHD":
            return f(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale).transpose(1, 2)
        return f(q, k, v, scale=scale)

    return fn, None


def _family(env: Envelope) -> KernelFamily:
    # detected where the runtime's comfy-kitchen version has this envelope (facts.devices: ck_family_for);
    # both versions' envelopes time the same kernel: one kernel_table.json entry (ck_int8)
    return KernelFamily(env, kind="ck", tolerance=DEFAULT_TOLERANCE,    # no family-specific number measured
                        call=_call, function="comfy_kitchen.int8_attention", table_name="ck_int8",
                        drift_rank=0,    # channels rotated before int8: flat under outliers (move_order.DRIFT_RANKS)
                        # random H3-shaped inputs, 38k-169k tokens, vs SDPA: 0.0169-0.0173 (ck240_families_h200.json)
                        benign_error=0.0173)


KERNEL_FAMILIES = (_family(CK_INT8), _family(CK_INT8_PRE236))
