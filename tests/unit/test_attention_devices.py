"""Runtime facts per device: in a process with two GPUs of different archs, each GPU's calls are
guarded with that GPU's own runtime, kernels and limits (runtime(device), SafeAttention._guard_for)."""
import dataclasses

import pytest
import torch

from safe_ops.attention import handoff, override as attention
from safe_ops.ui import run_stats
from safe_ops.attention.override import SafeAttention
from safe_ops.families.sage1 import SAGE1_TRITON
from safe_ops.families.family import Kernel
from safe_ops.policy import Policy
from safe_ops.facts.devices import Runtime

BASE = Runtime("test", "13.0", "GPU", (8, 9), "2.2.0", "fam_sm89", None, "native", None, None)
RTS = {0: BASE, 1: dataclasses.replace(BASE, device_name="GPU B", arch=(12, 0), sage_family="fam_sm120")}


@pytest.fixture
def two_gpus(monkeypatch):
    """runtime(device) answers per device index; installed_kernels builds one kernel named after the
    runtime's family, so a guard's kernels show which GPU's facts they came from."""
    asked = []

    def fake_runtime(device=None):
        idx = 0 if device is None else device.index
        asked.append(idx)
        return RTS[idx]

    def fake_installed(rt):
        env = dataclasses.replace(SAGE1_TRITON, family=rt.sage_family)
        return [Kernel(env, lambda *a, **k: None, 0.05)]

    monkeypatch.setattr(attention, "runtime", fake_runtime)
    monkeypatch.setattr(attention, "installed_kernels", fake_installed)
    run_stats.reset()
    return asked


def test_a_gpu_of_another_arch_gets_a_guard_with_its_own_kernels(two_gpus):
    att = SafeAttention(Policy(kernel="sage", verify="first"))
    assert att.rt is RTS[0] and set(att.kernels) == {"fam_sm89", "sdpa"}
    g0, g1 = att._guard_for(torch.device("cuda", 0)), att._guard_for(torch.device("cuda", 1))
    assert g0 is att and g1 is not att
    assert g1.rt is RTS[1] and set(g1.kernels) == {"fam_sm120", "sdpa"}
    assert g1.verifier is att.verifier and g1.policy is att.policy, "one policy, one verdict store"
    assert att._guard_for(torch.device("cuda", 1)) is g1 and att._guard_for(torch.device("cpu")) is att
    assert two_gpus == [0, 0, 1], "each device's facts read once (the first 0 is the constructor's)"
    assert g1._guard_for(torch.device("cuda", 1)) is g1, "the other GPU's guard guards its own calls itself"


def test_kernels_handed_in_are_for_their_gpu_only(two_gpus):
    """A SafeAttention given its kernels (a bench, a test) cannot know another GPU's: calls there get
    ComfyUI's own attention (attend returns None), counted and logged."""
    att = SafeAttention(Policy(kernel="sage", verify="off"), kernels=[], rt=RTS[0])
    assert att._guard_for(torch.device("cuda", 0)) is att
    assert att._guard_for(torch.device("cuda", 1)) is None


def test_the_chained_override_is_judged_with_the_calls_gpu(two_gpus, monkeypatch):
    """An unguarded sage override chained before SafeSage is judged against the limits of the sage
    family of the GPU the call runs on."""
    seen = []
    monkeypatch.setattr(handoff, "FAMILIES", type("F", (), {"get": staticmethod(lambda f: seen.append(f))})())
    prev = lambda func, *a, **k: None                                  # noqa: E731
    prev.__name__ = "attention_sage"
    att = SafeAttention(Policy(kernel="sage", verify="off"), previous=prev)
    assert att.previous_kind == "sage"
    n = type("N", (), {"q4": type("Q", (), {"device": torch.device("cuda", 1)})(), "prepared": None})()
    assert att._previous_unsafe(n, None) is False          # no envelope found: nothing to judge
    assert seen == ["fam_sm120"]


def test_an_error_in_safesages_own_code_never_fails_the_prompt(monkeypatch, caplog):
    """A bug in choosing a plan (here: a TypeError, as a bench's 0-argument runtime stand-in gave
    on the GPU) runs ComfyUI's own attention for the call, counted and logged once with its
    traceback; a sticky CUDA error is raised (nothing can be recomputed after it)."""
    run_stats.reset()
    att = SafeAttention(Policy(kernel="sage", verify="off"), kernels=[Kernel(SAGE1_TRITON, lambda *a, **k: None, 0.05)],
                        rt=RTS[0])
    calls = []

    def comfy(q, k, v, heads, **kw):
        calls.append(q.shape)
        return torch.full((1, q.shape[2], heads * q.shape[-1]), 3.0)

    def bug(*a, **k):
        raise TypeError("emulated() takes 0 positional arguments but 1 was given")
    monkeypatch.setattr(att, "_prepare", bug)
    q = torch.randn(1, 2, 5, 8)
    with caplog.at_level("ERROR", logger="SafeSage"):
        for _ in range(2):
            out = att(comfy, q, q, q, 2, skip_reshape=True)
            assert torch.equal(out, torch.full((1, 5, 16), 3.0))
    assert len(calls) == 2
    snap = run_stats.snapshot()
    assert snap["internal_errors"] == 2 and snap["fallbacks"] == 2
    errors = [r for r in caplog.records if "internal error" in r.getMessage()]
    assert len(errors) == 1 and errors[0].exc_info is not None, "logged once, with the traceback"

    def sticky(*a, **k):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(att, "_prepare", sticky)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        att(comfy, torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8), 2, skip_reshape=True)
