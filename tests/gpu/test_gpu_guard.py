"""Real sageattention on MiniMax H3's strided views (H200). Skipped without CUDA + sage.

Run on the GPU machine: python -m pytest tests/gpu -v -rs
"""
import os
import sys

import pytest
import torch

from safe_ops import report
from safe_ops.policy import Policy

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")
sys.path.insert(0, BENCH)
import gpu_attention as ga  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _fresh():
    report.reset()
    torch.cuda.empty_cache()
    yield


@pytest.mark.parametrize("stream", ["default", "side"])
def test_guarded_strided_past_int32_boundary(stream):
    S = 99_866
    q, k, v = ga.h3_qkv(S, "strided")
    ref = ga.sdpa(q, k, v)
    inlimit = ga.rel_l2(ga.raw_sage(q.contiguous(), k.contiguous(), v.contiguous()), ref)
    att = ga.guarded()
    st = torch.cuda.Stream() if stream == "side" else torch.cuda.current_stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        o = att(ga._noop, q, k, v, 56, skip_reshape=True, skip_output_reshape=True)
    torch.cuda.current_stream().wait_stream(st)
    torch.cuda.synchronize()
    assert report.STATS["plan:repack"] == 1
    err = ga.rel_l2(o, ref)
    assert err <= inlimit * 1.05 + 1e-4, (err, inlimit)


def test_unguarded_call_faults_or_is_wrong_in_a_subprocess():
    r = ga.run_child(99_866, "strided")
    assert r["outcome"] in ("fault", "wrong"), r


def test_probe_catches_a_kernel_wrong_on_the_tail():
    from safe_ops.attention import Kernel, SafeAttention, sage_kernel
    from safe_ops.runtime import runtime
    real = sage_kernel(runtime())

    def broken(q, k, v, layout, scale):
        o = real.fn(q, k, v, layout, scale)
        o[:, :, o.shape[2] // 2:] = 0
        return o

    S = 38_000
    q, k, v = ga.h3_qkv(S, "strided")
    att = SafeAttention(Policy(kernel="sage", verify="first"), kernels=[Kernel(real.envelope, broken, real.tolerance)])
    o = att(ga._noop, q, k, v, 56, skip_reshape=True, skip_output_reshape=True)
    assert report.STATS["probe_failures"] == 1
    assert ga.rel_l2(o, ga.sdpa(q, k, v)) < 1e-3      # the fallback's (SDPA) output was returned


def test_real_sage_passes_probe():
    from safe_ops.attention import SafeAttention
    q, k, v = ga.h3_qkv(38_000, "strided")
    att = SafeAttention(Policy(kernel="sage", verify="first"))
    att(ga._noop, q, k, v, 56, skip_reshape=True)
    assert report.STATS["probes"] == 1 and report.STATS["probe_failures"] == 0
