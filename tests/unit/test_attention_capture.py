"""SafeSage's override during CUDA-graph capture (CPU, ``torch.cuda.is_current_stream_capturing``
monkeypatched): no stream hop built, no probe, no budget read -- a call whose signature was
planned (and its class verified) eagerly before runs that plan on the same stream; a call
whose plan needs a hop (a family that launches on the legacy stream) or a probe (a class not
verified yet) runs ComfyUI's function. Counted. (The real capture and replay: tests/gpu/test_gpu_capture.py.)
"""
import dataclasses

import pytest
import torch

import safe_ops.attention.fallbacks as A     # where the first-call check looks compare up
import safe_ops.attention.streams as S
from safe_ops.ui import run_stats
from safe_ops.attention.override import SafeAttention
from safe_ops.families.family import Kernel
from safe_ops.policy import Policy

from test_attention import CPU_RT, ComfyFunc, EnvelopeAssertingKernel, h3_like, reference, toy_envelope


@pytest.fixture
def capture(monkeypatch):
    """state["on"]: capturing; probes and budget reads counted, in all and during capture (counted,
    not asserted inside: SafeSage contains an error raised in its planning as an internal error)."""
    state = {"on": False, "probes": 0, "budget_reads": 0, "probes_in_capture": 0, "budget_reads_in_capture": 0}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["on"])
    real_compare = A.compare

    def compare(*a, **k):
        state["probes"] += 1
        state["probes_in_capture"] += state["on"]
        return real_compare(*a, **k)

    def no_hop(*a, **k):
        raise AssertionError("a StreamHop was built")

    monkeypatch.setattr(A, "compare", compare)
    monkeypatch.setattr(S, "StreamHop", no_hop)
    run_stats.reset()
    return state


def _att(state, legacy_stream=False):
    env = dataclasses.replace(toy_envelope(), launches_on_legacy_stream=legacy_stream)
    kern = EnvelopeAssertingKernel(env)
    att = SafeAttention(Policy(kernel="sage", verify="first"), kernels=[Kernel(env, kern, 0.05)], rt=CPU_RT)

    def budget(device):
        state["budget_reads"] += 1
        state["budget_reads_in_capture"] += state["on"]
        return None

    att._budget_reader = budget
    return att, kern


def as_cuda_calls(att):
    """The toy's CPU signatures stand in for CUDA ones: a CPU call is never captured, so at a
    repeated signature SafeSage asks whether the stream is captured only for a CUDA call."""
    for p in att._prepared.values():
        p.cuda = True


def test_a_repeated_cpu_signature_is_not_asked_about_capture(capture, monkeypatch):
    att, kern = _att(capture)
    asked = []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: asked.append(1) or False)
    q, k, v = h3_like(100)
    comfy = ComfyFunc()
    att(comfy, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    assert len(asked) == 1, "a new signature: asked before its plan is made"
    att(comfy, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    assert len(asked) == 1 and len(kern.launches) == 2
    as_cuda_calls(att)
    att(comfy, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    assert len(asked) == 2, "a CUDA call's repeated signature: asked"


def test_capture_runs_the_plan_verified_earlier(capture):
    att, kern = _att(capture)
    comfy = ComfyFunc()
    q, k, v = h3_like(100)
    att(comfy, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)      # eager: plan + verify
    assert capture["probes"] == 1 and len(kern.launches) == 1 and capture["budget_reads"] > 0
    as_cuda_calls(att)
    capture["on"] = True
    out = att(comfy, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    assert len(kern.launches) == 2 and not comfy.calls and run_stats.value("internal_errors") == 0
    assert capture["probes_in_capture"] == 0 and capture["budget_reads_in_capture"] == 0
    torch.testing.assert_close(out.double(), reference(q, k, v), rtol=1e-5, atol=1e-5)
    assert run_stats.value("captured_calls") == 1 and run_stats.value("captured_guarded") == 1


def test_capture_a_call_that_needs_a_probe_runs_comfys_function(capture):
    att, kern = _att(capture)
    comfy = ComfyFunc()
    capture["on"] = True                         # never seen eagerly: its class is not verified
    q, k, v = h3_like(100)
    out = att(comfy, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    torch.testing.assert_close(out.double(), reference(q, k, v), rtol=1e-5, atol=1e-5)
    assert not kern.launches and len(comfy.calls) == 1
    assert capture["probes"] == 0 and capture["budget_reads"] == 0 and capture["probes_in_capture"] == 0
    assert run_stats.value("captured_calls") == 1 and run_stats.value("captured_guarded") == 0


def test_capture_a_plan_that_needs_a_stream_hop_runs_comfys_function(capture):
    att, kern = _att(capture, legacy_stream=True)
    comfy = ComfyFunc()
    q, k, v = h3_like(100)
    att(comfy, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)      # eager (CPU: no hop)
    assert len(kern.launches) == 1
    reads = capture["budget_reads"]
    as_cuda_calls(att)
    capture["on"] = True
    att(comfy, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    assert len(kern.launches) == 1 and len(comfy.calls) == 1
    assert capture["budget_reads"] == reads and capture["budget_reads_in_capture"] == 0


def test_capture_goes_to_comfy_for_a_chained_unguarded_sage(capture):
    """Under capture the chained override runs only when it runs no unguarded sage kernel."""
    ran = []

    def sageattn_patch(func, *a, **k):
        ran.append(1)
        return func(*a, **k)

    att = SafeAttention(Policy(kernel="sdpa", verify="off"), kernels=[], rt=CPU_RT, previous=sageattn_patch)
    comfy = ComfyFunc()
    capture["on"] = True
    att(comfy, *h3_like(50), 4, skip_reshape=True)
    assert not ran and len(comfy.calls) == 1
