"""Two sections of bench/kernels/gpu_attention.py: the guard's host overhead (``host``) and the first-call check's
cost and catch (``probe``).

Each takes ``g``, the gpu_attention module that runs the bench (``python -m bench.kernels.gpu_attention``): its
helpers read the run's --family / --dtype settings, which live in that module.
"""
from __future__ import annotations

import json
import time

import torch


def host_overhead(g, S: int, n: int = 400) -> dict:
    """Host microseconds per call, launches only (no sync per call).

    ``S`` is small so the GPU keeps up and the host is the bottleneck. Two
    numbers: the whole g.guarded call vs raw sageattn vs SDPA, and the guard's
    own Python work alone (the same override around a kernel that returns a
    preallocated tensor, minus calling that kernel directly).
    """
    from safe_ops.ui import run_stats
    from safe_ops.families.family import Kernel
    from safe_ops.attention.override import SafeAttention
    from safe_ops.families.sage1 import SAGE1_TRITON
    from safe_ops.policy import Policy
    q, k, v = g.h3_qkv(S, "strided")
    run_stats.reset()
    att = g.guarded()
    pre = torch.empty_like(q, memory_format=torch.contiguous_format)
    null_fn = lambda q_, k_, v_, layout, scale: pre  # noqa: E731
    null = SafeAttention(Policy(kernel="sage", verify="off"), kernels=[Kernel(SAGE1_TRITON, null_fn)])
    fns = {"guarded": lambda: att(g.noop, q, k, v, g.HEADS, skip_reshape=True, skip_output_reshape=True),
           "raw_sage": lambda: g.raw_sage(q, k, v),
           "sdpa": lambda: g.sdpa(q, k, v),
           "guard_null_kernel": lambda: null(g.noop, q, k, v, g.HEADS, skip_reshape=True, skip_output_reshape=True),
           "null_kernel": lambda: null_fn(q, k, v, "HND", None)}
    res = {"S": S, "calls": n}
    for name, fn in fns.items():
        best = float("inf")
        for _ in range(3):
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            best = min(best, (t1 - t0) / n * 1e6)
        res[f"{name}_host_us"] = best
    res["guard_overhead_us"] = res["guard_null_kernel_host_us"] - res["null_kernel_host_us"]
    res["guarded_minus_raw_us"] = res["guarded_host_us"] - res["raw_sage_host_us"]
    return res


# -------------------------------------------------------------------------- probe
def probe(g, args) -> dict:
    from safe_ops.ui import run_stats
    from safe_ops.families.family import Kernel
    from safe_ops.attention.override import SafeAttention
    from safe_ops.policy import Policy
    out = {"env": g.env_info(), "sizes": []}
    rt = g.bench_runtime()
    real = g.sage_kern()
    for S in [int(s) for s in args.sizes.split(",")]:
        torch.cuda.empty_cache()
        q, k, v = g.h3_qkv(S, "strided")
        row = {"S": S}
        # real sage: probe verdict and overhead of the first (probed) call vs the second
        run_stats.reset()
        att = SafeAttention(Policy(kernel="sage", verify="first"), kernels=[real], rt=rt)
        call = lambda: att(g.noop, q, k, v, g.HEADS, skip_reshape=True, skip_output_reshape=True)  # noqa: E731
        att_np = SafeAttention(Policy(kernel="sage", verify="off"), kernels=[real], rt=rt)
        call_np = lambda: att_np(g.noop, q, k, v, g.HEADS, skip_reshape=True, skip_output_reshape=True)  # noqa: E731
        call_np()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()                    # first call: runs the kernel + probe
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        call_np()                 # same call without probe
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        from safe_ops.attention.verification import compare
        o = call_np()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        compare(o, q, k, v, None, real.tolerance)
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        del o
        row.update(real_verdicts=att.verifier.verdicts(), first_call_s=t1 - t0, plain_call_s=t2 - t1,
                   probe_only_s=t4 - t3, probe_only_pct=100 * (t4 - t3) / (t2 - t1),
                   probe_overhead_pct=100 * ((t1 - t0) - (t2 - t1)) / (t2 - t1),
                   probe_failures=int(run_stats.value("probe_failures")))
        # a deliberately broken kernel: corrupts rows past 60% of the sequence
        def broken(q_, k_, v_, layout, scale, _fn=real.fn):
            o = _fn(q_, k_, v_, layout, scale)
            s_ax = 2 if layout == "HND" else 1
            o.narrow(s_ax, int(o.shape[s_ax] * 0.6), o.shape[s_ax] - int(o.shape[s_ax] * 0.6)).mul_(-3.0)
            return o
        run_stats.reset()
        bad = Kernel(real.envelope, broken, real.tolerance)
        att_b = SafeAttention(Policy(kernel="sage", verify="first"), kernels=[bad], rt=rt)
        ob = att_b(g.noop, q, k, v, g.HEADS, skip_reshape=True, skip_output_reshape=True)
        ref = g.sdpa(q, k, v)
        row.update(broken_caught=int(run_stats.value("probe_failures")) == 1,
                   broken_output_rel_err_vs_sdpa=g.rel_l2(ob, ref),
                   broken_verdicts=att_b.verifier.verdicts())
        out["sizes"].append(row)
        print(json.dumps(row), flush=True)
        del q, k, v, ob, ref
    return out
