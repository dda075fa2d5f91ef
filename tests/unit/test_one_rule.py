"""One rule for "may this family run this call" (issue 45 item 6): ``PlanChoice.usable`` decides for a
planned call, a moved block, a measured candidate and a plan run during CUDA-graph capture, and its
reason (``why_unusable``) is what the logs say. CPU."""
import logging

import pytest
import torch

from safe_ops.attention.override import SafeAttention
from safe_ops.attention.verification import Verdict
from safe_ops.families.family import Kernel
from safe_ops.policy import Policy
from safe_ops.ui import run_stats

from test_attention import CPU_RT, ComfyFunc, EnvelopeAssertingKernel, h3_like, toy_envelope
from test_attention_capture import as_cuda_calls, capture  # noqa: F401 - a fixture


def _att():
    env = toy_envelope()
    kern = EnvelopeAssertingKernel(env)
    return SafeAttention(Policy(kernel="sage", verify="first"), kernels=[Kernel(env, kern, 0.05)], rt=CPU_RT), kern


@pytest.mark.parametrize("why", ["switched off", "failed check"])
def test_capture_runs_no_family_the_one_rule_refuses(capture, caplog, why):
    """A plan verified eagerly; then its family is switched off (another node's call found a build that
    cannot run here: the kill switch is process-wide) or the verdict store holds a failed check for its
    class of call. During capture that plan is not
    run: ComfyUI's function is (the rule of every other call, PlanChoice.usable). The capture message
    says that the quality guard's moves do not apply there."""
    a, kern = _att()
    comfy = ComfyFunc()
    q, k, v = h3_like(100)
    a(comfy, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)        # planned, verified
    assert len(kern.launches) == 1 and not comfy.calls
    if why == "switched off":
        run_stats.disabled("toy_sage", "no kernel image for this GPU", a._sites["toy_sage"])
    else:
        (p,) = a.prepared_plans()
        a.verifier.record(a._class_key("toy_sage", p.call), Verdict(False, 0.5, 0.05, "rel. L2 0.5 > 0.05"))
    as_cuda_calls(a)
    capture["on"] = True
    with caplog.at_level(logging.INFO, logger="SafeSage"):
        a(comfy, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    assert len(kern.launches) == 1 and len(comfy.calls) == 1
    assert run_stats.value("captured_calls") == 1 and run_stats.value("captured_guarded") == 0
    said = [r.getMessage() for r in caplog.records if "CUDA-graph capture" in r.getMessage()]
    assert len(said) == 1 and "blocks it moved" in said[0] and "run their planned kernel" in said[0], said


def test_a_moved_blocks_fallback_names_the_one_rules_reason(fresh, caplog, monkeypatch):
    """The moved-to family failed its first-call check on the block's class of call: the warning for the
    other moved block gives that reason (PlanChoice.why_unusable), not a second reading of it."""
    from test_quality_guard import OUTLIERS, blocks, end_run, forward, make, schedule
    fq, data = fresh, blocks()
    att = make(quality="balanced")
    sched = schedule(3)
    forward(att, data, sched, 1)
    monkeypatch.setattr(fq, "KITCHEN_ERROR", 0.9)            # over fake_kitchen's tolerance from now on
    with caplog.at_level(logging.WARNING, logger="SafeSage"):
        forward(att, data, sched, 2)
    end_run()
    said = [r.getMessage() for r in caplog.records if "cannot run the calls" in r.getMessage()]
    assert len(said) == 1 and "fake_kitchen cannot run" in said[0], said
    assert "failed its check on this class of call" in said[0] and "they run ComfyUI's own attention" in said[0]
    assert run_stats.value("probe_failures") == 1 and len(OUTLIERS) == 2
