"""Only a kernel build that cannot run here switches a family off for the process; an error that
refuses one call (a NotImplementedError for one shape) sends that call to ComfyUI's own attention
and leaves the family on (attention.errors.is_build_error)."""
import pytest
import torch

from safe_ops.ui import run_stats
from safe_ops.attention.override import SafeAttention
from safe_ops.attention.errors import is_build_error
from safe_ops.families.family import Kernel
from safe_ops.policy import Policy

from test_attention import CPU_RT, ComfyFunc, EnvelopeAssertingKernel, h3_like, reference, toy_envelope


@pytest.fixture(autouse=True)
def _fresh():
    run_stats.reset()
    yield
    run_stats.reset()


def test_a_not_implemented_error_for_one_shape_falls_back_for_that_call_only():
    env = toy_envelope()
    real = EnvelopeAssertingKernel(env)
    refused = []

    def picky(q, k, v, layout, scale):
        if q.shape[2] == 100:              # this kernel has no variant for this one length
            refused.append(q.shape)
            raise NotImplementedError("no kernel variant for seq_len 100 with this head_dim")
        return real(q, k, v, layout, scale)

    comfy = ComfyFunc()
    att = SafeAttention(Policy(kernel="sage", verify="off"), kernels=[Kernel(env, picky, 0.05)], rt=CPU_RT)
    q, k, v = h3_like(100)
    out = att(comfy, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    torch.testing.assert_close(out.double(), reference(q, k, v), rtol=1e-5, atol=1e-5)
    assert len(refused) == 1 and len(comfy.calls) == 1, "the refused call ran ComfyUI's own attention"
    assert run_stats.value("call_fallbacks") == 1 and run_stats.value("kernel_errors") == 0
    assert not att.broken and not run_stats.snapshot()["disabled_families"], "the family stays on"
    # the next call, another shape: the family runs it
    q2, k2, v2 = h3_like(60)
    out2 = att(comfy, q2, k2, v2, 4, skip_reshape=True, skip_output_reshape=True)
    torch.testing.assert_close(out2.double(), reference(q2, k2, v2), rtol=1e-5, atol=1e-5)
    assert len(real.launches) == 1 and len(comfy.calls) == 1
    # and the refused shape again: refused again (one call at a time), still not disabled
    att(comfy, q, k, v, 4, skip_reshape=True)
    assert len(refused) == 2 and not att.broken


@pytest.mark.parametrize("err,build", [
    (NotImplementedError("head_dim 96 not supported for this call"), False),
    (ValueError("seq_len must be a multiple of 64 here"), False),
    (ModuleNotFoundError("No module named 'sageattention._qattn_sm90'"), True),
    (ImportError("libcudart.so.12: undefined symbol: cudaGetDriverEntryPointByVersion"), True),
    (AssertionError("SM90 kernel is not available. Make sure you GPUs with compute capability 9.0."), True),
    (RuntimeError("CUDA error: no kernel image is available for execution on the device"), True),
])
def test_is_build_error_only_for_a_build_that_cannot_run_here(err, build):
    assert is_build_error(err) is build
