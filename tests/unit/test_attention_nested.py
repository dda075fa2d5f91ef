"""Nested SafeSage overrides (CPU): a foreign override P chaining SafeSage #1 (which guards a fake
sage family), with SafeSage #2 (kernel="sdpa") on top. The outermost SafeSage decides: #2's
calls go through P into #1, which passes them through to what ComfyUI would run -- no sage
launch (guarded or not) that #2 did not choose, each call counted once. A wrap_attn-wrapped
``func`` handed to the override is unwrapped (calling it would enter the override again).
"""
import pytest
import torch

from safe_ops.ui import run_stats
from safe_ops.attention.override import SafeAttention
from safe_ops.families.family import Kernel
from safe_ops.policy import Policy

from tools.harness.comfy_attention_fn import attention, wrap_attn
from test_attention import CPU_RT, ComfyFunc, EnvelopeAssertingKernel, h3_like, reference, toy_envelope


@pytest.fixture(autouse=True)
def _reset():
    run_stats.reset()
    yield


def _chain(inner_previous=None):
    env = toy_envelope()
    fake_sage = EnvelopeAssertingKernel(env)
    ss1 = SafeAttention(Policy(kernel="sage", verify="off"), kernels=[Kernel(env, fake_sage, 0.05)], rt=CPU_RT,
                        previous=inner_previous)
    seen = []

    def foreign_override(func, *args, **kwargs):          # chains what was on the model before it
        seen.append(func)
        return ss1(func, *args, **kwargs)

    ss2 = SafeAttention(Policy(kernel="sdpa", verify="off"), kernels=[], rt=CPU_RT, previous=foreign_override)
    return ss2, fake_sage, seen


def test_nested_override_the_outermost_safesage_decides():
    ss2, fake_sage, seen = _chain()
    comfy = ComfyFunc()
    q, k, v = h3_like(100)                 # inside the fake sage family's envelope
    for _ in range(2):
        out = ss2(comfy, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    torch.testing.assert_close(out.double(), reference(q, k, v), rtol=1e-5, atol=1e-5)
    assert not fake_sage.launches, "#2 says never a sage kernel: #1 must not launch its own"
    assert len(seen) == 2 and len(comfy.calls) == 2          # through P, into ComfyUI's function
    assert run_stats.value("attention_calls") == 2 and run_stats.value("nested_calls") == 2
    assert run_stats.value("plan:direct") == 0


def test_nested_override_inner_never_runs_an_unguarded_sage_it_chained():
    ran = []

    def sageattn_patch_of_another_pack(func, *args, **kwargs):     # unguarded sage, by name
        ran.append(1)
        return func(*args, **kwargs)

    ss2, fake_sage, _ = _chain(inner_previous=sageattn_patch_of_another_pack)
    comfy = ComfyFunc()
    q, k, v = h3_like(100)
    ss2(comfy, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    assert not ran and not fake_sage.launches and len(comfy.calls) == 1


def test_nested_override_an_outer_guarded_call_runs_once():
    """#2 guards the call itself: P and #1 are not entered at all."""
    env = toy_envelope()
    outer_kernel = EnvelopeAssertingKernel(env)
    ss2, fake_sage, seen = _chain()
    ss2 = SafeAttention(Policy(kernel="sage", verify="off"), kernels=[Kernel(env, outer_kernel, 0.05)], rt=CPU_RT,
                        previous=ss2.previous)
    q, k, v = h3_like(100)
    ss2(ComfyFunc(), q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    assert len(outer_kernel.launches) == 1 and not fake_sage.launches and not seen
    assert run_stats.value("attention_calls") == 1 and run_stats.value("nested_calls") == 0


def test_nested_override_wrapped_func_does_not_reenter():
    """A caller that hands the override a wrap_attn-wrapped function, with the override in its
    transformer_options and no ``_inside_attn_wrapper``: SafeSage runs the inner function once."""
    real, _ = attention()
    calls = []

    def attention_sub_quad(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                           skip_output_reshape=False, **kwargs):
        calls.append(1)
        return real.__wrapped__(q, k, v, heads, mask=mask, skip_reshape=skip_reshape,
                                skip_output_reshape=skip_output_reshape)

    wrapped = wrap_attn(attention_sub_quad)
    att = SafeAttention(Policy(kernel="sdpa", verify="off"), kernels=[], rt=CPU_RT)
    q, k, v = (torch.randn(1, 30, 64) for _ in range(3))
    out = att(wrapped, q, k, v, 4, transformer_options={"optimized_attention_override": att})
    assert calls == [1] and out.shape == (1, 30, 64)
    assert run_stats.value("attention_calls") == 1


def test_nested_override_under_compile():
    """The same chain under torch.compile: the outer passes the call through P (traced) with its
    keyword; #1 passes it to ComfyUI's function: no sage launch, no graph break, no opaque op."""
    real, _ = attention()
    ss2, fake_sage, _ = _chain()

    class Toy(torch.nn.Module):
        def forward(self, x):
            return real(x, x, x, 4, transformer_options={"optimized_attention_override": ss2})

    x = torch.randn(1, 100, 64)
    torch._dynamo.reset()
    try:
        explained = torch._dynamo.explain(Toy())(x)
        compiled = torch.compile(Toy(), backend="aot_eager")(x)
    finally:
        torch._dynamo.reset()
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]
    assert not fake_sage.launches
    torch.testing.assert_close(compiled, real(x, x, x, 4), rtol=1e-6, atol=1e-6)


def test_nested_override_a_contained_fallback_still_tells_the_inner_one(monkeypatch):
    """#2's own code fails (contained): the fallback runs the chained override P, and #1 below it
    still passes through -- no fake sage launch #2 never chose."""
    ss2, fake_sage, seen = _chain()

    def bug(*a, **k):
        raise RuntimeError("a bug in SafeSage #2")

    monkeypatch.setattr(ss2, "_call", bug)
    comfy = ComfyFunc()
    q, k, v = h3_like(100)
    out = ss2(comfy, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    torch.testing.assert_close(out.double(), reference(q, k, v), rtol=1e-5, atol=1e-5)
    assert run_stats.value("internal_errors") == 1 and len(seen) == 1
    assert not fake_sage.launches and run_stats.value("nested_calls") == 1
