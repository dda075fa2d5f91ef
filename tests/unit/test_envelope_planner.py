"""Envelope and planner boundaries (pure data, no GPU)."""
import dataclasses

import pytest

from safe_ops.families.envelope import I32_MAX, AttnCall, TensorDesc, check
from safe_ops.families.sage1 import SAGE1_TRITON
from safe_ops.families.sdpa import SDPA
from safe_ops.attention.planner import Plan, choose, plan_for

H3_STRIDE = 3 * 56 * 128   # 21,504: the qkv_proj row of MiniMax H3


def h3_view(S, heads=56, d=128, b=1):
    """H3's strided q/k/v views: [b, heads, S, d] into a [S, 3*heads*d] buffer."""
    return TensorDesc((b, heads, S, d), (S * 3 * heads * d, d, 3 * heads * d, 1))


def call_of(q, k=None, v=None, dtype="bfloat16", layout="HND", **kw):
    k = k or q
    v = v or k
    return AttnCall(q, k, v, dtype, layout, **kw)


def index_violations(call, env=SAGE1_TRITON):
    return [v for v in check(call, env) if v.rule == "index"]


# ------------------------------------------------------------------ boundaries
@pytest.mark.parametrize("S,ok", [(38_000, True), (99_865, True), (99_866, False), (169_000, False)])
def test_sage1_strided_int32_boundary(S, ok):
    viol = index_violations(call_of(h3_view(S)))
    assert (not viol) == ok
    if not ok:
        v = viol[0]
        assert v.tensor in ("q", "k") and v.axis == "s"
        assert v.value == (S - 1) * H3_STRIDE and v.limit == I32_MAX
        assert "quant_per_block.py" in v.cite


@pytest.mark.parametrize("S,ok", [(305_040, True), (305_041, False)])
def test_sage1_contiguous_head_term_boundary(S, ok):
    """Per-term rule: head 55 x S*128 must fit in int32 (measured 305,040 ok / 305,041 wrong)."""
    t = TensorDesc.contiguous((1, 56, S, 128), "HND")
    viol = index_violations(call_of(t))
    assert (not viol) == ok
    if not ok:
        assert {v.axis for v in viol} == {"h"}


def test_sum_based_estimate_is_not_used():
    """~299,600 (sum of terms) is inside the envelope: only each product must fit."""
    t = TensorDesc.contiguous((1, 56, 299_700, 128), "HND")
    assert not index_violations(call_of(t))


def test_nhd_contiguous_token_term():
    """NHD contiguous: token stride is heads*d; (S-1)*7168 overflows past 299,593 tokens."""
    limit = I32_MAX // 7168 + 1
    ok = TensorDesc.contiguous((1, 56, limit, 128), "NHD")
    bad = TensorDesc.contiguous((1, 56, limit + 1, 128), "NHD")
    assert not index_violations(call_of(ok, layout="NHD"))
    assert index_violations(call_of(bad, layout="NHD"))


def test_batch_term_and_i64_stride_promotion():
    # batch term: (B-1) * batch stride in i32
    S = 20_000
    t = TensorDesc.contiguous((2, 56, S, 128), "HND")        # batch stride 143M: fits
    assert not index_violations(call_of(t))
    big = TensorDesc((3, 8, 64, 128), (1_100_000_000, 8192, 128, 1))   # (3-1)*1.1e9 > i32
    assert any(v.axis == "b" for v in index_violations(call_of(big)))
    # a stride that itself exceeds i32 is passed as i64 by Triton: no overflow
    huge = TensorDesc((2, 8, 64, 128), (3_000_000_000, 8192, 128, 1))
    assert not any(v.axis == "b" for v in index_violations(call_of(huge)))


@pytest.mark.parametrize("d,ok", [(64, True), (96, True), (128, True), (256, False), (80, False)])
def test_head_dims(d, ok):
    t = TensorDesc.contiguous((1, 8, 1024, d), "HND")
    viol = check(call_of(t), SAGE1_TRITON)
    assert (not viol) == ok
    if not ok:
        assert viol[0].rule == "head_dim"


@pytest.mark.parametrize("dtype,ok", [("float16", True), ("bfloat16", True), ("float32", True),
                                      ("float64", False), ("float8_e4m3fn", False)])
def test_dtypes(dtype, ok):
    t = TensorDesc.contiguous((1, 8, 1024, 64), "HND")
    assert (not check(call_of(t, dtype=dtype), SAGE1_TRITON)) == ok


def test_mask_and_device_rules():
    t = TensorDesc.contiguous((1, 8, 1024, 64), "HND")
    assert [v.rule for v in check(call_of(t, has_mask=True), SAGE1_TRITON)] == ["mask"]
    assert [v.rule for v in check(call_of(t, device="cpu"), SAGE1_TRITON)] == ["device"]
    assert not check(call_of(t, has_mask=True, device="cpu"), SDPA)


def test_gqa_heads_and_noncontiguous_last_dim():
    q = TensorDesc.contiguous((1, 8, 256, 64), "HND")
    k = TensorDesc.contiguous((1, 2, 256, 64), "HND")
    assert not check(call_of(q, k, k), SAGE1_TRITON)
    k3 = TensorDesc.contiguous((1, 3, 256, 64), "HND")
    assert any(v.rule == "layout" for v in check(call_of(q, k3, k3), SAGE1_TRITON))
    bad = TensorDesc((1, 8, 256, 64), (8 * 256 * 64 * 2, 256 * 64 * 2, 64 * 2, 2))
    assert any(v.rule == "layout" for v in check(call_of(bad), SAGE1_TRITON))


# --------------------------------------------------------------------- planner
def test_direct_when_inside():
    p = plan_for(call_of(h3_view(99_865)), SAGE1_TRITON)
    assert (p.kind, p.kernel, p.layout, p.extra_bytes, p.launches) == ("direct", "sage1_triton", "HND", 0, 1)
    # its kernel temporaries are held to the H200's measurement in test_predictions_measured.py
    # (sageattn 1.0.6's own allocations, and the direct plan's peak at 38,000 tokens)


@pytest.mark.parametrize("S", [99_866, 169_000, 199_729])
def test_repack_fixes_strided_overflow(S):
    call = call_of(h3_view(S))
    p = plan_for(call, SAGE1_TRITON)
    assert p.kind == "repack" and set(p.repack) == {"q", "k"}     # v's token term is not computed in i32
    assert p.layout == "NHD"      # H3's views are token-major: an NHD copy streams rows, HND would transpose
    assert p.extra_bytes == 2 * 56 * S * 128 * 2
    assert p.reasons and f"{S:,}" in p.reasons[0]
    # every launch of the plan is inside the envelope
    from safe_ops.attention.planner import sub_call
    assert not check(sub_call(call, 56, S, p.repack, p.layout), SAGE1_TRITON)


def test_head_groups_past_contiguous_head_limit():
    S = 305_041
    p = plan_for(call_of(h3_view(S)), SAGE1_TRITON)
    assert p.kind == "head_groups" and p.head_group == 28 and p.launches == 2
    # the temporaries of one launch are those of one 28-head group, not of the whole call
    assert p.kernel_temp_bytes == SAGE1_TRITON.temp_bytes(call_of(h3_view(S, heads=28)))
    assert p.kernel_temp_bytes < SAGE1_TRITON.temp_bytes(call_of(h3_view(S)))
    t = TensorDesc.contiguous((1, 56, S, 128), "HND")
    p2 = plan_for(call_of(t), SAGE1_TRITON)
    assert p2.kind == "head_groups" and not p2.repack and p2.layout == "HND"


def test_budget_forces_smaller_groups_or_none():
    S = 169_000
    call = call_of(h3_view(S))
    full = plan_for(call, SAGE1_TRITON)
    tight = plan_for(call, SAGE1_TRITON, budget_bytes=full.extra_bytes // 3)
    assert tight is not None and tight.extra_bytes <= full.extra_bytes // 3
    assert tight.launches > 1
    assert plan_for(call, SAGE1_TRITON, budget_bytes=1024) is None


def test_query_chunks_when_only_query_side_overflows():
    """Long strided queries against short contiguous keys: chunk queries, copy nothing."""
    q = h3_view(150_000)
    k = TensorDesc.contiguous((1, 56, 512, 128), "HND")
    p = plan_for(call_of(q, k, k), SAGE1_TRITON, budget_bytes=int(4.5 * 2**30))   # copies + kernel temporaries: no room for a full q copy
    assert p.kind == "query_chunks" and p.q_chunk <= 99_865 and not p.repack


def test_choose_falls_back_to_sdpa_with_reasons():
    t = TensorDesc.contiguous((1, 8, 1024, 256), "HND")
    ch = choose(call_of(t), [SAGE1_TRITON, SDPA])
    assert ch.kind == "sdpa" and "head_dim" in ch.reasons[0]
    t2 = TensorDesc.contiguous((1, 8, 1024, 128), "HND")
    ch2 = choose(call_of(t2, has_mask=True), [SAGE1_TRITON, SDPA])
    assert ch2.kind == "sdpa" and "mask" in ch2.reasons[0]
    assert choose(call_of(t2), [SDPA]) == Plan("sdpa", "sdpa", "HND")


def test_plan_is_printable_data():
    p = plan_for(call_of(h3_view(169_000)), SAGE1_TRITON)
    s = str(p)
    assert "repack q/k" in s and "because" in s and "169,000" in s


# ------------------------------------------------------------------ kv_chunks
def test_sm120_length_rule_gets_key_chunks_not_sdpa():
    """sage2_sm120_fp8pv refuses kv_len >= 150,000 (SageAttention #388): past it the planner
    splits the keys into equal 128-multiples below the rule, merged by LSE -- not SDPA."""
    from safe_ops.families.sage2 import FP8_SM120_MAX_KV_LEN
    from safe_ops.families.sage2_sm120_fp8pv import SAGE2_SM120_FP8PV
    from safe_ops.attention.planner import sub_call
    for S in (150_000, 169_000, 230_000, 314_437):
        call = call_of(h3_view(S), layout="NHD")
        ch = choose(call, [SAGE2_SM120_FP8PV, SDPA])
        assert ch.kind == "kv_chunks" and ch.kernel == "sage2_sm120_fp8pv", ch
        assert ch.kv_chunk < FP8_SM120_MAX_KV_LEN and ch.kv_chunk % 128 == 0
        n = -(-S // ch.kv_chunk)
        assert (n - 1) * ch.kv_chunk < S and "k" in ch.repack          # centred key copies
        assert not check(sub_call(call, ch.head_group or 56, ch.q_chunk or S, ch.repack, ch.layout,
                                   ch.kv_chunk), SAGE2_SM120_FP8PV)
        assert "key tokens per launch merged by log-sum-exp" in str(ch)


def test_priced_choice_counts_the_lse_kernel():
    """auto on a measured GPU (choose with TFLOP/s): a sage family measured faster than SDPA
    in-limit keeps its kv_chunks plan only while its LSE kernel (x1.048, measured) and merge
    still beat SDPA; below that margin SDPA runs, chosen on purpose (no fallback reasons). A
    family that cannot run the call at all still makes SDPA a fallback."""
    from safe_ops.families.sage2 import LSE_TIME_FACTOR
    from safe_ops.families.sage2_sm120_fp8pv import SAGE2_SM120_FP8PV
    from safe_ops.attention.planner import estimated_us
    call = call_of(h3_view(169_000), layout="NHD")
    kv = choose(call, [SAGE2_SM120_FP8PV, SDPA])                       # unpriced: first that fits
    assert kv.kind == "kv_chunks" and kv.time_factor == LSE_TIME_FACTOR == SAGE2_SM120_FP8PV.lse_time_factor
    assert "(LSE kernel x1.048)" in kv.describe()
    direct = plan_for(call_of(h3_view(100_000), layout="NHD"), SAGE2_SM120_FP8PV)
    assert direct.kind == "direct" and direct.time_factor == 1.0
    # about the lead over SDPA that sage needs for its chunked plan to pay: the LSE kernel plus
    # the merge's copies, at SDPA's rate
    even = 500.0 * estimated_us(call, kv, 500.0) / estimated_us(call, Plan("sdpa", "sdpa", "HND"), 500.0)
    assert LSE_TIME_FACTOR < even / 500.0 < LSE_TIME_FACTOR + 0.02
    fast = choose(call, [SAGE2_SM120_FP8PV, SDPA], tflops={"sage2_sm120_fp8pv": 1.2 * even, "sdpa": 500.0})
    assert fast == kv
    slow = choose(call, [SAGE2_SM120_FP8PV, SDPA], tflops={"sage2_sm120_fp8pv": 0.98 * even, "sdpa": 500.0})
    assert slow.kind == "sdpa" and slow.reasons == ()                   # priced, not a fallback
    assert slow.note.startswith("priced: SDPA ~") and "vs kv_chunks on sage2_sm120_fp8pv ~" in slow.describe()
    # in limits (no LSE, no copies) the same 2 % lead over SDPA keeps sage
    small = call_of(h3_view(100_000), layout="NHD")
    assert choose(small, [SAGE2_SM120_FP8PV, SDPA], tflops={"sage2_sm120_fp8pv": 510.0, "sdpa": 500.0}) == direct
    # a family ahead of SDPA that cannot run the call: SDPA with its reasons
    masked = choose(call_of(h3_view(100_000), layout="NHD", has_mask=True), [SAGE2_SM120_FP8PV, SDPA],
                    tflops={"sage2_sm120_fp8pv": 900.0, "sdpa": 500.0})
    assert masked.kind == "sdpa" and masked.reasons and "sage2_sm120_fp8pv" in masked.reasons[0]


def test_no_lse_no_key_chunks():
    """A family that cannot return its LSE (sage 1.0.6 sageattn) keeps length rules hard."""
    from safe_ops.families.rules import KvLenRule
    env = dataclasses.replace(SAGE1_TRITON, extra_rules=(KvLenRule("sage1_triton", 150_000, "t", "t"),))
    assert not env.returns_lse
    t = TensorDesc.contiguous((1, 56, 169_000, 128), "NHD")
    assert plan_for(call_of(t, layout="NHD"), env) is None
    ch = choose(call_of(t, layout="NHD"), [env, SDPA])
    assert ch.kind == "sdpa" and "kv_len" in ch.reasons[0]
    lse_env = dataclasses.replace(env, returns_lse=True)
    assert plan_for(call_of(t, layout="NHD"), lse_env).kind == "kv_chunks"


def test_budget_counts_kernel_temporaries():
    """A direct call whose kernel temporaries exceed the budget is not 'direct' any more."""
    call = call_of(h3_view(99_865))
    p = plan_for(call, SAGE1_TRITON)
    assert p.kind == "direct" and p.peak_bytes == p.kernel_temp_bytes == SAGE1_TRITON.temp_bytes(call)
    tight = plan_for(call, SAGE1_TRITON, budget_bytes=p.kernel_temp_bytes - 1)
    assert tight is not None and tight.kind != "direct" and tight.peak_bytes < p.kernel_temp_bytes
    assert "budget" in tight.reasons[0]


# ------------------------------------------------------------------ comfy-kitchen
def test_ck_pre236_boundary_is_issue_178():
    """comfy-kitchen 0.2.29-0.2.35: 299,520 keys pass, 299,521 raise (#178, RTX 5090 bisection):
    the packed V pads to cta_k=128, 56*128*299,648 > INT_MAX."""
    from safe_ops.families.ck_int8 import CK_INT8, CK_INT8_PRE236
    for layout in ("NHD", "HND"):
        ok = TensorDesc.contiguous((1, 56, 299_520, 128), layout)
        bad = TensorDesc.contiguous((1, 56, 299_521, 128), layout)
        assert not check(call_of(ok, layout=layout), CK_INT8_PRE236)
        viol = check(call_of(bad, layout=layout), CK_INT8_PRE236)
        assert [v.tensor for v in viol] == ["v_int8"] and viol[0].rule == "index"
        assert not check(call_of(bad, layout=layout), CK_INT8)          # 0.2.36+: 64-bit bases
    # H3's strided views at the 50 s 720p length: head groups, no SDPA; never kv chunks (no LSE)
    p = plan_for(call_of(h3_view(314_437), layout="NHD"), CK_INT8_PRE236)
    assert p.kind == "head_groups" and not p.kv_chunk and p.head_group * 128 * 314_496 <= I32_MAX
    assert not CK_INT8_PRE236.returns_lse and not CK_INT8.returns_lse


def test_ck_within_head_limit_and_versions():
    from safe_ops.families.ck_int8 import CK_INT8, ck_family_for
    long_ = TensorDesc.contiguous((1, 2, 17_000_000, 128), "HND")     # 17M x 128 > INT_MAX per head
    # each int8 copy's within-head offset (L*D: its head stride) passes int32
    assert {(v.tensor, v.axis) for v in check(call_of(long_), CK_INT8)} == {
        ("q_int8", "h"), ("k_int8", "h"), ("v_int8", "h")}
    assert not check(call_of(TensorDesc.contiguous((1, 2, 16_000_000, 128), "HND")), CK_INT8)
    # the _C strings of the PyPI wheels: 0.2.35 has #178's check, 0.2.36 the 64-bit bases
    assert ck_family_for("0.2.40") == ck_family_for("0.2.39") == ck_family_for("0.2.36") == "ck_int8"
    assert ck_family_for("0.2.29") == ck_family_for("0.2.35") == "ck_int8_pre236"
    assert ck_family_for("0.2.41") == ck_family_for("0.3.0") == "ck_int8_pre236"   # unread: conservative
    assert ck_family_for("0.2.28") is None and ck_family_for("0.2.7") is None and ck_family_for(None) is None
