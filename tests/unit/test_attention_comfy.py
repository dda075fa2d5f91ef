"""Every call SafeSage does not give to a guarded kernel runs what ComfyUI would have run (CPU).

With stand-ins for ComfyUI's attention module (``comfy.ldm.modules.attention``: a wrapped
``attention_sage`` that calls a stand-in ``sageattention.sageattn``, ``attention_pytorch``, a
comfy-kitchen function) and for another pack's override:
* a non-sage ``func`` (split, sub-quadratic, PyTorch...) gets the call with the caller's
  arguments, the very tensors and keywords (``attn_precision``, masks, extras);
* an unguarded sage / comfy-kitchen ``func`` (by identity with ComfyUI's own, wrapped or inner,
  or by name for other packs' wrappers) is replaced by ComfyUI's own ``attention_pytorch``;
  sageattn is never called;
* an override already on the model is chained: it runs those calls with ComfyUI's ``func``,
  unless it would run an unguarded kernel outside that kernel's limits (then SafeSage runs
  attention_pytorch and logs it once); core's ``ModelAttentionBackend`` closure is seen through;
* a layer that asked ComfyUI for its own function (per-layer ``comfy_attention``) gets that
  function's kernel, guarded, and never another guarded kernel.
"""
import functools
import sys
import types

import pytest
import torch

from safe_ops.ui import run_stats
from safe_ops.attention.override import SafeAttention
from safe_ops.attention.comfy_functions import comfy_function, unguarded_kind
from safe_ops.families.envelope import FAMILIES
from safe_ops.families.family import Kernel
from safe_ops.policy import Policy

from test_attention import CPU_RT, ComfyFunc, EnvelopeAssertingKernel, h3_like, reference, toy_envelope


def _wrap_attn(func):
    """ComfyUI's wrap_attn shape: a functools.wraps wrapper (so ``__wrapped__`` is the inner)."""
    @functools.wraps(func)
    def wrapper(*a, **k):
        return func(*a, **k)
    return wrapper


@pytest.fixture
def comfy_attention(monkeypatch):
    """Stand-ins for comfy.ldm.modules.attention and sageattention, installed in sys.modules."""
    sage_calls, pytorch = [], ComfyFunc()
    sage_mod = types.ModuleType("sageattention")
    sage_mod.sageattn = lambda *a, **k: sage_calls.append(1) or pytest.fail("unguarded sageattn ran")
    monkeypatch.setitem(sys.modules, "sageattention", sage_mod)

    def attention_sage(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                       skip_output_reshape=False, **kwargs):
        import sageattention
        return sageattention.sageattn(q, k, v)

    def attention_comfy_kitchen_int8(*a, **k):
        pytest.fail("unguarded comfy-kitchen int8_attention ran")

    def attention_sub_quad(*a, **k):
        return pytorch(*a, **k)

    att = types.ModuleType("comfy.ldm.modules.attention")
    att.attention_sage = _wrap_attn(attention_sage)
    att.attention_comfy_kitchen_int8 = _wrap_attn(attention_comfy_kitchen_int8)
    att.attention_pytorch = _wrap_attn(pytorch)
    att.attention_sub_quad = _wrap_attn(attention_sub_quad)
    monkeypatch.setitem(sys.modules, "comfy.ldm.modules.attention", att)
    run_stats.reset()
    return types.SimpleNamespace(module=att, pytorch=pytorch, sage_calls=sage_calls)


def _no_guarded_kernel(policy=Policy(kernel="sdpa", verify="off"), **kw):
    return SafeAttention(policy, kernels=[], rt=CPU_RT, **kw)


def test_a_non_sage_func_gets_the_call_with_the_callers_arguments(comfy_attention):
    seen = []

    def attention_split(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, **kwargs):
        seen.append((q, k, v, heads, mask, attn_precision, skip_reshape, kwargs))
        return "split's result"

    att = _no_guarded_kernel()
    q, k, v = (torch.randn(2, 10, 64) for _ in range(3))
    mask = torch.zeros(10, 10)
    to = {"block_index": 3}
    assert att(attention_split, q, k, v, 4, mask=mask, attn_precision=torch.float32,
               transformer_options=to, enable_gqa=False) == "split's result"
    (got,) = seen
    assert got[0] is q and got[1] is k and got[2] is v and got[3] == 4 and got[4] is mask
    assert got[5] is torch.float32 and got[6] is False
    assert got[7] == {"transformer_options": to, "enable_gqa": False}
    assert not comfy_attention.pytorch.calls


@pytest.mark.parametrize("which", ["inner", "wrapped"])
def test_comfys_unguarded_sage_is_replaced_by_its_attention_pytorch(comfy_attention, which):
    sage = comfy_attention.module.attention_sage
    func = sage.__wrapped__ if which == "inner" else sage
    assert unguarded_kind(func) == "sage"
    assert comfy_function(func) is comfy_attention.pytorch           # the inner attention_pytorch
    att = _no_guarded_kernel(Policy(kernel="auto", verify="off"))
    q, k, v = h3_like(50)
    out = att(func, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    torch.testing.assert_close(out.double(), reference(q, k, v), rtol=1e-5, atol=1e-5)
    assert len(comfy_attention.pytorch.calls) == 1 and not comfy_attention.sage_calls


def test_kitchen_and_other_packs_sage_by_name(comfy_attention):
    assert unguarded_kind(comfy_attention.module.attention_comfy_kitchen_int8.__wrapped__) == "ck"

    def sageattn_wrapper_of_another_pack(*a, **k):
        pytest.fail("unguarded")
    assert unguarded_kind(sageattn_wrapper_of_another_pack) == "sage"
    assert comfy_function(sageattn_wrapper_of_another_pack) is comfy_attention.pytorch
    # ComfyUI's own non-sage functions and SafeSage itself are not "unguarded sage"
    for f in (comfy_attention.module.attention_sub_quad, comfy_attention.module.attention_pytorch,
              _no_guarded_kernel()):
        assert unguarded_kind(f) is None and comfy_function(f) is f


def test_unreadable_call_goes_to_comfy_too(comfy_attention):
    att = _no_guarded_kernel(Policy(kernel="auto", verify="off"))
    sage = comfy_attention.module.attention_sage.__wrapped__
    bad = (torch.randn(1, 5, 64), torch.randn(1, 5, 64), torch.randn(1, 5, 64), 3)   # 64 % 3
    with pytest.raises(RuntimeError):          # ComfyUI's own function raises on it, as it would
        att(sage, *bad)
    assert len(comfy_attention.pytorch.calls) == 1 and not comfy_attention.sage_calls
    # no guarded kernel can take any call here: the call is not read, nothing fell back
    assert run_stats.value("fallbacks") == 0 and run_stats.value("plan:sdpa") == 1


# ------------------------------------------------------------------ composition
def test_previous_override_runs_the_calls_safesage_does_not_guard(comfy_attention):
    env = toy_envelope()
    kern = EnvelopeAssertingKernel(env)
    seen = []

    def another_packs_override(func, *a, **k):
        seen.append(func)
        return func(*a, **k)

    att = SafeAttention(Policy(kernel="sage", verify="off"), kernels=[Kernel(env, kern, 0.05)], rt=CPU_RT,
                        previous=another_packs_override)
    sub_quad = comfy_attention.module.attention_sub_quad.__wrapped__
    q, k, v = h3_like(100)
    att(sub_quad, q, k, v, 4, skip_reshape=True)                    # guarded toy kernel: not chained
    assert len(kern.launches) == 1 and not seen
    mask = torch.zeros(1, 1, 100, 100)
    att(sub_quad, q, k, v, 4, mask=mask, skip_reshape=True)         # a mask: the chained override runs
    assert seen == [sub_quad] and len(kern.launches) == 1


def test_core_model_attention_backend_closure_is_seen_through(comfy_attention):
    """core's ModelPatcher.set_model_optimized_attention: ``override(_, *a, **k)`` closing over
    the function it runs (here comfy-kitchen's): its kind is comfy-kitchen."""
    kitchen = comfy_attention.module.attention_comfy_kitchen_int8

    def set_model_optimized_attention(optimized_attention):
        def optimized_attention_override(_, *args, **kwargs):
            return optimized_attention(*args, **kwargs)
        return optimized_attention_override
    assert unguarded_kind(set_model_optimized_attention(kitchen)) == "ck"
    assert unguarded_kind(set_model_optimized_attention(comfy_attention.module.attention_pytorch)) is None


def test_previous_unguarded_sage_is_overruled_outside_its_limits_only(comfy_attention, monkeypatch, caplog):
    env = toy_envelope(family="toy_sage_installed")          # 16-bit index products on the CPU
    monkeypatch.setitem(FAMILIES, env.family, env)
    rt = CPU_RT.__class__(**{**CPU_RT.__dict__, "sage_family": env.family})
    ran = []

    def patch_sage_attention_kj(func, *a, **k):               # another pack: sage, no guard
        ran.append(a[0].shape[2])
        return reference(*a[:3]).to(a[0].dtype)

    att = SafeAttention(Policy(kernel="sdpa", verify="off"), kernels=[], rt=rt, previous=patch_sage_attention_kj)
    assert att.previous_kind == "sage"
    func = comfy_attention.module.attention_sub_quad.__wrapped__
    small = h3_like(100)                    # inside the toy envelope
    att(func, *small, 4, skip_reshape=True, skip_output_reshape=True)
    assert ran == [100] and not comfy_attention.pytorch.calls
    big = h3_like(700)                      # strided past 16-bit products: outside its limits
    for _ in range(2):
        out = att(func, *big, 4, skip_reshape=True, skip_output_reshape=True)
    torch.testing.assert_close(out.double(), reference(*big), rtol=1e-5, atol=1e-5)
    assert ran == [100] and len(comfy_attention.pytorch.calls) == 2
    msgs = [r.getMessage() for r in caplog.records if "would run toy_sage_installed unguarded" in r.getMessage()]
    assert len(msgs) == 1 and "patch_sage_attention_kj" in msgs[0]
    assert run_stats.value("previous_overruled") == 2


def test_a_layer_gets_the_kernel_it_asked_for_guarded(comfy_attention):
    sage_env, ck_env = toy_envelope("toy_sage"), toy_envelope("ck_toy")
    sage_k, ck_k = EnvelopeAssertingKernel(sage_env), EnvelopeAssertingKernel(ck_env)
    kitchen = comfy_attention.module.attention_comfy_kitchen_int8
    att = SafeAttention(Policy(kernel="sage", verify="off"),
                        kernels=[Kernel(sage_env, sage_k, 0.05), Kernel(ck_env, ck_k, 0.05)], rt=CPU_RT,
                        layer_functions={3: kitchen})
    func = comfy_attention.module.attention_sub_quad.__wrapped__
    q, k, v = h3_like(100)
    att(func, q, k, v, 4, skip_reshape=True, transformer_options={"block_index": 3})
    att(func, q, k, v, 4, skip_reshape=True, transformer_options={"block_index": 4})
    assert len(ck_k.launches) == 1 and len(sage_k.launches) == 1
    # where its kernel cannot run the call, ComfyUI's attention_pytorch -- never the other kernel
    att(func, q, k, v, 4, mask=torch.zeros(1, 1, 100, 100), skip_reshape=True,
        transformer_options={"block_index": 3})
    assert len(ck_k.launches) == 1 and len(sage_k.launches) == 1 and len(comfy_attention.pytorch.calls) == 1


def test_an_override_with_an_empty_closure_cell_is_read():
    def make():
        def override(func, *a, **k):
            return later(*a, **k)          # noqa: F821 -- 'later' is bound after: an empty cell now
        cells = override.__closure__
        assert cells is not None
        return override
    later = None                           # noqa: F841
    del later
    assert unguarded_kind(make()) is None


def test_the_chained_overrides_limits_are_checked_once_per_call_signature(comfy_attention, monkeypatch):
    import safe_ops.attention.handoff as A
    env = toy_envelope(family="toy_sage_checked")
    monkeypatch.setitem(FAMILIES, env.family, env)
    rt = CPU_RT.__class__(**{**CPU_RT.__dict__, "sage_family": env.family})
    checks = []
    real = A.check
    monkeypatch.setattr(A, "check", lambda call, e: checks.append(e.family) or real(call, e))

    def sage_override(func, *a, **k):
        return reference(*a[:3]).to(a[0].dtype)

    att = SafeAttention(Policy(kernel="sdpa", verify="off"), kernels=[], rt=rt, previous=sage_override)
    q, k, v = h3_like(100)
    for _ in range(3):
        att(comfy_attention.module.attention_sub_quad.__wrapped__, q, k, v, 4, skip_reshape=True)
    assert checks == ["toy_sage_checked"]
