"""Real sageattention on MiniMax H3's strided views (H200). Skipped without CUDA + sage.

Run on the GPU machine: python -m pytest tests/gpu -v -rs
(``SAFESAGE_BENCH_FAMILY=sage2_fp8pv_perwarp`` runs them on that sage 2.2 family: the
sm_120 dispatch; by default the family ``sageattn`` runs on this GPU.)
"""

import pytest
import torch

from safe_ops.ui import run_stats
from safe_ops.policy import Policy

from bench.kernels import gpu_attention as ga

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _family_runs_here():
    """Every test here runs the family's own function. A build that imports but refuses the
    call (an 8.9 build on the H200: sageattn's sm90 path asserts "SM90 kernel is not
    available") cannot test anything: skip with the reason instead of failing or, worse,
    passing on the refusal."""
    kern = ga.sage_kern()
    x = torch.randn(1, 56, 256, 128, device="cuda", dtype=torch.bfloat16)
    try:
        kern.fn(x, x, x, "HND", None)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"family {kern.family} raises at call time in this sageattention build "
                    f"({type(e).__name__}: {str(e)[:120]}); set SAFESAGE_BENCH_FAMILY to a family it "
                    "has, e.g. sage2_fp8pv_perwarp")


@pytest.fixture(autouse=True)
def _fresh():
    run_stats.reset()
    torch.cuda.empty_cache()
    yield


def first_unsafe_strided() -> int:
    """The first H3 length whose strided call leaves the family's envelope (index rules)."""
    from safe_ops.families.rules import first_unsafe
    from safe_ops.models.h3.dims import h3_attention_call
    env = ga.sage_kern().envelope
    return first_unsafe(env, lambda n: h3_attention_call(n, arch="sm_90"), 1024, 700_000, rules=("index",))


@pytest.mark.parametrize("stream", ["default", "side"])
def test_guarded_strided_past_int32_boundary(stream):
    S = first_unsafe_strided()
    q, k, v = ga.h3_qkv(S, "strided")
    ref = ga.sdpa(q, k, v)
    inlimit = ga.rel_l2(ga.raw_sage(q.contiguous(), k.contiguous(), v.contiguous()), ref)
    att = ga.guarded()
    st = torch.cuda.Stream() if stream == "side" else torch.cuda.current_stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        o = att(ga.noop, q, k, v, 56, skip_reshape=True, skip_output_reshape=True)
    torch.cuda.current_stream().wait_stream(st)
    torch.cuda.synchronize()
    assert run_stats.value("plan:direct") == 0 and run_stats.value("plan:sdpa") == 0
    err = ga.rel_l2(o, ref)
    assert err <= inlimit * 1.05 + 1e-4, (err, inlimit)


def test_unguarded_call_faults_or_is_wrong_in_a_subprocess():
    # 1,024 rows past the first unsafe length: a wrap that lands on mapped memory corrupts
    # those rows silently (tail_worst_row_rel_err), one that does not faults
    r = ga.run_child(first_unsafe_strided() + 1024, "strided")
    assert r["outcome"] in ("fault", "wrong"), r


def test_probe_catches_a_kernel_wrong_on_the_tail():
    from safe_ops.families.family import Kernel
    from safe_ops.attention.override import SafeAttention
    real = ga.sage_kern()

    def broken(q, k, v, layout, scale):
        o = real.fn(q, k, v, layout, scale)
        o[:, :, o.shape[2] // 2:] = 0
        return o

    S = 38_000
    q, k, v = ga.h3_qkv(S, "strided")
    att = SafeAttention(Policy(kernel="sage", verify="first"), kernels=[Kernel(real.envelope, broken, real.tolerance)])
    o = att(ga.noop, q, k, v, 56, skip_reshape=True, skip_output_reshape=True)
    assert run_stats.value("probe_failures") == 1
    assert ga.rel_l2(o, ga.sdpa(q, k, v)) < 1e-3      # the fallback's (SDPA) output was returned


def test_real_sage_passes_probe():
    q, k, v = ga.h3_qkv(38_000, "strided")
    att = ga.guarded(Policy(kernel="sage", verify="first"))
    att(ga.noop, q, k, v, 56, skip_reshape=True)
    assert run_stats.value("probes") == 1 and run_stats.value("probe_failures") == 0


def _legacy_stream_kernel():
    k = ga.sage_kern()
    if not k.envelope.launches_on_legacy_stream:
        pytest.skip(f"family {k.family} launches on the current stream: no stream hop to test "
                    "(run with SAFESAGE_BENCH_FAMILY=sage2_fp8pv_perwarp and sage 2.2.0)")
    return k


def test_legacy_stream_kernel_under_a_side_stream_is_correct_and_memory_returns():
    """sage 2.x CUDA kernels run on the legacy stream: the guarded call hops there from a side
    stream, past the kernel's index limit (a repacked plan), and leaves no memory behind: no
    fence, every copy made on the stream that reads it."""
    import gc
    _legacy_stream_kernel()
    S = first_unsafe_strided()
    q, k, v = ga.h3_qkv(S, "strided")
    ref = ga.sdpa(q, k, v)
    # earlier tests' tracebacks must go first, or they leave during this call and memory ends
    # *below* the baseline
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    att = ga.guarded()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        o = att(ga.noop, q, k, v, 56, skip_reshape=True, skip_output_reshape=True)
        o2 = o * 1.0               # consumed on the side stream right away
    torch.cuda.current_stream().wait_stream(side)
    assert run_stats.value("stream_hops") == 1
    err = ga.rel_l2(o2, ref)
    assert err <= att.kernels[ga.sage_kern().family].tolerance, err
    del o, o2
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == base


def test_kernel_raising_at_call_time_falls_back_to_sdpa_on_gpu():
    from safe_ops.families.family import Kernel
    from safe_ops.attention.override import SafeAttention
    real = ga.sage_kern()

    def missing_extension(*a, **k):
        # what sage 2.2.0 raises when its sm90 extension was not built (core.py's assert SM90_ENABLED)
        raise AssertionError("SM90 kernel is not available. Make sure you GPUs with compute capability 9.0.")

    q, k, v = ga.h3_qkv(38_000, "strided")
    att = SafeAttention(Policy(kernel="sage"), kernels=[Kernel(real.envelope, missing_extension, real.tolerance)])
    o = att(ga.noop, q, k, v, 56, skip_reshape=True, skip_output_reshape=True)
    assert run_stats.value("kernel_errors") == 1
    assert ga.rel_l2(o, ga.sdpa(q, k, v)) < 1e-3


def test_probe_catches_nan_in_a_tail_row_of_the_second_batch_element():
    from safe_ops.families.family import Kernel
    from safe_ops.attention.override import SafeAttention
    real = ga.sage_kern()

    def nan_tail(q, k, v, layout, scale):
        o = real.fn(q, k, v, layout, scale)
        (o[1, 18, -1] if layout == "HND" else o[1, -1, 18]).fill_(float("nan"))
        return o

    q, k, v = ga.h3_qkv(20_000, "strided_b2")
    att = SafeAttention(Policy(kernel="sage", verify="first"), kernels=[Kernel(real.envelope, nan_tail, real.tolerance)])
    o = att(ga.noop, q, k, v, 56, skip_reshape=True, skip_output_reshape=True)
    assert run_stats.value("probe_failures") == 1 and torch.isfinite(o).all()
