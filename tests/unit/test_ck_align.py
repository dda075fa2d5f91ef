"""comfy-kitchen's alignment precondition (ComfyUI #15494) in the ck_int8 envelopes, and the plan
that satisfies it (CPU).

comfy-kitchen's int8 quantisers check, before launching anything (0.2.40 ``_C.abi3.so`` strings,
public ``quant_qk_int8.cu`` / ``quant_v_int8.cu``): q and k base pointers aligned to 4 elements
and their B/H/N strides positive multiples of 4 elements; v's base pointer and B/H/N strides
multiples of 16 bytes; an axis of extent 1 exempt since 0.2.31 (comfy-kitchen #112). A call
outside raises ``RuntimeError``; SafeSage's planner copies the tensor instead (a copy is aligned).
"""
import dataclasses

import pytest
import torch

from safe_ops.attention.call_forms import describe_tensor, normalise
from safe_ops.attention.override import SafeAttention
from safe_ops.attention.planner import choose, plan_for, sub_call
from safe_ops.facts.devices import Runtime
from safe_ops.families.ck_int8 import CK_INT8, CK_INT8_PRE236
from safe_ops.families.envelope import AttnCall, TensorDesc, check
from safe_ops.families.family import Kernel
from safe_ops.families.sdpa import SDPA
from safe_ops.policy import Policy
from safe_ops.ui import run_stats as report

CPU_RT = Runtime("test", None, None, None, None, None, "test", None, None, None)


def qkv_views(S, heads=4, d=64, offset=0, pad=0, dtype=torch.bfloat16, seed=0):
    """MiniMax H3's q/k/v (comfy/ldm/minimax/model.py: split the qkv_proj output, view, transpose(0, 1),
    unsqueeze(0)), from a buffer whose rows start ``offset`` elements into its storage and are
    ``pad`` elements wider than 3*heads*d."""
    g = torch.Generator().manual_seed(seed)
    row = 3 * heads * d + pad
    buf = torch.randn(offset + S * row, generator=g).to(dtype)
    qkv = buf[offset:].view(S, row)[:, :3 * heads * d]
    q, k, v = qkv.split(heads * d, dim=-1)
    return [t.view(S, heads, d) for t in (q, k, v)]


def hnd(views):
    return [t.transpose(0, 1).unsqueeze(0) for t in views]


def call_of(q, k, v, layout="HND"):
    return AttnCall(describe_tensor(q), describe_tensor(k), describe_tensor(v), str(q.dtype)[6:], layout,
                    False, "cuda", "sm_90", q.element_size())


def align_violations(call, env=CK_INT8):
    return [v for v in check(call, env) if v.rule == "align"]


# ------------------------------------------------------------------ the rule
def test_h3_views_are_aligned_and_run_direct():
    """H3's own views (offsets 0, H*D, 2*H*D; token stride 3*H*D) pass: no copy for H3."""
    call = call_of(*hnd(qkv_views(300)))
    assert (call.q.align, call.k.align, call.v.align) == (16, 16, 16)
    for env in (CK_INT8, CK_INT8_PRE236):
        assert not check(call, env)
        assert plan_for(call, env).kind == "direct"


def test_odd_buffer_offset_is_refused_and_repacked():
    """Rows starting 2 bf16 elements (4 bytes) into the storage: every base pointer is off."""
    call = call_of(*hnd(qkv_views(300, offset=2)))
    viol = align_violations(call)
    assert {(v.tensor, v.axis) for v in viol} == {("q", "base"), ("k", "base"), ("v", "base")}
    assert all(v.cite.startswith("#15494") for v in viol)
    assert "4-element alignment" in viol[0].cite and "16-byte aligned" in viol[2].cite
    p = plan_for(call, CK_INT8)
    assert p.kind == "repack" and set(p.repack) == {"q", "k", "v"}
    assert not check(sub_call(call, call.heads, call.q_len, p.repack, p.layout), CK_INT8)
    ch = choose(call, [CK_INT8, SDPA])
    assert ch.kernel == "ck_int8" and ch.kind == "repack" and "#15494" in ch.reasons[0]


def test_four_element_offset_only_v_is_copied():
    """8 bytes off: enough for q/k (4 bf16 elements), not for v (16 bytes)."""
    call = call_of(*hnd(qkv_views(300, offset=4)))
    assert {(v.tensor, v.axis) for v in align_violations(call)} == {("v", "base")}
    assert plan_for(call, CK_INT8).repack == ("v",)
    fp32 = call_of(*hnd(qkv_views(300, offset=4, dtype=torch.float32)))     # 16 bytes: all aligned
    assert not align_violations(fp32)


def test_token_and_head_strides():
    # rows 2 elements wider than 3*H*D: the token stride is not a multiple of 4 (nor of 8 for v)
    call = call_of(*hnd(qkv_views(300, pad=2)))
    assert {(v.tensor, v.axis) for v in align_violations(call)} == {("q", "s"), ("k", "s"), ("v", "s")}
    assert plan_for(call, CK_INT8).kind == "repack"
    # rows 4 wider: q/k fine (4 elements), v's 8-byte stride is not 16 bytes
    call4 = call_of(*hnd(qkv_views(300, pad=4)))
    assert {(v.tensor, v.axis) for v in align_violations(call4)} == {("v", "s")}
    # heads 130 elements apart (a [S, H, 130] buffer cut to 128): the head stride
    buf = torch.zeros(300, 4, 130, dtype=torch.bfloat16)[..., :128]
    t = buf.transpose(0, 1).unsqueeze(0)
    assert {(v.tensor, v.axis) for v in align_violations(call_of(t, t, t))} == {
        ("q", "h"), ("k", "h"), ("v", "h")}


def test_extent_one_is_exempt_from_0_2_31():
    """comfy-kitchen #112: torch <= 2.9 hands a size-one axis stride 1 through DLPack; H3's batch
    of one arrived as (1, 128, 7168, 1) (#15494 on 0.2.30). 0.2.31+ skip such axes; the
    0.2.29-0.2.35 envelope checks them (0.2.29/0.2.30 do), which a copy fixes."""
    dl = TensorDesc((1, 56, 372, 128), (1, 128, 7168, 1))
    call = AttnCall(dl, dl, dl, "bfloat16", "HND", False, "cuda", "sm_90", 2)
    assert not align_violations(call, CK_INT8)
    assert {(v.tensor, v.axis) for v in align_violations(call, CK_INT8_PRE236)} == {
        ("q", "b"), ("k", "b"), ("v", "b")}
    assert plan_for(call, CK_INT8_PRE236).kind == "repack"


def test_head_dims_that_are_padded_are_copies_already():
    """A head_dim other than 64/128/256 is zero-padded into fresh tensors before the checks
    (sage_attention.py:218-229): the rule does not apply (the envelope refuses those head dims
    on its own rule, head_dim)."""
    q = torch.zeros(1, 2, 40, 80, dtype=torch.bfloat16).view(-1)[2:2 + 2 * 40 * 78].view(1, 2, 40, 78)
    assert not align_violations(call_of(q, q, q))


def test_split_launches_inherit_the_worst_offset():
    """Head groups of views start g*stride_h further in: with a 130-element head stride a
    one-head launch has extent 1 on h (exempt) but launch 1 starts 260 bytes in -- its base
    pointer is off. And a misaligned view stays misaligned in every group, so when the 0.2.35
    envelope needs head groups (H3 at 314,437 tokens, comfy-kitchen #178) they are copies."""
    buf = torch.zeros(300, 4, 130, dtype=torch.bfloat16)[..., :128]
    t = buf.transpose(0, 1).unsqueeze(0)
    call = call_of(t, t, t)
    one_head = sub_call(call, 1, call.q_len, (), "HND")
    assert {(v.tensor, v.axis) for v in align_violations(one_head)} == {
        ("q", "base"), ("k", "base"), ("v", "base")}
    S, row = 314_437, 3 * 56 * 128
    h3 = TensorDesc((1, 56, S, 128), (S * row, 128, row, 1), align=4)     # 2 elements into its storage
    big = AttnCall(h3, h3, h3, "bfloat16", "NHD", False, "cuda", "sm_90", 2)
    p = plan_for(big, CK_INT8_PRE236)
    assert p.kind == "head_groups" and set(p.repack) == {"q", "k", "v"}
    assert not check(sub_call(big, p.head_group, p.q_chunk or S, p.repack, p.layout), CK_INT8_PRE236)
    aligned = dataclasses.replace(big, q=dataclasses.replace(h3, align=16), k=dataclasses.replace(h3, align=16),
                                  v=dataclasses.replace(h3, align=16))
    assert plan_for(aligned, CK_INT8_PRE236).repack == ()                 # views when aligned


# ------------------------------------------------------------------ reading a tensor
def test_describe_tensor_reads_the_base_pointer():
    buf = torch.zeros(64, dtype=torch.bfloat16)
    assert [describe_tensor(buf[i:i + 8]).align for i in (0, 1, 2, 4, 8)] == [16, 2, 4, 8, 16]
    assert describe_tensor(torch.zeros(64, dtype=torch.float32)[1:]).align == 4
    fake_mode = pytest.importorskip("torch._subclasses.fake_tensor").FakeTensorMode
    with fake_mode():
        f = torch.empty(64, dtype=torch.bfloat16)[2:10]      # no address: its element offset
        assert describe_tensor(f).align == 4


def test_call_signature_includes_the_alignment():
    """Plans are cached per call signature: the same shape and strides at another offset is
    another signature (a direct plan cached for an aligned call must not run a misaligned one)."""
    def key(offset):
        q, k, v = hnd(qkv_views(50, offset=offset))
        return SafeAttention._call_key(normalise((q, k, v, 4), {"skip_reshape": True}), None)
    assert key(0) == key(8)
    assert key(0) != key(2) and key(2) != key(4)


# ------------------------------------------------------------------ end to end (stand-in kernel)
class KitchenStandIn:
    """comfy-kitchen int8_attention's host checks, transcribed from launch_quant_qk_per_thread_int8
    and launch_quant_v_int8_kernel (0.2.31+) and applied to the tensors it is handed; then
    attention in float64."""

    def __init__(self):
        self.launches = []

    @staticmethod
    def host_checks(q, k, v):
        elt = 4 if q.dtype == torch.float32 else 2

        def stride_ok(s, n, qk):
            return n < 2 or ((s > 0 and s % 4 == 0) if qk else (s * elt) % 16 == 0)

        for t in (q, k):
            if t.data_ptr() % (4 * elt) or not all(stride_ok(t.stride(i), t.shape[i], True) for i in range(3)):
                raise RuntimeError("quant_qk_per_thread_int8: Q/K base pointers and B/H/N strides must "
                                   "preserve 4-element alignment")
        if v.data_ptr() % 16 or not all(stride_ok(v.stride(i), v.shape[i], False) for i in range(3)):
            raise RuntimeError("quant_v_int8: V base pointer and B/H/N strides must be 16-byte aligned")

    def __call__(self, q, k, v, layout, scale):
        if layout == "NHD":                     # ck_int8._call hands comfy-kitchen HND views
            return self(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), "HND", scale).transpose(1, 2)
        self.host_checks(q, k, v)
        self.launches.append(tuple(t.data_ptr() for t in (q, k, v)))
        s = scale if scale is not None else q.shape[-1] ** -0.5
        w = torch.softmax(q.double() @ k.double().transpose(-1, -2) * s, dim=-1)
        return (w @ v.double()).to(q.dtype)


def comfy_raw(*a, **k):
    raise AssertionError("ComfyUI's function must not run: comfy-kitchen takes every call here")


@pytest.fixture
def kitchen():
    report.reset()
    fn = KitchenStandIn()
    env = dataclasses.replace(CK_INT8, devices=("cpu",))
    att = SafeAttention(Policy(kernel="sage", verify="off"), kernels=[Kernel(env, fn, 0.05)], rt=CPU_RT)
    return att, fn


def run(att, views):
    q, k, v = hnd(views)
    out = att(comfy_raw, q, k, v, q.shape[1], skip_reshape=True, skip_output_reshape=True)
    w = torch.softmax(q.double() @ k.double().transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1)
    torch.testing.assert_close(out.double(), w @ v.double(), rtol=2e-2, atol=2e-2)
    return q, k, v


def test_aligned_views_reach_the_kernel_uncopied(kitchen):
    att, fn = kitchen
    q, k, v = run(att, qkv_views(96))
    assert fn.launches == [(q.data_ptr(), k.data_ptr(), v.data_ptr())]
    assert report.value("plan:direct") == 1 and report.value("fallbacks") == 0


def test_misaligned_views_are_copied_not_refused(kitchen):
    """Each misaligned call runs on comfy-kitchen from aligned copies: no RuntimeError, no fallback."""
    att, fn = kitchen
    for offset, pad in ((2, 0), (0, 2)):
        q, k, v = run(att, qkv_views(96, offset=offset, pad=pad))
        assert fn.launches[-1] != (q.data_ptr(), k.data_ptr(), v.data_ptr())
    assert len(fn.launches) == 2
    assert report.value("plan:repack") == 2 and report.value("fallbacks") == 0


def test_a_direct_plan_is_not_reused_for_a_misaligned_call(kitchen):
    """An aligned call, then the same shape and strides 2 elements further in: the second gets its
    own (repack) plan, not the first's cached direct one -- which comfy-kitchen would refuse."""
    att, fn = kitchen
    run(att, qkv_views(96))
    q, k, v = run(att, qkv_views(96, offset=2))
    assert fn.launches[-1] != (q.data_ptr(), k.data_ptr(), v.data_ptr())
    assert report.value("plan:direct") == 1 and report.value("plan:repack") == 1
    assert report.value("fallbacks") == 0
