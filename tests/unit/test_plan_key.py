"""The fast path's plan key (call_forms.signature) held field by field (issue 45 item 2).

A repeated call signature is not read again: its plan is one lookup under the raw signature. So a
call that differs from an earlier one in anything the reading or the plan depends on must miss that
entry. Each test here makes two calls that differ in one field of the key only and checks what a
user sees: every launch inside the kernel's envelope (the stand-in kernel asserts it, alignment
included), the result of the second call's own form, and a call SafeSage cannot read or a kernel
cannot take going to ComfyUI's function without reaching the kernel. Each fails with that field
removed from the key (docs/DEVELOPING.md, "Defect -> test", issue 45). Every test runs with both
forms of the key: without base-pointer alignment (no family's rule reads it: sage only) and with it
(comfy-kitchen's AlignRule). CPU.
"""
import dataclasses

import pytest
import torch

import safe_ops.attention.plans as plans
from safe_ops.attention.call_forms import describe_tensor, dtype_name
from safe_ops.attention.override import SafeAttention
from safe_ops.families.ck_int8 import AlignRule
from safe_ops.families.envelope import AttnCall, IndexTerm, check
from safe_ops.families.family import Kernel
from safe_ops.policy import Policy
from safe_ops.ui import run_stats

from test_attention import CPU_RT, reference, toy_envelope


@pytest.fixture(autouse=True)
def _clean():
    run_stats.reset()
    yield
    run_stats.reset()


class InEnvelopeKernel:
    """A stand-in kernel that refuses any launch outside its envelope -- index products in 16-bit
    integers (toy_envelope, v's tokens included), devices, dtypes and, with AlignRule, base-pointer alignment of the
    tensors it is really handed -- then computes attention."""

    def __init__(self, env):
        self.env = env
        self.launches = []

    def __call__(self, q, k, v, layout, scale):
        hnd = (lambda t: t.transpose(1, 2)) if layout == "NHD" else (lambda t: t)
        qh, kh, vh = hnd(q), hnd(k), hnd(v)
        self.launches.append((tuple(qh.shape), tuple(kh.shape), tuple(vh.shape)))
        call = AttnCall(describe_tensor(qh), describe_tensor(kh), describe_tensor(vh), dtype_name(q.dtype), layout,
                        False, q.device.type, "", q.element_size())
        viol = check(call, self.env)
        assert not viol, f"launch outside the envelope: {[str(x) for x in viol]}"
        assert k.dtype == v.dtype == q.dtype and k.device == v.device == q.device
        out = reference(qh, kh, vh, scale).to(q.dtype)
        return out.contiguous() if layout == "HND" else out.transpose(1, 2).contiguous()


class Comfy:
    """ComfyUI's function as the override is handed it: records each call and returns a marker."""

    __name__ = "attention_pytorch"

    def __init__(self):
        self.calls = 0

    def __call__(self, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                 skip_output_reshape=False, **kwargs):
        self.calls += 1
        return torch.full((1,), 7.0)


@pytest.fixture(params=["plain", "aligned"])
def make(request):
    """SafeAttention with one guarded stand-in family; ``aligned``: the family carries AlignRule, so the
    key holds base-pointer alignment. ``previous``: an override chained before SafeSage (masked and
    full-precision calls are then read, not handed on)."""
    def make_(previous=None):
        env = toy_envelope()
        # and v's tokens indexed in its integer type too, as sage 2.2's fp8-V transposer does (u32)
        env = dataclasses.replace(env, terms=env.terms + (IndexTerm("transpose_pad_permute", "v", "s", "i16", "toy"),))
        if request.param == "aligned":
            env = dataclasses.replace(env, extra_rules=(AlignRule("toy_sage"),))
        kern = InEnvelopeKernel(env)
        att = SafeAttention(Policy(kernel="sage", verify="off", quality="faults only"),
                            kernels=[Kernel(env, kern, 0.05)], rt=CPU_RT, previous=previous)
        assert att._key_alignment is (request.param == "aligned")
        return att, kern
    return make_


HND = {"skip_reshape": True, "skip_output_reshape": True}


def fused_qkv(S, heads=4, d=16, offset=0, dtype=torch.float32):
    """q, k, v as H3 makes them: HND views of one [S, 3*heads*d] buffer (token stride 3*heads*d),
    ``offset`` elements into it."""
    buf = torch.randn(S * 3 * heads * d + offset, dtype=dtype)[offset:].view(S, 3 * heads * d)
    return [t.view(S, heads, d).transpose(0, 1).unsqueeze(0) for t in buf.split(heads * d, dim=-1)]


def dense(S, heads=4, d=16, dtype=torch.float32, device="cpu"):
    return [torch.randn(1, heads, S, d, dtype=dtype).to(device) for _ in range(3)]


def check_out(out, q, k, v):
    torch.testing.assert_close(out.double(), reference(q, k, v), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- strides, shapes, alignment: the plan
@pytest.mark.parametrize("strided", ["qkv", "q", "k", "v"])
def test_same_shapes_on_strided_views_get_their_own_in_envelope_plan(make, strided):
    """A dense call runs ``direct``; the same shapes as H3's fused-qkv views (token stride 192 in a
    16-bit stand-in: the 32-bit overflow class) must not reuse that plan: the strided tensor is
    copied into the envelope. Removing that tensor's strides from the key launches it outside."""
    att, kern = make()
    comfy = Comfy()
    q, k, v = dense(300)
    check_out(att(comfy, q, k, v, 4, **HND), q, k, v)
    assert run_stats.value("plan:direct") == 1 and len(kern.launches) == 1
    views = dict(zip("qkv", fused_qkv(300)))
    q2, k2, v2 = (views[n] if n in strided else t for n, t in zip("qkv", (q, k, v)))
    assert all(a.shape == b.shape for a, b in zip((q, k, v), (q2, k2, v2)))
    out = att(comfy, q2, k2, v2, 4, **HND)
    check_out(out, q2, k2, v2)
    assert comfy.calls == 0 and not run_stats.value("fallbacks") and len(kern.launches) >= 2
    assert run_stats.value("plan:repack") == 1, run_stats.snapshot()["plans"]
    assert len(att.prepared_plans()) == 2


def test_a_longer_query_on_the_same_strides_gets_its_own_plan(make):
    """H3's views keep their strides whatever the length: a longer q (same k, v) must not reuse the
    shorter one's plan (q.shape); its last token's index product needs a copy of q."""
    att, kern = make()
    comfy = Comfy()
    q, k, v = fused_qkv(700)
    short = q[:, :, :100]
    assert short.stride() == q.stride()
    check_out(att(comfy, short, k, v, 4, **HND), short, k, v)
    check_out(att(comfy, q, k, v, 4, **HND), q, k, v)
    assert comfy.calls == 0 and not run_stats.value("fallbacks") and len(att.prepared_plans()) == 2


@pytest.mark.parametrize("which", "qkv")
def test_a_view_off_its_alignment_gets_its_own_plan(make, which):
    """With a family that checks base pointers, one tensor one element into its buffer (same shapes and
    strides) needs a copy the aligned call's plan did not make. Without such a family nothing planned
    depends on it (test_fast_path: the same signature)."""
    att, kern = make()
    comfy = Comfy()
    q, k, v = fused_qkv(100)
    check_out(att(comfy, q, k, v, 4, **HND), q, k, v)
    shifted = dict(zip("qkv", fused_qkv(100, offset=1)))
    q2, k2, v2 = (shifted[n] if n == which else t for n, t in zip("qkv", (q, k, v)))
    check_out(att(comfy, q2, k2, v2, 4, **HND), q2, k2, v2)
    assert comfy.calls == 0 and not run_stats.value("fallbacks")
    assert len(att.prepared_plans()) == (2 if att._key_alignment else 1)


# ---------------------------------------------------------------- the form: how the call is read
def test_the_3d_form_with_other_heads_is_read_with_its_own_head_size(make):
    """[B, S, H*D] with heads 4 and then heads 2: the same tensors, another head size (16 vs 32)."""
    att, kern = make()
    comfy = Comfy()
    q, k, v = (torch.randn(1, 10, 64) for _ in range(3))
    for heads in (4, 2):
        out = att(comfy, q, k, v, heads)
        qh, kh, vh = (t.view(1, 10, heads, 64 // heads).transpose(1, 2) for t in (q, k, v))
        torch.testing.assert_close(out.double(), reference(qh, kh, vh).transpose(1, 2).flatten(2),
                                   rtol=1e-5, atol=1e-5)
    assert kern.launches[-1][0] == (1, 2, 10, 32)


def test_the_output_form_follows_each_call(make):
    att, kern = make()
    comfy = Comfy()
    q, k, v = dense(50)
    assert att(comfy, q, k, v, 4, **HND).shape == (1, 4, 50, 16)
    out = att(comfy, q, k, v, 4, skip_reshape=True)
    assert out.shape == (1, 50, 64)
    torch.testing.assert_close(out.double(), reference(q, k, v).transpose(1, 2).flatten(2), rtol=1e-5, atol=1e-5)


def test_4d_tensors_without_skip_reshape_go_to_comfy_unread(make):
    """A form SafeSage cannot read (4-d tensors, ``skip_reshape`` False) goes to ComfyUI's function,
    also after a readable call of the same tensors."""
    att, kern = make()
    comfy = Comfy()
    q, k, v = dense(50)
    att(comfy, q, k, v, 4, **HND)
    assert att(comfy, q, k, v, 4, skip_output_reshape=True).tolist() == [7.0]
    assert comfy.calls == 1 and len(kern.launches) == 1
    assert any("unsupported call" in r for r in run_stats.snapshot()["fallback_reasons"])


# ---------------------------------------------------------------- what no kernel may take
def test_a_masked_call_never_runs_the_unmasked_calls_plan(make):
    """With an override chained before SafeSage a masked call is read (not handed on); no guarded
    family takes a mask, so it runs the chained override with its mask."""
    seen = []

    def previous(func, *a, **kw):
        seen.append(kw.get("mask") is not None)
        return func(*a, **kw)
    att, kern = make(previous)
    comfy = Comfy()
    q, k, v = dense(50)
    check_out(att(comfy, q, k, v, 4, **HND), q, k, v)
    assert att(comfy, q, k, v, 4, mask=torch.zeros(50, 50), **HND).tolist() == [7.0]
    assert seen == [True] and comfy.calls == 1 and len(kern.launches) == 1


def test_a_full_precision_call_never_runs_the_low_precision_calls_plan(make):
    """``low_precision_attention=False`` (ComfyUI's contract, e.g. SAM3): ComfyUI's function, also when
    an override chained before SafeSage makes SafeSage read the call."""
    att, kern = make(lambda func, *a, **kw: func(*a, **kw))
    comfy = Comfy()
    q, k, v = dense(50)
    check_out(att(comfy, q, k, v, 4, **HND), q, k, v)
    assert att(comfy, q, k, v, 4, low_precision_attention=False, **HND).tolist() == [7.0]
    assert comfy.calls == 1 and len(kern.launches) == 1


@pytest.mark.parametrize("which,change", [(w, c) for c in ("shape", "dtype", "device") for w in "qkv"
                                          if (w, c) != ("q", "shape")])
def test_a_call_read_form_refuses_never_reaches_the_kernel(make, which, change):
    """One of q/k/v of another length (k or v: same strides), dtype or device than the others, the
    rest as an earlier call that ran the kernel: SafeSage cannot read it, ComfyUI's function runs it,
    the kernel never sees it. ("device": a meta tensor beside CPU ones; the same holds for two GPUs.)"""
    att, kern = make()
    comfy = Comfy()
    q, k, v = dense(64)
    att(comfy, q, k, v, 4, **HND)
    odd = {"shape": lambda t: t[:, :, :32], "dtype": lambda t: t.double(), "device": lambda t: t.to("meta")}[change]
    args = [odd(t) if n == which else t for n, t in zip("qkv", (q, k, v))]
    assert [a.stride() for a in args] == [t.stride() for t in (q, k, v)]
    assert att(comfy, *args, 4, **HND).tolist() == [7.0]
    assert comfy.calls == 1 and len(kern.launches) == 1
    assert any("unsupported call" in r for r in run_stats.snapshot()["fallback_reasons"])


# ---------------------------------------------------------------- ComfyUI's function
def test_each_comfy_function_keeps_its_own_plan(make, monkeypatch):
    """Two functions ComfyUI hands the override in turn (a layer's own ``comfy_attention``, the model's):
    each signature is read and planned once, not again at every change of function."""
    chooses = []
    real = plans.choose
    monkeypatch.setattr(plans, "choose", lambda *a, **kw: chooses.append(1) or real(*a, **kw))
    att, kern = make()
    comfy = Comfy()
    q, k, v = dense(50)
    f1, f2 = Comfy(), Comfy()
    for f in (f1, f2, f1, f2, f1):
        check_out(att(f, q, k, v, 4, **HND), q, k, v)
    assert len(chooses) == 2 and len(att.prepared_plans()) == 2 and len(kern.launches) == 5
