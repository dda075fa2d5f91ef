"""SageAttention 2.2.0 envelopes: boundaries from the kernels' index arithmetic (pure data, no GPU)."""
import pytest

from safe_ops.families import registry
from safe_ops.families import sage2 as S2
from safe_ops.families.envelope import FAMILIES, I32_MAX, U32_MAX, AttnCall, TensorDesc, check
from safe_ops.attention.planner import plan_for
from safe_ops.families.sage_dispatch import sage_family_for
from test_predictions_measured import KV_SECTION, assert_covers, assert_same_plan

# the sage 2.2 families as the registry holds them: envelopes, the function each is called through
# (sageattention.<name>, arguments) and the archs a 2.2.0 build carries it on
SAGE2 = [f for f in registry.families().values() if f.envelope.source == S2.SOURCE]
SAGE2_FAMILIES = tuple(f.envelope for f in SAGE2)
SAGEATTN_CALL = {f.name: (f.function.split(".", 1)[1], dict(f.arguments)) for f in SAGE2}
RUNS_ON = {f.name: f.runs_on for f in SAGE2 if f.runs_on}

H3_STRIDE = 3 * 56 * 128   # 21,504: one row of MiniMax H3's fused qkv_proj output


def h3_view(S, heads=56, d=128, b=1):
    """H3's strided q/k/v views [b, heads, S, d] into a [S, 3*heads*d] buffer (HND)."""
    return TensorDesc((b, heads, S, d), (S * H3_STRIDE, d, H3_STRIDE, 1))


def hnd(S, heads=56, d=128, b=1):
    return TensorDesc.contiguous((b, heads, S, d), "HND")


def nhd(S, heads=56, d=128, b=1):
    return TensorDesc.contiguous((b, heads, S, d), "NHD")


def call_of(desc, layout="HND", dtype="bfloat16", **kw):
    return AttnCall(desc, desc, desc, dtype, layout, **kw)


def viol(family, call, rule=None):
    return [v for v in check(call, FAMILIES[family]) if rule is None or v.rule == rule]


def assert_boundary(family, make, last_safe, rule=None):
    assert viol(family, make(last_safe), rule) == [], [str(v) for v in viol(family, make(last_safe), rule)]
    assert viol(family, make(last_safe + 1), rule) != []


# ----------------------------------------------------------- H3 strided views
# Triton per_thread / per_block quant: (S-1) * 21504 must fit int32 -> 99,865 ok, 99,866 faults
# (measured on an H200 with sage 2.2.0's per_thread quantiser, HAZARDS.md H-1).
@pytest.mark.parametrize("family", ["sage2_sm80", "sage2_sm86_triton", "sage2_sm89_fp8pv", "sage2_sm90"])
def test_triton_quant_families_h3_strided(family):
    assert_boundary(family, lambda S: call_of(h3_view(S)), 99_865)
    v = viol(family, call_of(h3_view(99_866)))
    # only q's token term: k is never indexed there, smooth_k quantises the dense `k - km` copy
    assert [(x.rule, x.tensor, x.axis, x.value, x.limit) for x in v] == [
        ("index", "q", "s", 99_865 * H3_STRIDE, I32_MAX)]
    assert "in i32" in v[0].detail


# CUDA per_warp quant + V transpose use uint32: (S-1) * 21504 must fit 2**32 -> the largest
# index is U32_MAX // 21504 = 199,728, i.e. S = 199,729 is the last safe length and 199,730 the
# first wrapped one (HAZARDS measured tail degradation at S = 199,730).
def test_perwarp_family_h3_strided_u32():
    assert U32_MAX // H3_STRIDE == 199_728
    assert_boundary("sage2_fp8pv_perwarp", lambda S: call_of(h3_view(S)), 199_729)
    v = viol("sage2_fp8pv_perwarp", call_of(h3_view(199_730)))
    # the caller's q/k read by the quantiser, its v by the transpose; every one the token term
    assert [(x.detail.split(":")[0], x.tensor, x.axis) for x in v] == [
        ("QuantInt8Kernel", "q", "s"), ("QuantInt8Kernel", "k", "s"), ("TransposePadPermuteKernel", "v", "s")]
    assert {(x.rule, x.value, x.limit) for x in v} == {("index", 199_729 * H3_STRIDE, U32_MAX)}
    # KJNodes PR #748's reproduced run (S = 200,064) is past the boundary, not the boundary
    assert viol("sage2_fp8pv_perwarp", call_of(h3_view(200_064)))


def test_sm120_length_rule_and_h3():
    # #388: FP8-PV on sm_120 limited to kv_len < 150,000 (evidence-based, not index arithmetic)
    assert_boundary("sage2_sm120_fp8pv", lambda S: call_of(h3_view(S)), 149_999)
    v = viol("sage2_sm120_fp8pv", call_of(h3_view(150_000)))
    assert [x.rule for x in v] == ["length"] and "#388" in v[0].cite
    # the index terms underneath are the per_warp ones
    assert_boundary("sage2_sm120_fp8pv", lambda S: call_of(h3_view(S)), 199_729, rule="index")


# ----------------------------------------------------------- contiguous HND / NHD
@pytest.mark.parametrize("family", ["sage2_sm80", "sage2_sm86_triton", "sage2_sm89_fp8pv"])
def test_triton_quant_families_contiguous(family):
    # HND: head 55 x S*128 in int32 (the per-term rule measured with sage 1.0.6: 305,040 / 305,041)
    assert_boundary(family, lambda S: call_of(hnd(S)), 305_040)
    # NHD: token (S-1) x 7168 in int32
    assert_boundary(family, lambda S: call_of(nhd(S), layout="NHD"), 299_594)


def test_sm90_contiguous_tma_int_strides():
    # v_fp8 [1, 56, 128, ceil128(S)] batch stride 7168*Spad reaches cuTensorMapEncodeTiled as int.
    # Measured on an H200: the encode fails (-> assert abort) at Spad 299,648, not at 299,520;
    # for q_int8 at S = 299,594, not at 299,593.
    assert_boundary("sage2_sm90", lambda S: call_of(hnd(S)), 299_520)
    assert_boundary("sage2_sm90", lambda S: call_of(nhd(S), layout="NHD"), 299_520)
    v = viol("sage2_sm90", call_of(hnd(299_521)))
    assert [(x.tensor, x.axis) for x in v] == [("v_t128", "b")]
    assert v[0].value == 56 * 128 * 299_648 > I32_MAX
    # at 299,594 q_int8's own batch stride 7168*S passes int32 too
    v = viol("sage2_sm90", call_of(hnd(299_594)))
    assert ("q:alloc", "b") in {(x.tensor, x.axis) for x in v}


def test_perwarp_contiguous():
    # HND: transposed fp8 V [1, 56, 128, ceil64(S)], head term 55 x 128*Spad in uint32
    assert_boundary("sage2_fp8pv_perwarp", lambda S: call_of(hnd(S)), 610_048)
    assert {x.tensor for x in viol("sage2_fp8pv_perwarp", call_of(hnd(610_049)))} == {"v_t"}
    # NHD: token (S-1) x 7168 in uint32
    assert_boundary("sage2_fp8pv_perwarp", lambda S: call_of(nhd(S), layout="NHD"), 599_187)


def test_h3_repacked_contiguous_raises_the_limit():
    """The planner's repack (H3 view -> contiguous HND) moves every family past 169k."""
    for fam in ("sage2_sm80", "sage2_sm86_triton", "sage2_sm89_fp8pv", "sage2_sm90"):
        assert viol(fam, call_of(h3_view(169_000))), fam
        assert viol(fam, call_of(hnd(169_000))) == [], fam
    # the all-CUDA per_warp path takes the strided view as is up to 199,729 (measured correct
    # at 149k-169k strided on an H200, HAZARDS.md H-1)
    assert viol("sage2_fp8pv_perwarp", call_of(h3_view(169_000))) == []


# ----------------------------------------------------------- derived tensors
def test_k_smooth_is_dense_in_k_order():
    k = h3_view(1000)
    ks = S2.dense_like(k)
    assert ks.stride == (1000 * 7168, 128, 7168, 1)      # k - km of the H3 view is NHD-dense
    assert S2.dense_like(hnd(1000)).stride == hnd(1000).stride
    assert S2.dense_like(nhd(1000)).stride == nhd(1000).stride


def test_v_transposed_shapes():
    c = call_of(hnd(1000))
    t = S2.v_transposed(c, c.v)
    assert t.shape == (1, 56, 1024, 128) and t.stride == (56 * 128 * 1024, 128 * 1024, 1, 1024)
    c = call_of(nhd(1000), layout="NHD")
    t = S2.v_transposed(c, c.v)
    assert t.stride == (128 * 56 * 1024, 1024, 1, 56 * 1024)
    # sm90 path pads V to 128 first when kv_len % 128 != 0 (a contiguous copy)
    c = call_of(h3_view(1000))
    assert S2.ROLES["v_pad128"](c).stride == hnd(1024).stride
    assert S2.ROLES["v_pad128"](call_of(h3_view(1024))).stride == h3_view(1024).stride


def test_bf16_v_copy_on_sm80():
    c16 = call_of(h3_view(1000), dtype="float16")
    assert S2.ROLES["v_fp16"](c16) == c16.v
    assert S2.ROLES["v_fp16"](call_of(h3_view(1000))).stride[2] == 7168


# ----------------------------------------------------------- sm90: sageattn pads V itself
@pytest.mark.parametrize("r", [0, 1, 64, 65, 127])
def test_sageattn_sm90_pads_v_itself(r):
    assert viol("sage2_sm90", call_of(hnd(128 * 300 + r))) == []


# ----------------------------------------------------------- shape rules
@pytest.mark.parametrize("family", [f.family for f in SAGE2_FAMILIES])
@pytest.mark.parametrize("d,ok", [(64, True), (128, True), (96, False), (256, False)])
def test_head_dims(family, d, ok):
    c = call_of(hnd(4096, d=d))
    assert (viol(family, c, "head_dim") == []) == ok


@pytest.mark.parametrize("family", [f.family for f in SAGE2_FAMILIES])
def test_dtype_mask_and_stream(family):
    env = FAMILIES[family]
    assert viol(family, call_of(hnd(4096), dtype="float32"), "dtype")
    assert viol(family, call_of(hnd(4096), has_mask=True), "mask")
    assert viol(family, call_of(hnd(4096), dtype="float16")) == []
    expect_legacy = family != "sage2_sm86_triton"
    assert env.launches_on_legacy_stream == expect_legacy


def test_gqa_and_layout_rules():
    q = hnd(4096, heads=56)
    k = hnd(4096, heads=8)
    assert viol("sage2_sm80", AttnCall(q, k, k, "bfloat16", "HND")) == []
    k7 = hnd(4096, heads=5)
    assert viol("sage2_sm80", AttnCall(q, k7, k7, "bfloat16", "HND"), "layout")


def test_sm120_temp_bytes_at_169k_cover_the_h200_measurement():
    """sageattn on sm_120 runs the per_warp function (core.py:153), whose own allocations the H200
    measured at 169,000 H3 tokens: bench/results/kvchunks_h200.json, the unchunked call of
    sage2_fp8pv_perwarp -- a direct plan, no copies, so its peak is the kernel's temporaries."""
    row = next(r for r in KV_SECTION["rows"] if r["S"] == 169_000)
    c = call_of(h3_view(169_000))
    perwarp = FAMILIES[row["family"]]
    plan = plan_for(c, perwarp)
    assert_same_plan(plan, row["plan_ref"], "per_warp at 169,000")
    assert (plan.kind, plan.extra_bytes) == ("direct", 0)
    sm120 = FAMILIES["sage2_sm120_fp8pv"].temp_bytes(c)
    assert sm120 == perwarp.temp_bytes(c)            # the same kernels, the same allocations
    assert_covers(sm120, row["peak_extra_ref"], "sage2_sm120_fp8pv kernel temporaries at 169,000")


@pytest.mark.parametrize("family", [f.family for f in SAGE2_FAMILIES])
def test_temp_bytes_are_affine_in_the_length(family):
    """What a sage 2 launch allocates is rows per token (int8 q/k, V copies, the output, per-block
    scales) plus a few per-head vectors (k's mean, V's scale and mean): at lengths that are
    multiples of every block and pad (128), equal steps in S cost equal bytes. A token costs at
    least its int8 q and k rows and its bf16 output row: 56 x 128 x (1 + 1 + 2) = 28,672 B."""
    n = 100 * 128
    t = [FAMILIES[family].temp_bytes(call_of(h3_view(m * n))) for m in (1, 2, 3)]
    assert t[2] - t[1] == t[1] - t[0] >= n * 28_672, t


# ----------------------------------------------------------- dispatch
@pytest.mark.parametrize("version,arch,family", [
    ("2.2.0", (8, 0), "sage2_sm80"),
    ("2.2.0", (8, 6), "sage2_sm86_triton"),
    ("2.2.0", (8, 7), None),
    ("2.2.0", (8, 9), "sage2_sm89_fp8pv"),
    ("2.2.0", (9, 0), "sage2_sm90"),
    ("2.2.0", (10, 0), None),
    ("2.2.0", (12, 0), "sage2_sm120_fp8pv"),
    ("2.2.0", (12, 1), "sage2_sm120_fp8pv"),
    ("2.2.0.post3+cu128torch2.8.0", (12, 0), "sage2_sm120_fp8pv"),
    ("2.2.0", (7, 5), None),
    ("2.1.1", (8, 9), None),
    ("2.0.1", (9, 0), None),
    ("1.0.6", (9, 0), "sage1_triton"),
    ("1.0.6", (7, 5), None),
    ("garbage", (9, 0), None),
])
def test_sage_family_for(version, arch, family):
    """The pairs the 2.2.0 dispatch table mapped before it moved to sage_dispatch (core.py:143-155)."""
    assert sage_family_for(version, arch) == family


def test_every_family_registered_cited_and_reachable():
    """Every shipped sage 2 family is registered, cites the 2.2.0 sources, and some runtime can
    select it: sageattn dispatches to it, or kernels adds it where a 2.2 build carries it."""
    dispatched = {sage_family_for("2.2.0", (major, minor)) for major in range(7, 13) for minor in range(10)}
    for f in SAGE2_FAMILIES:
        assert FAMILIES[f.family] is f
        for t in f.terms:
            assert t.cite.startswith("SageAttention@v2.2.0:"), t
        assert f.family in dispatched or (f.family in SAGEATTN_CALL and RUNS_ON.get(f.family)), f.family
    for fam, (fn, kw) in SAGEATTN_CALL.items():
        assert fam in FAMILIES and fn.startswith("sageattn_")
    assert set(RUNS_ON) <= set(SAGEATTN_CALL) and (dispatched - {None}) <= set(SAGEATTN_CALL)
    # families no runtime selects are documentation (docs/DESIGN.md), not shipped envelopes
    for gone in ("sage2_sm90_unpadded_v", "sage3_blackwell"):
        assert gone not in FAMILIES and gone not in {f.family for f in SAGE2_FAMILIES}


def test_roles_sage_makes_are_checked_by_check_itself():
    """The tensors sage makes (k - km, transposed/fp8 V, ...) are ordinary roles: their terms sit in
    Envelope.terms and check() alone reports them -- no extra rule is needed for them."""
    import dataclasses
    bare = {f.family: dataclasses.replace(f, extra_rules=()) for f in SAGE2_FAMILIES}
    # per_warp HND past 610,048: only the transposed fp8 V (role v_t) overflows
    v = check(call_of(hnd(610_049)), bare["sage2_fp8pv_perwarp"])
    assert v and {x.tensor for x in v} == {"v_t"} and all(x.rule == "index" for x in v)
    # k - km of H3's view, dense NHD: token stride 7,168 in i32 past 299,594
    v = check(call_of(h3_view(299_595), layout="NHD"), bare["sage2_sm80"])
    assert ("k_smooth", "s") in {(x.tensor, x.axis) for x in v}
    # sm90's TMA strides of the 128-padded transposed V, whatever the extent
    v = check(call_of(hnd(299_521)), bare["sage2_sm90"])
    assert [(x.tensor, x.axis) for x in v] == [("v_t128", "b")]
    # the only rule left beside the terms is sm_120's evidence-based length limit
    assert {type(r).__name__ for f in SAGE2_FAMILIES for r in f.extra_rules} == {"KvLenRule"}


def test_plans_match_the_committed_h200_families_run():
    """bench/results/families_230k_h200.json (bench/kernels/gpu_kvchunks.py families on the H200) recorded
    each family's plan for H3 at 230,000 tokens -- reasons and kernel temporaries included; the
    envelopes plan the same today."""
    import json
    from pathlib import Path

    from safe_ops.models.h3.dims import h3_attention_call
    from safe_ops.attention.planner import plan_for
    d = json.loads((Path(__file__).resolve().parents[2] / "bench/results/families_230k_h200.json").read_text())
    rows = [(row["S"], fam, r["plan"]) for row in d["sections"]["families"]["rows"]
            for fam, r in row["families"].items() if "plan" in r]
    assert len(rows) == 5
    for S, fam, plan in rows:
        got = plan_for(h3_attention_call(S, arch="sm_90"), FAMILIES[fam], None, caller_layout="NHD")
        assert got.describe() == plan, fam


def test_smoothed_k_is_what_triton_quant_indexes():
    """sageattn's smooth_k (always on) quantises `k - km`, a dense NHD copy of H3's k view: past
    the strided limit only q needs a copy (issue 11: the caller's k was copied for nothing);
    k_smooth still limits the dense copy at 299,594 tokens (token stride 7,168)."""
    from safe_ops.families.envelope import FAMILIES
    from safe_ops.attention.planner import plan_for
    for fam in ("sage2_sm90", "sage2_sm80", "sage2_sm89_fp8pv", "sage2_sm86_triton"):
        env = FAMILIES[fam]
        p = plan_for(call_of(h3_view(99_866), layout="NHD"), env)
        assert p.kind == "repack" and p.repack == ("q",), (fam, p)
        assert not [x for x in viol(fam, call_of(h3_view(99_866))) if x.tensor == "k"]
        bad = [x for x in viol(fam, call_of(h3_view(299_595), layout="NHD")) if x.tensor == "k_smooth"]
        assert bad and bad[0].axis == "s"
