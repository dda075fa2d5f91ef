"""The override's fast path (issue #29, point 1): a repeated call signature is not read again, its
plan is found in one lookup, and the kernel gets the caller's own layout -- as many tensor
operations as ComfyUI's own sage path makes, no NHD -> HND -> NHD round trip. Anything the plan
depends on (strides, base alignment, dtype, heads, the form's flags, ComfyUI's function) makes a
new signature. Calls no guarded kernel takes go to ComfyUI's function without being read. CPU."""
import dataclasses

import pytest
import torch
from torch.overrides import TorchFunctionMode

from safe_ops.attention import call_forms, override
from safe_ops.families.ck_int8 import AlignRule
from safe_ops.families.family import Kernel
from safe_ops.policy import Policy
from safe_ops.ui import run_stats

from test_attention import CPU_RT, ComfyFunc, h3_like, make_attn, raw, reference, toy_envelope


@pytest.fixture(autouse=True)
def _clean():
    run_stats.reset()
    yield
    run_stats.reset()


@pytest.fixture
def reads(monkeypatch):
    """How often a call is read in full (call_forms.read_form)."""
    seen = []
    real = call_forms.read_form

    def counted(a, kwargs):
        seen.append(1)
        return real(a, kwargs)
    monkeypatch.setattr(override, "read_form", counted)
    return seen


class Ops(TorchFunctionMode):
    """Every torch function and Tensor method called inside (views, transposes, reshapes...)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def null_attn():
    """A guarded family whose kernel returns a preallocated result (no tensor operation of its own)."""
    env = toy_envelope(small_ints=False)
    out = {}

    def kernel(q, k, v, layout, scale):
        shape = q.shape
        out["t"] = out.get("t") if out.get("t") is not None and out["t"].shape == shape else torch.zeros(shape)
        return out["t"]
    att = override.SafeAttention(Policy(kernel="sage", verify="off", quality="faults only"),
                                 kernels=[Kernel(env, kernel, 0.05)], rt=CPU_RT)
    return att, out


def test_a_repeated_signature_is_read_once_and_runs_its_plan(reads):
    att, kern = make_attn()
    q, k, v = h3_like(100)
    for _ in range(3):
        out = att(raw, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
        torch.testing.assert_close(out.double(), reference(q, k, v), rtol=1e-5, atol=1e-5)
    assert len(reads) == 1 and len(kern.launches) == 3 and len(att._prepared) == 1
    assert run_stats.value("attention_calls") == 3 and run_stats.value("plan:direct") == 3


@pytest.mark.parametrize("change", ["strides", "alignment", "dtype", "heads", "skip_output_reshape", "func",
                                    "low_precision"])
def test_what_the_plan_depends_on_makes_a_new_signature(reads, change):
    # a family whose rule reads base pointers (comfy-kitchen's AlignRule): alignment is in the key
    att, kern = make_attn(dataclasses.replace(toy_envelope(), extra_rules=(AlignRule("toy_sage"),)))
    comfy = ComfyFunc()
    q, k, v = h3_like(64)
    kw = {"skip_reshape": True, "skip_output_reshape": True}
    att(comfy, q, k, v, 4, **kw)
    heads = 4
    func = comfy
    if change == "strides":
        q, k, v = (t.contiguous() for t in (q, k, v))
    elif change == "alignment":                  # the same views one element into their buffer
        buf = torch.randn(64 * 3 * 64 + 1)[1:].view(64, 3 * 64)
        q, k, v = (t.view(64, 4, 16).transpose(0, 1).unsqueeze(0) for t in buf.split(64, dim=-1))
    elif change == "dtype":
        q, k, v = (t.double() for t in (q, k, v))
    elif change == "heads":
        q, k, v = (t.reshape(1, 2, 64, 32) for t in (q, k, v))
        heads = 2
    elif change == "skip_output_reshape":
        kw = {"skip_reshape": True}
    elif change == "func":
        func = ComfyFunc()
    elif change == "low_precision":
        kw = {**kw, "low_precision_attention": False}
    att(func, q, k, v, heads, **kw)
    assert len(reads) == 2 or (change == "low_precision" and len(reads) == 1), \
        "a new signature is read in full (a full-precision call is not read at all: ComfyUI's own runs it)"
    if change == "low_precision":
        assert len(kern.launches) == 1 and len(comfy.calls) == 1
    else:
        assert len(att._prepared) == 2


def test_base_alignment_is_in_the_signature_only_where_a_rule_reads_it(reads):
    """Without a family that checks base pointers, the same views one element further into their
    buffer are the same signature (nothing planned depends on it): no read, one plan."""
    att, kern = make_attn()
    buf = torch.randn(64 * 3 * 64 + 1)
    views = [[t.view(64, 4, 16).transpose(0, 1).unsqueeze(0) for t in b.view(64, 3 * 64).split(64, dim=-1)]
             for b in (buf[:-1], buf[1:])]
    for q, k, v in views:
        att(raw, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    assert len(reads) == 1 and len(att._prepared) == 1 and len(kern.launches) == 2


def test_the_3d_form_makes_comfys_own_views_and_one_flatten():
    """A repeated 3-d call: three views to NHD and one flatten back (a view, as ComfyUI's own sage
    path's reshape) -- and the result is the kernel's own output seen [B,S,H*D] (no copy). The
    old path made 3 unflatten + 3 transpose in, 3 transposes to the kernel and 2 out."""
    att, out = null_attn()
    q = torch.randn(1, 10, 64)
    att(ComfyFunc(), q, q, q, 4)
    comfy = ComfyFunc()
    att(comfy, q, q, q, 4)                         # a new func: a new signature, read
    with Ops() as ops:
        res = att(comfy, q, q, q, 4)
    tensor_ops = [n for n in ops.names if n in ("view", "reshape", "transpose", "unflatten", "contiguous",
                                                "permute", "flatten", "__get__")]
    assert sorted(n for n in tensor_ops if n != "__get__") == ["flatten", "view", "view", "view"], ops.names
    assert res.shape == (1, 10, 64) and res.data_ptr() == out["t"].data_ptr(), "a view of the kernel's output"
    assert out["t"].shape == (1, 10, 4, 16), "the kernel got NHD"


def test_the_4d_hnd_form_makes_no_tensor_operation():
    att, out = null_attn()
    q, k, v = h3_like(32)
    kw = {"skip_reshape": True, "skip_output_reshape": True}
    att(ComfyFunc(), q, k, v, 4, **kw)
    comfy = ComfyFunc()
    att(comfy, q, k, v, 4, **kw)
    with Ops() as ops:
        res = att(comfy, q, k, v, 4, **kw)
    assert not [n for n in ops.names if n in ("view", "reshape", "transpose", "unflatten", "contiguous")], ops.names
    assert res is out["t"]


def test_a_masked_call_goes_to_comfy_unread_and_is_counted(reads):
    att, kern = make_attn()
    comfy = ComfyFunc()
    q, k, v = h3_like(40)
    mask = torch.zeros(40, 40)
    for _ in range(2):
        out = att(comfy, q, k, v, 4, mask=mask, skip_reshape=True, skip_output_reshape=True)
        torch.testing.assert_close(out.double(), reference(q, k, v), rtol=1e-5, atol=1e-5)
    assert not reads and not kern.launches and len(comfy.calls) == 2
    snap = run_stats.snapshot()
    assert snap["fallbacks"] == 2 and snap["plan:sdpa"] == 2 and snap["attention_calls"] == 2
    assert [r for r in snap["fallback_reasons"] if "mask" in r and "toy_sage" in r]


def test_a_signature_no_kernel_takes_is_handed_on_without_being_bound(reads, monkeypatch):
    """A head size no family runs: planned once (SDPA, with its reason), then every call of it goes
    to ComfyUI's function without being read or bound -- still counted, with its reason."""
    att, kern = make_attn()
    binds = []
    real_bind = call_forms.CallForm.bind
    monkeypatch.setattr(call_forms.CallForm, "bind", lambda self, a, kw: binds.append(1) or real_bind(self, a, kw))
    comfy = ComfyFunc()
    q = torch.randn(1, 4, 30, 24)                 # head size 24: not in the toy's (16, 32, 64)
    for _ in range(3):
        att(comfy, q, q, q, 4, skip_reshape=True, skip_output_reshape=True)
    (p,) = att._prepared.values()
    assert p.never_guarded and len(reads) == 1 and len(binds) == 1 and len(comfy.calls) == 3
    snap = run_stats.snapshot()
    assert snap["fallbacks"] == 3 and snap["plan:sdpa"] == 3 and not kern.launches


def test_a_plan_sdpa_only_under_a_small_budget_is_not_handed_on_blindly():
    """SDPA because memory is short is not 'never guarded': more memory later gets the kernel back."""
    att, kern = make_attn()
    budget = {"b": 1}
    att._budget = lambda dev: budget["b"]
    q, k, v = h3_like(700)
    att(ComfyFunc(), q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    (p,) = att._prepared.values()
    assert p.plan.kind == "sdpa" and not p.never_guarded and not p.fixed


def test_an_unreadable_call_with_a_guarded_kernel_is_a_counted_fallback():
    att, kern = make_attn()
    comfy = ComfyFunc()
    with pytest.raises(Exception):                 # ComfyUI's own function raises on it, as it would
        att(comfy, torch.randn(1, 5, 64), torch.randn(1, 5, 64), torch.randn(1, 5, 64), 3)     # 64 % 3
    snap = run_stats.snapshot()
    assert snap["fallbacks"] == 1 and any("unsupported call" in r for r in snap["fallback_reasons"])
    assert not kern.launches and len(comfy.calls) == 1


def test_calls_handed_on_unread_are_named_once_in_the_plans():
    """The statistics' plans say what happened to calls that were not read (the node's stats panel)."""
    att, kern = make_attn(policy=Policy(kernel="sdpa", verify="off"))
    q, k, v = h3_like(20)
    for _ in range(3):
        att(ComfyFunc(), q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    plans = run_stats.snapshot()["plans"]
    assert list(plans) == ["every call"] and "not read" in plans["every call"]
    guarded, _ = make_attn()
    guarded(ComfyFunc(), q, k, v, 4, mask=torch.zeros(20, 20), skip_reshape=True, skip_output_reshape=True)
    assert "mask" in run_stats.snapshot()["plans"]["masked calls"]


def test_every_kind_of_call_asks_torch_once_and_is_counted_once(monkeypatch):
    """The override asks ``torch.compiler.is_compiling()`` once per call (the first thing it does; its
    record stage does not ask again) and counts each call once in ``attention_calls``, whatever path
    the call takes: guarded (first and repeated), handed on unread (a mask), never guarded (a head size
    no family runs), unreadable, empty."""
    import safe_ops.attention.special_calls as special
    asked = []
    real = special.torch_is_compiling

    def is_compiling():
        asked.append(1)
        return real()
    # torch's function, as the override and the store each hold it
    monkeypatch.setattr(override, "torch_is_compiling", is_compiling)
    monkeypatch.setattr(run_stats, "_tracing", is_compiling)
    att, kern = make_attn()
    comfy = ComfyFunc()
    q, k, v = h3_like(40)
    odd = torch.randn(1, 4, 30, 24)               # head size 24: never guarded
    calls = [lambda: att(raw, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)] * 3 + [
        lambda: att(comfy, q, k, v, 4, mask=torch.zeros(40, 40), skip_reshape=True, skip_output_reshape=True),
        lambda: att(comfy, odd, odd, odd, 4, skip_reshape=True, skip_output_reshape=True),
        lambda: att(comfy, odd, odd, odd, 4, skip_reshape=True, skip_output_reshape=True),
        lambda: att(comfy, q[:, :, :0], k, v, 4, skip_reshape=True, skip_output_reshape=True)]
    for i, call in enumerate(calls, 1):
        call()
        assert len(asked) == i, f"call {i}: torch asked {len(asked)} times in {i} calls"
        assert run_stats.value("attention_calls") == i, f"call {i} counted {run_stats.value('attention_calls')}"
    with pytest.raises(Exception):                 # 64 % 3: ComfyUI's own function raises on it
        att(comfy, torch.randn(1, 5, 64), torch.randn(1, 5, 64), torch.randn(1, 5, 64), 3)
    assert len(asked) == len(calls) + 1 and run_stats.value("attention_calls") == len(calls) + 1
    snap = run_stats.snapshot()
    assert snap["plan:direct"] == 3 and snap["plan:sdpa"] == 3 and snap["plan:empty"] == 1, snap
    assert len(kern.launches) == 3
