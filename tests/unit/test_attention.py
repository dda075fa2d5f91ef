"""Plan execution numerics with a stand-in kernel that asserts its own envelope (CPU).

The stand-in has sage 1.0.6's index arithmetic with 16-bit integers, so the
same overflow boundaries appear at CPU-sized shapes. It refuses any launch
outside its envelope -- a plan that would have overflowed fails the test.
"""
import dataclasses
import math
import sys

import pytest
import torch

from safe_ops.ui import run_stats as report
from safe_ops.families.family import Kernel
from safe_ops.attention.override import SafeAttention
from safe_ops.attention.call_forms import UnsupportedCall, normalise
from safe_ops.families.envelope import AttnCall, IndexTerm, TensorDesc, check
from safe_ops.families.sage1 import SAGE1_TRITON
from safe_ops.policy import Policy
from safe_ops.attention.verification import Verifier
from safe_ops.facts.devices import Runtime

CPU_RT = Runtime("test", None, None, None, None, None, "test", None, None, None)


def toy_envelope(family="toy_sage", small_ints=True):
    """sage 1.0.6's envelope on the CPU; with 16-bit index products when ``small_ints``."""
    terms = tuple(dataclasses.replace(t, itype="i16" if t.itype == "i32" and small_ints else t.itype)
                  for t in SAGE1_TRITON.terms)
    return dataclasses.replace(SAGE1_TRITON, family=family, terms=terms, devices=("cpu",),
                               head_dims=(16, 32, 64))


def reference(q, k, v, scale=None):
    """float64 attention on HND tensors."""
    q, k, v = (t.double() for t in (q, k, v))
    if k.shape[1] != q.shape[1]:
        r = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    s = scale if scale is not None else q.shape[-1] ** -0.5
    w = torch.softmax(q @ k.transpose(-1, -2) * s, dim=-1)
    return w @ v


class EnvelopeAssertingKernel:
    """Stand-in for sageattn: checks the real strides of every launch, then computes attention."""

    def __init__(self, env, corrupt=None):
        self.env = env
        self.launches = []
        self.corrupt = corrupt

    def __call__(self, q, k, v, layout, scale):
        hnd = (lambda t: t.transpose(1, 2)) if layout == "NHD" else (lambda t: t)
        qh, kh, vh = hnd(q), hnd(k), hnd(v)
        call = AttnCall(TensorDesc(tuple(qh.shape), tuple(qh.stride())),
                        TensorDesc(tuple(kh.shape), tuple(kh.stride())),
                        TensorDesc(tuple(vh.shape), tuple(vh.stride())),
                        str(q.dtype).replace("torch.", ""), layout, False, "cpu")
        viol = check(call, self.env)
        assert not viol, f"launch outside the envelope: {[str(x) for x in viol]}"
        self.launches.append((tuple(qh.shape), layout))
        out = reference(qh, kh, vh, scale).to(q.dtype)
        if self.corrupt is not None:
            out = self.corrupt(out)
        out = out.contiguous() if layout == "HND" else out.transpose(1, 2).contiguous()
        return out


def make_attn(env=None, policy=Policy(kernel="sage", verify="off"), corrupt=None):
    env = env or toy_envelope()
    fn = EnvelopeAssertingKernel(env, corrupt)
    att = SafeAttention(policy, kernels=[Kernel(env, fn, 0.05)], rt=CPU_RT)
    return att, fn


def h3_like(S, heads=4, d=16, dtype=torch.float32, seed=0):
    """q/k/v as strided views of one [S, 3*heads*d] buffer, like MiniMax H3."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(S, 3 * heads * d, generator=g).to(dtype)
    q, k, v = qkv.split(heads * d, dim=-1)
    views = [t.view(S, heads, d).transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
    return views


def raw(*a, **k):
    raise AssertionError("ComfyUI's function must not be called for a call a guarded kernel runs")


class ComfyFunc:
    """Stand-in for the attention function ComfyUI hands the override (attention_pytorch's
    contract: [B,S,H*D] in and out, or [B,H,S,D] with skip_reshape / skip_output_reshape; GQA;
    mask; scale): float64 attention, every call recorded with its keyword arguments."""

    __name__ = "attention_pytorch"

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                 skip_output_reshape=False, **kwargs):
        self.calls.append(dict(kwargs, mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape))
        if skip_reshape:
            qh, kh, vh = q, k, v
        else:
            d = q.shape[-1] // heads
            qh, kh, vh = (t.unflatten(-1, (-1, d)).transpose(1, 2) for t in (q, k, v))
        s = kwargs.get("scale", qh.shape[-1] ** -0.5)
        qd, kd, vd = (t.double() for t in (qh, kh, vh))
        if kd.shape[1] != qd.shape[1]:
            r = qd.shape[1] // kd.shape[1]
            kd, vd = kd.repeat_interleave(r, 1), vd.repeat_interleave(r, 1)
        w = qd @ kd.transpose(-1, -2) * s
        if mask is not None:
            w = w + mask.double()
        out = (torch.softmax(w, dim=-1) @ vd).to(q.dtype) if w.shape[-1] else qd.new_zeros(qd.shape).to(q.dtype)
        return out if skip_output_reshape else out.transpose(1, 2).flatten(2)


@pytest.fixture(autouse=True)
def _reset():
    report.reset()
    yield


# -------------------------------------------------------------------- plans run
@pytest.mark.parametrize("S,kind", [(100, "direct"), (171, "direct"), (172, "repack"), (700, "head_groups")])
def test_strided_views_every_plan_matches_reference(S, kind):
    att, kern = make_attn()
    q, k, v = h3_like(S)
    out = att(raw, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    ref = reference(q, k, v)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert report.value(f"plan:{kind}") == 1
    assert kern.launches, "kernel must have run"


def test_head_group_boundary_is_exact():
    # contiguous [1,4,S,16]: head term 3*S*16 must fit i16 -> S <= 682
    att, kern = make_attn()
    for S, kind in [(682, "direct"), (683, "head_groups")]:
        q, k, v = (torch.randn(1, 4, S, 16) for _ in range(3))
        out = att(raw, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
        torch.testing.assert_close(out.double(), reference(q, k, v), rtol=1e-5, atol=1e-5)
        assert report.value(f"plan:{kind}") == 1


def test_comfy_call_forms_and_output_shapes():
    att, _ = make_attn()
    B, S, H, D = 2, 50, 4, 16
    q, k, v = (torch.randn(B, S, H * D) for _ in range(3))
    out = att(raw, q, k, v, H)                                   # [B,S,H*D] in, [B,S,H*D] out
    qh, kh, vh = (t.view(B, S, H, D).transpose(1, 2) for t in (q, k, v))
    ref = reference(qh, kh, vh)
    torch.testing.assert_close(out.double(), ref.transpose(1, 2).reshape(B, S, H * D), rtol=1e-5, atol=1e-5)
    out2 = att(raw, q, k, v, H, skip_output_reshape=True)         # [B,H,S,D] out
    torch.testing.assert_close(out2.double(), ref, rtol=1e-5, atol=1e-5)
    out3 = att(raw, qh, kh, vh, H, skip_reshape=True)              # HND in, [B,S,H*D] out
    assert out3.shape == (B, S, H * D)


def test_gqa_and_cross_attention_and_scale():
    att, _ = make_attn()
    q = torch.randn(1, 8, 40, 16)
    k = torch.randn(1, 2, 70, 16)
    v = torch.randn(1, 2, 70, 16)
    out = att(raw, q, k, v, 8, skip_reshape=True, skip_output_reshape=True, scale=0.3)
    torch.testing.assert_close(out.double(), reference(q, k, v, 0.3), rtol=1e-5, atol=1e-5)


def test_mask_falls_back_to_sdpa_counted():
    comfy = ComfyFunc()
    att, kern = make_attn()
    q, k, v = (torch.randn(1, 4, 30, 16) for _ in range(3))
    mask = torch.zeros(30, 30)
    mask[:, 20:] = -math.inf
    out = att(comfy, q, k, v, 4, mask=mask, skip_reshape=True, skip_output_reshape=True)
    w = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 4 + mask.double(), -1)
    torch.testing.assert_close(out.double(), w @ v.double(), rtol=1e-5, atol=1e-5)
    assert not kern.launches and len(comfy.calls) == 1 and comfy.calls[0]["mask"] is mask
    assert report.value("fallbacks") == 1 and "mask" in next(iter(report.snapshot()["fallback_reasons"]))


def test_unsupported_head_dim_and_dtype_fall_back():
    comfy = ComfyFunc()
    att, kern = make_attn()
    q, k, v = (torch.randn(1, 2, 30, 80) for _ in range(3))
    out = att(comfy, q, k, v, 2, skip_reshape=True, skip_output_reshape=True)
    torch.testing.assert_close(out.double(), reference(q, k, v), rtol=1e-5, atol=1e-5)
    q, k, v = (torch.randn(1, 2, 30, 16, dtype=torch.float64) for _ in range(3))
    att(comfy, q, k, v, 2, skip_reshape=True)
    assert not kern.launches and report.value("fallbacks") == 2 and len(comfy.calls) == 2


def test_sdpa_policy_never_launches_sage():
    comfy = ComfyFunc()
    att, kern = make_attn(policy=Policy(kernel="sdpa", verify="off"))
    q, k, v = h3_like(300)
    out = att(comfy, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    torch.testing.assert_close(out.double(), reference(q, k, v), rtol=1e-5, atol=1e-5)
    assert not kern.launches and report.value("fallbacks") == 0 and len(comfy.calls) == 1


# ------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("args,kwargs,why", [
    (("not a tensor", None, None, 4), {}, "tensors"),
    ((torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3), 1), {}, "3-d"),
    ((torch.randn(1, 5, 64), torch.randn(1, 5, 64), torch.randn(1, 5, 64), 3), {}, "divisible"),
    ((torch.randn(1, 4, 5, 16), torch.randn(1, 3, 5, 16), torch.randn(1, 3, 5, 16), 4), {"skip_reshape": True}, "multiple"),
    ((torch.randn(1, 4, 5, 16), torch.randn(1, 4, 6, 16), torch.randn(1, 4, 5, 16), 4), {"skip_reshape": True}, "mismatched"),
])
def test_bad_inputs_are_passed_to_comfy_counted(args, kwargs, why):
    att, kern = make_attn()
    seen = []

    def comfy_func(*a, **k):
        seen.append(True)
        return "comfy-result"

    assert att(comfy_func, *args, **kwargs) == "comfy-result"
    assert seen and not kern.launches
    assert report.value("fallbacks") == 1
    assert why in next(iter(report.snapshot()["fallback_reasons"]))


def test_zero_length_queries_and_keys():
    comfy = ComfyFunc()
    att, kern = make_attn()
    q = torch.randn(1, 4, 0, 16)
    k = v = torch.randn(1, 4, 10, 16)
    out = att(comfy, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    assert out.shape == (1, 4, 0, 16)
    q2 = torch.randn(1, 4, 5, 16)
    k2 = v2 = torch.randn(1, 4, 0, 16)
    out2 = att(comfy, q2, k2, v2, 4, skip_reshape=True, skip_output_reshape=True)
    assert out2.shape == (1, 4, 5, 16)   # softmax over nothing: whatever SDPA defines, no crash


def test_nan_inputs_propagate_without_blaming_the_kernel():
    att, kern = make_attn(policy=Policy(kernel="sage", verify="first"))
    q, k, v = (torch.randn(1, 4, 64, 16) for _ in range(3))
    q[0, 0, 3] = float("nan")
    out = att(raw, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    assert torch.isnan(out[0, 0, 3]).all() and torch.isfinite(out[0, 1]).all()
    assert report.value("probe_failures") == 0


# ----------------------------------------------------------------- verification
def corrupt_tail(out):
    out = out.clone()
    out[..., out.shape[2] // 2:, :] = 0
    return out


def test_probe_catches_broken_kernel_and_routes_away():
    comfy = ComfyFunc()
    att, kern = make_attn(policy=Policy(kernel="sage", verify="first"), corrupt=corrupt_tail)
    q, k, v = (torch.randn(1, 4, 128, 16) for _ in range(3))
    out = att(comfy, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    torch.testing.assert_close(out.double(), reference(q, k, v), rtol=1e-5, atol=1e-5)
    assert report.value("probe_failures") == 1 and len(kern.launches) == 1
    # later calls of the same class skip the broken kernel without probing it again
    att(comfy, q, k, v, 4, skip_reshape=True)
    assert len(kern.launches) == 1 and report.value("probes") == 1


def test_probe_catches_a_length_threshold():
    """A kernel wrong only above a length: caught at the first call of that size class."""
    comfy = ComfyFunc()
    threshold = 5000

    def wrong_when_long(out):
        return corrupt_tail(out) if out.shape[2] > threshold else out

    att, kern = make_attn(env=toy_envelope(small_ints=False),
                          policy=Policy(kernel="sage", verify="first"), corrupt=wrong_when_long)
    for S in (1000, 1000, 2000, 6000, 6000):
        q, k, v = (torch.randn(1, 2, S, 16) for _ in range(3))
        out = att(comfy, q, k, v, 2, skip_reshape=True, skip_output_reshape=True)
        torch.testing.assert_close(out.double(), reference(q, k, v), rtol=1e-4, atol=1e-4)
    assert report.value("probe_failures") == 1
    assert report.value("probes") == 2          # one size class below 4096, one above
    # launches: 1000, 1000, 2000 (trusted), 6000 (probed, failed) -> 4; second 6000 not launched
    assert len(kern.launches) == 4


def test_probe_every_call_mode_and_off():
    att, kern = make_attn(policy=Policy(kernel="sage", verify="every"))
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    for _ in range(3):
        att(raw, q, k, v, 2, skip_reshape=True)
    assert report.value("probes") == 3
    report.reset()
    att2, _ = make_attn(policy=Policy(kernel="sage", verify="off"), corrupt=corrupt_tail)
    att2(raw, q, k, v, 2, skip_reshape=True)
    assert report.value("probes") == 0


def test_plan_cache_is_per_shape():
    att, _ = make_attn()
    q, k, v = h3_like(300)
    for _ in range(5):
        att(raw, q, k, v, 4, skip_reshape=True)
    assert len(att._prepared) == 1 and report.value("plan:repack") == 5
    assert len(report.PLANS) == 1


def test_normalise_accepts_comfys_call_forms_as_views():
    q = torch.randn(1, 10, 64)
    n = normalise((q, q, q, 4), {})
    assert n.q.shape == (1, 4, 10, 16) and n.caller_layout == "NHD" and n.heads == 4
    assert n.q.data_ptr() == q.data_ptr()   # a view, no copy
    h = torch.randn(1, 4, 10, 16)
    mask = torch.zeros(10, 10)
    n = normalise((h, h, h, 4), {"skip_reshape": True, "skip_output_reshape": True, "mask": mask})
    assert n.q is h and n.caller_layout == "HND" and n.skip_output_reshape
    assert n.mask is mask          # only its presence matters: no guarded kernel takes a mask
    q3 = torch.randn(1, 10, 64)
    n = normalise((q3, q3, q3, 4), {})
    assert n.in_layout("NHD")[0].shape == (1, 10, 4, 16) and n.in_layout("NHD")[0].data_ptr() == q3.data_ptr()


@pytest.mark.parametrize("args,kwargs,why", [
    ((torch.randn(1, 10, 64),) * 3 + (True,), {}, "heads must be a positive int"),
    ((torch.randn(1, 10, 64),) * 3 + (0,), {}, "heads must be a positive int"),
    ((torch.randn(1, 10, 64),) * 3 + ("4",), {}, "heads must be a positive int"),
    ((torch.randn(1, 10, 64), torch.randn(1, 10, 64).half(), torch.randn(1, 10, 64), 4), {}, "dtypes differ"),
    ((torch.randn(1, 10, 64),) * 3 + (4,), {"skip_reshape": True}, "4-d"),
    ((torch.randn(1, 10, 64), torch.randn(1, 10, 40), torch.randn(1, 10, 40), 4), {}, "do not fit head_dim"),
    ((torch.randn(1, 10, 64),) * 3 + (4,), {"mask": [[0.0]]}, "mask must be a tensor"),
])
def test_normalise_rejects_what_it_cannot_read(args, kwargs, why):
    with pytest.raises(UnsupportedCall, match=why):
        normalise(args, kwargs)


def test_verifier_failed_class_stays_failed():
    from safe_ops.attention.verification import Verdict
    ver = Verifier("first")
    key = ("x",)
    failed = Verdict(False, 1.0, 0.1)
    ver.record(key, failed)
    ver.record(key, Verdict(True, 0.0, 0.1))
    assert ver.known_bad(key) is failed and not ver.needs_probe(key)
    assert ver.known_bad(("y",)) is None and ver.needs_probe(("y",))


def test_full_precision_request_is_honoured():
    """low_precision_attention=False (ComfyUI's contract) -> SDPA, not a quantised kernel."""
    comfy = ComfyFunc()
    att, kern = make_attn()
    q, k, v = (torch.randn(1, 4, 30, 16) for _ in range(3))
    out = att(comfy, q, k, v, 4, skip_reshape=True, skip_output_reshape=True, low_precision_attention=False)
    torch.testing.assert_close(out.double(), reference(q, k, v), rtol=1e-5, atol=1e-5)
    assert not kern.launches and report.value("plan:sdpa") == 1
    assert comfy.calls[0]["low_precision_attention"] is False, "the caller's arguments reach ComfyUI untouched"
    att(comfy, q, k, v, 4, skip_reshape=True)
    assert len(kern.launches) == 1


def test_kernel_wrong_for_one_dtype_is_caught_for_that_class_only():
    comfy = ComfyFunc()
    def wrong_in_fp16(out):
        return corrupt_tail(out) if out.dtype == torch.float16 else out

    att, kern = make_attn(env=toy_envelope(small_ints=False),
                          policy=Policy(kernel="sage", verify="first"), corrupt=wrong_in_fp16)
    for dt in (torch.float32, torch.float16, torch.float16, torch.float32):
        q, k, v = (torch.randn(1, 2, 128, 16).to(dt) for _ in range(3))
        out = att(comfy, q, k, v, 2, skip_reshape=True, skip_output_reshape=True)
        torch.testing.assert_close(out.double(), reference(q, k, v), rtol=2e-3, atol=2e-3)
    assert report.value("probe_failures") == 1 and report.value("probes") == 2
    assert len(kern.launches) == 3     # fp32, fp16 (caught), fp32; the second fp16 call skipped sage


# ------------------------------------------------------- call-time errors, NaN, probe coverage
def test_kernel_raising_at_call_time_falls_back_and_is_not_used_again(caplog):
    """A sage build that imports but raises when called (e.g. a missing sm90 extension)."""
    comfy = ComfyFunc()
    env = toy_envelope()
    calls = []

    def raising(q, k, v, layout, scale):
        calls.append(1)
        raise RuntimeError("SM90 kernel is not available. Make sure you GPUs with compute capability 9.0.")

    att = SafeAttention(Policy(kernel="sage", verify="first"), kernels=[Kernel(env, raising, 0.05)], rt=CPU_RT)
    q, k, v = h3_like(100)
    out = att(comfy, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    torch.testing.assert_close(out.double(), reference(q, k, v), rtol=1e-5, atol=1e-5)
    assert report.value("kernel_errors") == 1 and report.value("fallbacks") == 1
    assert "SM90 kernel is not available" in caplog.text and "toy_sage" in att.broken
    # another shape: the family is not tried again
    q2, k2, v2 = h3_like(60)
    att(comfy, q2, k2, v2, 4, skip_reshape=True)
    assert len(calls) == 1 and report.value("plan:sdpa") == 1


def test_cuda_error_is_not_swallowed():
    """CUDA errors are sticky: recomputing would fail too, so they propagate (debug_sync names the call)."""
    def faulting(q, k, v, layout, scale):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    att = SafeAttention(Policy(kernel="sage"), kernels=[Kernel(toy_envelope(), faulting, 0.05)], rt=CPU_RT)
    q, k, v = h3_like(100)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        att(raw, q, k, v, 4, skip_reshape=True)
    assert not att.broken


def test_probe_checks_every_batch_element_middle_heads_and_tail_rows():
    """NaN in the last query row of a middle head of the second batch element fails the probe."""
    comfy = ComfyFunc()
    def nan_in_tail(out):
        out = out.clone()
        out[1, 5, -1, 0] = float("nan")
        return out

    att, kern = make_attn(env=toy_envelope(small_ints=False), policy=Policy(kernel="sage", verify="first"),
                          corrupt=nan_in_tail)
    q, k, v = (torch.randn(2, 8, 1000, 16) for _ in range(3))
    out = att(comfy, q, k, v, 8, skip_reshape=True, skip_output_reshape=True)
    assert report.value("probe_failures") == 1
    assert torch.isfinite(out).all()          # the SDPA recomputation was returned
    assert any("non-finite output" in r for r in report.snapshot()["fallback_reasons"])


def test_probe_fails_when_the_error_is_nan():
    """A NaN relative error (e.g. Inf - Inf in the kernel's output) must not be dropped by max()."""
    from safe_ops.attention.verification import compare
    q, k, v = (torch.randn(1, 4, 300, 16) for _ in range(3))
    good = reference(q, k, v).float()
    assert compare(good, q, k, v, None, 0.05).ok
    bad = good.clone()
    bad[0, 3, 299] = float("inf")
    verdict = compare(bad, q, k, v, None, 0.05)
    assert not verdict.ok and "non-finite" in verdict.detail


def test_nan_inputs_everywhere_are_inconclusive_and_probed_again():
    att, kern = make_attn(policy=Policy(kernel="sage", verify="first"))
    q, k, v = (torch.randn(1, 4, 64, 16) for _ in range(3))
    k[0, :, 7] = float("nan")                  # every query row's reference is NaN
    for _ in range(2):
        att(raw, q, k, v, 4, skip_reshape=True)
    assert report.value("probes") == 2 and report.value("probe_failures") == 0


def test_probe_rows_and_heads_cover_the_tail_and_the_middle():
    from safe_ops.attention.verification import TAIL_ROWS, probe_heads, probe_rows
    rows = probe_rows(100_000).tolist()
    assert rows[0] == 0 and rows[-TAIL_ROWS:] == list(range(100_000 - TAIL_ROWS, 100_000))
    assert probe_heads(56) == (0, 18, 37, 55) and probe_heads(3) == (0, 1, 2)

# ------------------------------------------------------------------ kv_chunks
def lse_envelope(limit, centred=True, family="toy_sage2"):
    """The toy envelope plus a key-length rule (sm_120's kind) and the LSE capability."""
    from safe_ops.families.rules import KvLenRule
    env = toy_envelope(family)
    return dataclasses.replace(env, returns_lse=True, lse_centred_k=centred,
                               extra_rules=(KvLenRule(family, limit, "test", "toy length rule"),))


class LseKernel(EnvelopeAssertingKernel):
    """Stand-in for a sage 2 function with return_lse=True: asserts its envelope (i16 index
    products and the length rule), returns the output in the input dtype and the LSE in fp32."""

    def __init__(self, env):
        super().__init__(env)
        self.kv_lens = []
        self.key_sums = []

    def lse(self, q, k, v, layout, scale):
        out = self(q, k, v, layout, scale)                 # checks the envelope, records the launch
        hnd = (lambda t: t.transpose(1, 2)) if layout == "NHD" else (lambda t: t)
        qh, kh = hnd(q).float(), hnd(k).float()
        if kh.shape[1] != qh.shape[1]:
            kh = kh.repeat_interleave(qh.shape[1] // kh.shape[1], 1)
        s = scale if scale is not None else q.shape[-1] ** -0.5
        self.kv_lens.append(kh.shape[2])
        self.key_sums.append(hnd(k).double().sum(dim=2))
        return out, torch.logsumexp(qh @ kh.transpose(-1, -2) * s, dim=-1)


def make_lse_attn(limit, centred=True):
    env = lse_envelope(limit, centred)
    fn = LseKernel(env)
    att = SafeAttention(Policy(kernel="sage", verify="off"), kernels=[Kernel(env, fn, 0.05, fn.lse)], rt=CPU_RT)
    return att, fn


@pytest.mark.parametrize("toy_tflops,want", [(0.002, "kv_chunks"), (0.00105, "sdpa")])
def test_auto_prices_kv_chunks_against_sdpa(small_kv_chunks, monkeypatch, toy_tflops, want):
    """kernel=auto on a measured GPU: the toy family is measured faster than SDPA in-limit, but
    its kv_chunks plan pays its LSE kernel (x1.3 here): 2x faster still chunks, 5 % faster runs
    SDPA -- on purpose, so not counted as a fallback."""
    comfy = ComfyFunc()
    from safe_ops.facts import kernel_table as R
    table = {"archs": {"sm_120": {"tflops": {"toy_sage2": toy_tflops, "sdpa": 0.001}}}}
    monkeypatch.setattr(R, "kernel_table", lambda: table)
    env = dataclasses.replace(lse_envelope(100), lse_time_factor=1.3)
    fn = LseKernel(env)
    rt = Runtime("test", None, "RTX 5090", (12, 0), None, None, "test", None, None, None)
    att = SafeAttention(Policy(kernel="auto", verify="off"), kernels=[Kernel(env, fn, 0.05, fn.lse)], rt=rt)
    assert att.candidates(None, comfy_wants_sage=False)[0] == "toy_sage2"     # measured faster in-limit
    q, k, v = h3_like(150, seed=3)
    out = att(comfy, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    assert report.value(f"plan:{want}") == 1 and not report.snapshot()["fallback_reasons"]
    assert (len(fn.kv_lens) > 1) == (want == "kv_chunks")


@pytest.fixture
def small_kv_chunks(monkeypatch):
    """CPU-sized key chunks: align to 16 tokens, no 4096-token minimum."""
    from safe_ops.attention import planner
    monkeypatch.setattr(planner, "KV_ALIGN", 16)
    monkeypatch.setattr(planner, "MIN_KV_CHUNK", 16)


@pytest.mark.parametrize("centred", [True, False])
@pytest.mark.parametrize("S,limit", [(150, 100), (160, 50), (171, 64)])
def test_kv_chunks_merge_matches_sdpa(small_kv_chunks, S, limit, centred):
    att, kern = make_lse_attn(limit, centred)
    q, k, v = h3_like(S, seed=S)
    k = k + 3.0                                   # keys with a large common mean (what smooth_k is for)
    out = att(raw, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)
    assert report.value("plan:kv_chunks") == 1
    plan = next(iter(att._prepared.values())).plan
    n = -(-S // plan.kv_chunk)
    # every launch saw fewer keys than the rule allows, equal chunks of 16-token multiples; all 4
    # heads in one launch (the repacked k's head term 3*S*16 fits i16 up to S = 682): one launch
    # per key chunk
    assert max(kern.kv_lens) < limit and len(kern.kv_lens) == plan.launches == n
    assert sum(kern.kv_lens) == S and all(c % 16 == 0 for c in kern.kv_lens[:-1])
    assert kern.kv_lens[:-1] == [plan.kv_chunk] * (n - 1)
    # the keys the kernel saw, summed over the chunks: centred on the whole sequence's
    # mean (sum 0), not each chunk's own; or the caller's keys untouched
    seen = sum(kern.key_sums)
    expect = torch.zeros_like(seen) if centred else k.double().sum(dim=2)
    torch.testing.assert_close(seen, expect, rtol=1e-4, atol=1e-3)
    assert ("k" in plan.repack) == centred


def test_kv_chunks_combined_with_head_groups_and_bf16(small_kv_chunks):
    """Contiguous [1,4,S,16] past the i16 head term (S > 682) and a 300-key rule: head groups
    x key chunks; bf16 in, fp32 merge: error at the bf16 level of the unchunked kernel."""
    att, kern = make_lse_attn(300)
    S = 700
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, S, 16, generator=g).bfloat16() for _ in range(3))
    out = att(raw, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    plan = next(iter(att._prepared.values())).plan
    assert plan.kind == "kv_chunks" and plan.head_group and plan.kv_chunk < 300
    ref = reference(q, k, v)
    direct = reference(q, k, v).bfloat16().double()          # what one unchunked bf16 launch returns
    # chunk outputs and the centred key copy are bf16 (as in sage): a few bf16 roundings, no more
    assert (out.double() - ref).norm() / ref.norm() <= 3 * (direct - ref).norm() / ref.norm()
    assert out.dtype == torch.bfloat16 and out.shape == q.shape


def test_kernel_without_lse_never_gets_kv_chunks(small_kv_chunks):
    comfy = ComfyFunc()
    env = lse_envelope(100)
    fn = LseKernel(env)
    kern = Kernel(env, fn, 0.05)                          # no fn_lse: capability switched off
    assert not kern.envelope.returns_lse
    att = SafeAttention(Policy(kernel="sage", verify="off"), kernels=[kern], rt=CPU_RT)
    q, k, v = h3_like(150)
    out = att(comfy, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    torch.testing.assert_close(out.double(), reference(q, k, v), rtol=1e-5, atol=1e-5)
    assert report.value("plan:sdpa") == 1 and not fn.launches


def test_lse_merge_is_exact_and_shift_invariant():
    from safe_ops.attention.lse_merge import lse_merge
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=g, dtype=torch.float64) for _ in range(3))
    s = 16 ** -0.5
    acc = run = None
    for c0, c1 in ((0, 10), (10, 40), (40, 64)):
        w = q @ k[:, :, c0:c1].transpose(-1, -2) * s
        o = torch.softmax(w, -1) @ v[:, :, c0:c1]
        acc, run = lse_merge(acc, run, o, torch.logsumexp(w, -1) + 5.0)   # same constant per row
    torch.testing.assert_close(acc.double(), reference(q, k, v), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------- budget and auto
def test_budget_buckets():
    from safe_ops.facts.budget import BUDGET_STEP, budget_bucket
    assert budget_bucket(0) == 0 and budget_bucket(-5) == 0
    for n in (1, 1000, 3 * 2**30, 97 * 2**30):
        b = budget_bucket(n)
        assert b <= n < b * BUDGET_STEP * 1.0001
    assert budget_bucket(2**30) == 2**30


def test_plan_follows_the_budget_when_free_memory_moves():
    """The budget is re-read per call (cheaply): a plan that no longer fits is re-chosen for the
    same kernel (smaller head groups), and chosen again when memory comes back."""
    att, kern = make_attn()
    q, k, v = h3_like(700)                            # repack + head groups in the toy envelope
    budget = {"now": None}
    att._budget = lambda dev: budget["now"]
    launches = []
    for now in (None, "tight", None):
        if now == "tight":
            p0 = next(iter(att._prepared.values())).plan
            budget["now"] = p0.peak_bytes - 1
        else:
            budget["now"] = 10**12
        kern.launches.clear()
        out = att(raw, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
        torch.testing.assert_close(out.double(), reference(q, k, v), rtol=1e-5, atol=1e-5)
        launches.append(len(kern.launches))
    assert launches[0] < launches[1] and launches[2] == launches[0]
    assert report.value("replans") == 1           # tight: re-planned; back to the cached one after
    assert report.value("plan:sdpa") == 0


def test_auto_order_and_explanation(monkeypatch):
    from safe_ops.attention.comfy_functions import unguarded_kind
    from safe_ops.attention.kernel_choice import auto_order, explain_auto

    def attention_sage(): pass                       # noqa: E704 -- other packs' functions: by name
    def attention_comfy_kitchen_int8(): pass         # noqa: E704
    def attention_pytorch(): pass                    # noqa: E704
    assert unguarded_kind(attention_sage) == "sage"
    assert unguarded_kind(attention_comfy_kitchen_int8) == "ck"
    assert unguarded_kind(attention_pytorch) is None
    fams = ["sage2_sm120_fp8pv", "ck_int8"]
    assert auto_order("sm_120", fams, "ck")[0][:2] == ["ck_int8", "sdpa"]
    assert auto_order("sm_120", fams, "sage")[0][:2] == ["sage2_sm120_fp8pv", "sdpa"]
    assert auto_order("sm_120", fams, None)[0][0] == "sdpa"
    rt = Runtime("t", None, "RTX 5090", (12, 0), "2.2.0", "sage2_sm120_fp8pv", None, None, None, None)
    line = explain_auto(rt, fams, "ck")
    assert line.startswith("auto picked ck_int8 because") and "--use-ck-attention" in line
    assert explain_auto(rt, [], None).startswith("auto picked ComfyUI's own attention because no sage-family")
    from safe_ops.facts import kernel_table as R
    table = {"archs": {"sm_120": {"tflops": {"sdpa": 300.0, "ck_int8": 500.0}}}}
    monkeypatch.setattr(R, "kernel_table", lambda: table)
    order, why = auto_order("sm_120", ["sage2_sm120_fp8pv", "ck_int8_pre236"], None)
    assert order[:2] == ["ck_int8_pre236", "sdpa"] and "500 TFLOP/s" in why   # shares ck_int8's number
    assert "not measured: sage2_sm120_fp8pv" in why
    assert "as asked" in explain_auto(rt, fams, None, "sdpa")


def test_installed_kernels_add_only_measured_sage2_families(monkeypatch):
    """With sage 2.2, other sage-2 families join sageattn's own only where kernel_table.json has
    a (verified) measurement for this arch; per_warp never shadows sm_120's length rule."""
    import sys
    import types

    import safe_ops.families.registry as A
    fake = types.ModuleType("sageattention")
    for f in A.families().values():          # every function a sage 2 family is called through
        if f.function.startswith("sageattention.sageattn_"):
            setattr(fake, f.function.split(".", 1)[1], lambda *a, **k: None)
    monkeypatch.setitem(sys.modules, "sageattention", fake)
    table = {"archs": {"sm_90": {"tflops": {"sdpa": 556.0, "sage2_fp8pv_perwarp": 700.0,
                                            "sage2_sm90": 650.0, "sage2_sm120_fp8pv": 900.0}}}}
    monkeypatch.setattr("safe_ops.facts.kernel_table.kernel_table", lambda: table)
    h200 = Runtime("t", None, "H200", (9, 0), "2.2.0", "sage2_sm90", None, None, None, None)
    kernels = A.installed_kernels(h200)
    fams = [k.family for k in kernels if not k.move_only]
    assert fams == ["sage2_sm90", "sage2_fp8pv_perwarp"]            # sm120 kernel does not run on sm_90
    # sage's own fp16-PV kernel (unmeasured in this table) joins as a quality-guard move target only
    assert [k.family for k in kernels if k.move_only] == ["sage2_sm80"]     # tests/unit/test_quality_order.py
    att = SafeAttention(Policy(kernel="auto", verify="off"), kernels=kernels, rt=h200)
    assert att.candidates(None, comfy_wants_sage=False) == ["sage2_fp8pv_perwarp", "sage2_sm90", "sdpa"]
    rtx = Runtime("t", None, "RTX 5090", (12, 0), "2.2.0", "sage2_sm120_fp8pv", None, None, None, None)
    planning = lambda rt: [k.family for k in A.installed_kernels(rt) if not k.move_only]  # noqa: E731
    assert planning(rtx) == ["sage2_sm120_fp8pv"]
    table["archs"]["sm_120"] = {"tflops": {"sage2_fp8pv_perwarp": 999.0}}   # even if measured
    assert planning(rtx) == ["sage2_sm120_fp8pv"]
    assert "sage2_fp8pv_perwarp" not in [k.family for k in A.installed_kernels(rtx)]   # not even to move to
    assert all(k.fn_lse is not None and k.envelope.returns_lse for k in A.installed_kernels(h200))


def test_ck_detection_by_version(monkeypatch):
    import safe_ops.facts.devices as R
    versions = {"comfy-kitchen": "0.2.26"}
    monkeypatch.setattr(R, "_dist_version", lambda name: versions.get(name))
    v, fam, err = R._ck_facts((12, 0))
    assert (v, fam) == ("0.2.26", None) and "needs >= 0.2.29" in err
    versions["comfy-kitchen"] = "0.2.40"
    v, fam, err = R._ck_facts(None)
    assert (v, fam, err) == ("0.2.40", None, "no CUDA device")
    versions.clear()
    monkeypatch.setattr(R.importlib.util, "find_spec", lambda name: None)
    monkeypatch.delitem(sys.modules, "comfy_kitchen", raising=False)   # another test may import it
    assert R._ck_facts((9, 0)) == (None, None, "package not installed")


def test_comfy_flags_name_the_configured_kernel(monkeypatch):
    import sys
    import types

    from safe_ops.attention.kernel_choice import comfy_attention_choice
    assert comfy_attention_choice() is None                          # ComfyUI not loaded
    cli = types.ModuleType("comfy.cli_args")
    cli.args = types.SimpleNamespace(use_ck_attention=True)
    monkeypatch.setitem(sys.modules, "comfy.cli_args", cli)
    assert comfy_attention_choice() == "ck"
    mm = types.ModuleType("comfy.model_management")
    mm.sage_attention_enabled = lambda: True
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    assert comfy_attention_choice() == "sage"

    def attention_pytorch(*a, **k): pass             # noqa: E704
    sage_rt = Runtime("t", None, "RTX 5090", (12, 0), "2.2.0", "sage2_sm120_fp8pv", None, None, None, None)
    att = SafeAttention(Policy(kernel="auto"), kernels=[Kernel(toy_envelope("sage2_sm120_fp8pv"), None)], rt=sage_rt)
    assert att.candidates(None)[0] == "sage2_sm120_fp8pv"            # no function: the flags
    assert att.candidates(attention_pytorch)[0] == "sdpa"            # the function ComfyUI passed wins


def test_budget_replan_to_sdpa_is_a_counted_fallback_and_verifies_nothing():
    """When nothing of the family fits the budget any more, that call runs SDPA: counted as a
    fallback, and the kernel is not marked verified for a class it never ran."""
    comfy = ComfyFunc()
    att, kern = make_attn(policy=Policy(kernel="sage", verify="first"))
    q, k, v = h3_like(700)
    budget = {"now": 0}                                # nothing fits
    att._budget = lambda dev: budget["now"]
    out = att(comfy, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    torch.testing.assert_close(out.double(), reference(q, k, v), rtol=1e-5, atol=1e-5)
    assert not kern.launches and report.value("fallbacks") == 1 and report.value("probes") == 0
    assert any("memory budget" in r for r in report.snapshot()["fallback_reasons"])
    budget["now"] = 10**12                             # memory is back: the kernel runs and is probed
    att(comfy, q, k, v, 4, skip_reshape=True)
    assert kern.launches and report.value("probes") == 1


def test_out_of_memory_in_a_kernel_falls_back_for_that_call_only():
    comfy = ComfyFunc()
    env = toy_envelope()
    fails = [True]

    def oom_once(q, k, v, layout, scale):
        if fails.pop(0) if fails else False:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.90 GiB")
        return reference(q, k, v, scale).to(q.dtype).contiguous()

    att = SafeAttention(Policy(kernel="sage", verify="off"), kernels=[Kernel(env, oom_once, 0.05)], rt=CPU_RT)
    q, k, v = h3_like(100)
    out = att(comfy, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    torch.testing.assert_close(out.double(), reference(q, k, v), rtol=1e-5, atol=1e-5)
    assert report.value("oom_fallbacks") == 1 and not att.broken
    att(comfy, q, k, v, 4, skip_reshape=True)             # the kernel is used again
    assert report.value("oom_fallbacks") == 1 and report.value("fallbacks") == 1


@pytest.mark.parametrize("msg,sticky", [
    ("CUDA error: no kernel image is available for execution on the device", False),
    ("CUDA error: invalid device function", False),
    ("CUDA error: an illegal memory access was encountered", True),
    ("CUDA error: unspecified launch failure", True),
])
def test_only_sticky_cuda_errors_propagate(msg, sticky):
    comfy = ComfyFunc()
    def failing(q, k, v, layout, scale):
        raise RuntimeError(msg)

    att = SafeAttention(Policy(kernel="sage"), kernels=[Kernel(toy_envelope(), failing, 0.05)], rt=CPU_RT)
    q, k, v = h3_like(100)
    if sticky:
        with pytest.raises(RuntimeError, match=msg.split(": ")[1]):
            att(comfy, q, k, v, 4, skip_reshape=True)
    else:
        out = att(comfy, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
        torch.testing.assert_close(out.double(), reference(q, k, v), rtol=1e-5, atol=1e-5)
        assert "toy_sage" in att.broken and report.value("kernel_errors") == 1


def test_budget_is_read_at_most_every_poll_interval_and_bucketed(monkeypatch):
    import safe_ops.facts.budget as A
    reads, clock = [], {"t": 100.0}
    free = {"b": 10 * 2**30}

    def fake_free(device):
        reads.append(device)
        return free["b"]

    monkeypatch.setattr(A, "free_device_bytes", fake_free)
    monkeypatch.setattr(A.time, "monotonic", lambda: clock["t"])
    att, _ = make_attn()
    dev = torch.device("cuda", 0)                    # never touched: the reader is faked
    b1 = att._budget(dev)
    assert b1 == A.budget_bucket(int(10 * 2**30 * A.FREE_MEMORY_FRACTION)) and b1 <= 8 * 2**30
    free["b"] = 9 * 2**30
    assert att._budget(dev) == b1 and len(reads) == 1          # within the poll interval: cached
    clock["t"] += 2 * A.BUDGET_POLL_S
    assert att._budget(dev) < b1 and len(reads) == 2           # re-read, lower bucket
    assert att._budget(torch.device("cpu")) is None            # no budget off CUDA


def test_probe_reference_in_key_blocks_equals_whole_softmax():
    from safe_ops.attention.verification import reference_rows
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, 16, generator=g) * 3 for n in (40, 5000, 5000))
    whole = torch.softmax(q.double() @ k.double().T * 0.25, -1) @ v.double()
    blocked = reference_rows(q, k, v, 0.25, max_bytes=1)          # the smallest block: 1024 keys
    torch.testing.assert_close(blocked.double(), whole, rtol=1e-5, atol=1e-5)


def test_probe_out_of_memory_is_inconclusive_not_a_failed_prompt(monkeypatch, caplog):
    import safe_ops.attention.fallbacks as A     # the first-call check (override.py's verify stage)
    att, kern = make_attn(policy=Policy(kernel="sage", verify="first"))
    q, k, v = h3_like(100)
    real = A.compare
    monkeypatch.setattr(A, "compare", lambda *a, **kw: (_ for _ in ()).throw(
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 600.00 MiB")))
    out = att(raw, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    torch.testing.assert_close(out.double(), reference(q, k, v), rtol=1e-5, atol=1e-5)   # the kernel's
    assert report.value("probes_inconclusive") == 1 and report.value("probes") == 0
    assert "no memory to check" in caplog.text
    monkeypatch.setattr(A, "compare", real)
    att(raw, q, k, v, 4, skip_reshape=True)                       # checked again, now it can
    assert report.value("probes") == 1 and len(kern.launches) == 2


def test_an_odd_error_of_one_call_disables_nothing(caplog):
    """A kernel raising something that is not a build problem falls back for that call only: the
    family stays in use for the next call (one malformed call never disables a kernel)."""
    comfy = ComfyFunc()
    calls = []

    def picky(q, k, v, layout, scale):
        calls.append(q.shape[2])
        if len(calls) == 1:
            raise ValueError("some shape this kernel did not expect")
        return reference(q, k, v, scale).to(q.dtype)

    att = SafeAttention(Policy(kernel="sage", verify="off"), kernels=[Kernel(toy_envelope(), picky, 0.05)], rt=CPU_RT)
    q, k, v = h3_like(100)
    out = att(comfy, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    torch.testing.assert_close(out.double(), reference(q, k, v), rtol=1e-5, atol=1e-5)
    assert not att.broken and report.value("call_fallbacks") == 1 and len(comfy.calls) == 1
    att(comfy, q, k, v, 4, skip_reshape=True)
    assert len(calls) == 2 and len(comfy.calls) == 1, "the kernel runs the next call"


def test_malformed_calls_are_comfys_and_integer_like_heads_are_read():
    import numpy as np
    comfy = ComfyFunc()
    att, kern = make_attn()
    q, k = torch.randn(1, 4, 30, 16), torch.randn(1, 4, 30, 16)
    v = torch.randn(1, 4, 30, 32)                           # another head dim for V
    out = att(comfy, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)   # ComfyUI's own function runs it
    assert out.shape == (1, 4, 30, 32) and not kern.launches and len(comfy.calls) == 1 and not att.broken
    q, k, v = h3_like(100)
    out = att(raw, q, k, v, np.int64(4), skip_reshape=True, skip_output_reshape=True)
    torch.testing.assert_close(out.double(), reference(q, k, v), rtol=1e-5, atol=1e-5)
    assert len(kern.launches) == 1, "numpy's int heads is planned like an int"


def test_disabled_families_and_failed_checks_are_in_the_stats():
    """What the node's /safesage/stats shows: a family switched off for the process (its build
    cannot run here) and a class of call whose check failed, each with why."""
    def not_here(q, k, v, layout, scale):
        raise RuntimeError("SM90 kernel is not available. Make sure you GPUs with compute capability 9.0.")
    att2, _ = make_attn(policy=Policy(kernel="sage", verify="first"), corrupt=corrupt_tail)
    q2, k2, v2 = (torch.randn(1, 4, 128, 16) for _ in range(3))
    att2(ComfyFunc(), q2, k2, v2, 4, skip_reshape=True)
    # (in this order: once switched off, the family is off for every SafeSage in the process)
    att = SafeAttention(Policy(kernel="sage", verify="off"), kernels=[Kernel(toy_envelope(), not_here, 0.05)],
                        rt=CPU_RT)
    q, k, v = h3_like(100)
    att(ComfyFunc(), q, k, v, 4, skip_reshape=True)
    snap = report.snapshot()
    # each listed with where it holds: the GPU arch and the kernel build (Runtime.kernel_site)
    assert "SM90 kernel is not available" in snap["disabled_families"][f"toy_sage on {CPU_RT.kernel_site('toy_sage')}"]
    (cls, why), = snap["failed_checks"].items()
    assert cls.startswith("toy_sage on cpu float32 q(1, 4, 128, 16)") and "failed verification" in why
    report.reset()
    assert report.snapshot()["disabled_families"] == {} and report.snapshot()["failed_checks"] == {}


def test_per_shape_entries_are_bounded(monkeypatch):
    monkeypatch.setattr(report, "MAX_KEYS", 3)
    for i in range(10):
        report.remember_plan(f"shape {i}", "plan")
        report.fallback(f"reason {i}")
    snap = report.snapshot()
    assert list(snap["plans"]) == ["shape 7", "shape 8", "shape 9"]
    assert list(snap["fallback_reasons"]) == ["reason 7", "reason 8", "reason 9"] and snap["fallbacks"] == 10
