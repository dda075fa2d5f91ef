"""The fused key-chunk merge (safe_ops/attention/lse_merge.py, Triton) on CUDA against the torch
reference merge, on the caller's stream, under capture, and inside a kv_chunks call with a real
sage 2.2 kernel.

Skipped without CUDA + sageattention (conftest) and without triton (reason printed). Run on the GPU
machine:  python -m pytest tests/gpu/test_gpu_lse_merge.py -v -rs
"""
from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from safe_ops.attention import lse_merge as L
from safe_ops.ui import run_stats

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _fresh():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed: the fused merge cannot run here (the torch merge is used)")
    run_stats.reset()
    L.set_fused(True)
    yield
    L.set_fused(True)


def chunk_outputs(n, B, H, S, D, dtype, kind, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if kind == "nhd":
        os_ = [torch.randn(B, S, H, D, device="cuda", generator=g).to(dtype).transpose(1, 2) for _ in range(n)]
    else:
        os_ = [torch.randn(B, H, S, D, device="cuda", generator=g).to(dtype) for _ in range(n)]
    ls = [torch.randn(B, H, S, device="cuda", generator=g) * 4 for _ in range(n)]
    if n >= 2:
        ls[0][0, 0, :3] = float("-inf")
        ls[1][0, 0, :2] = float("-inf")            # -inf in every chunk for rows 0-1 (NaN in both merges)
        ls[-1][0, -1, :4] += 1e4
        ls[0][-1, 0, :4] -= 1e4
    return os_, ls


def reference(os_, ls):
    acc = run = None
    for o, lse in zip(os_, ls):
        acc, run = L.lse_merge(acc, run, o.clone(), lse.clone())
    return acc


def check(out, ref):
    eps = torch.finfo(out.dtype).eps if out.dtype != torch.float32 else 0.0
    out, ref = out.float(), ref.float()
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(out), nan)
    o, r = out[~nan], ref[~nan]
    tol = 1e-5 * r.abs().max().clamp_min(1.0) + eps * r.abs()
    assert ((o - r).abs() <= tol).all(), float((o - r).abs().max())


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,kind", [((1, 56, 3000, 128), "nhd"), ((2, 8, 777, 64), "hnd"), ((1, 3, 50, 40), "nhd")])
def test_fused_matches_the_torch_merge(n, dtype, shape, kind):
    B, H, S, D = shape
    os_, ls = chunk_outputs(n, B, H, S, D, dtype, kind, seed=n)
    ref = reference(os_, ls)
    for out_dtype in (dtype, torch.float32):
        dst = torch.empty(B, H, S, D, dtype=out_dtype, device="cuda")
        m = L.KeyChunkMerge(dst, n)
        for o, lse in zip(os_, ls):
            m.add(o.clone(), lse.clone())
        assert m.fused is not None, "the fused merge was not chosen on CUDA"
        torch.cuda.synchronize()
        check(dst, ref)
    assert run_stats.value("kv_merge_fused") == 2 and run_stats.value("kv_merge_fused_failed") == 0


def test_fused_launches_on_the_current_stream():
    """Inputs written on a side stream after a delay: a launch on any other stream would read them
    before they are written."""
    B, H, S, D, n = 1, 56, 4000, 128, 3
    os_, ls = chunk_outputs(n, B, H, S, D, torch.bfloat16, "nhd", seed=7)
    ref = reference(os_, ls)
    side = torch.cuda.Stream()
    dst = torch.zeros(B, H, S, D, dtype=torch.bfloat16, device="cuda")
    bufs = [torch.zeros_like(o) for o in os_]
    lbufs = [torch.zeros_like(x) for x in ls]
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)                 # ~0.1 s at ~2 GHz
        for b, o, lb, x in zip(bufs, os_, lbufs, ls):
            b.copy_(o)
            lb.copy_(x)
        m = L.KeyChunkMerge(dst, n)
        for b, lb in zip(bufs, lbufs):
            m.add(b, lb)
    torch.cuda.synchronize()
    assert m.fused is not None
    check(dst, ref)


def test_under_capture_the_torch_merge_is_captured_and_replays():
    B, H, S, D, n = 1, 4, 256, 64, 3
    os_, ls = chunk_outputs(n, B, H, S, D, torch.bfloat16, "hnd", seed=9)
    ref = reference(os_, ls)
    dst = torch.empty(B, H, S, D, dtype=torch.bfloat16, device="cuda")
    ins = [o.clone() for o in os_]
    lins = [x.clone() for x in ls]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):                         # warm-up, as torch.cuda.graph expects
        m = L.KeyChunkMerge(dst, n)
        for o, lse in zip(ins, lins):
            m.add(o.clone(), lse)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        m = L.KeyChunkMerge(dst, n)
        for o, lse in zip(ins, lins):
            m.add(o.clone(), lse)
        chosen = m.fused
    dst.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert chosen is None                                    # capture: the torch merge
    check(dst, ref)


def test_kv_chunks_with_a_real_kernel_fused_equals_the_old_merge():
    """A 6,000-key rule at 12,000 tokens: the pack's kv_chunks call with the fused merge and with
    the torch merge (set_fused(False)) give the same output to float32 rounding + one bf16 rounding."""
    from safe_ops.attention import planner
    from safe_ops.attention.override import SafeAttention
    from safe_ops.facts.devices import runtime
    from safe_ops.families.family import Kernel
    from safe_ops.families.registry import kernel_of
    from safe_ops.families.rules import KvLenRule
    from safe_ops.policy import Policy
    kern = kernel_of("sage2_fp8pv_perwarp")
    if kern is None or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("sage2_fp8pv_perwarp not available here")
    env = dataclasses.replace(kern.envelope, extra_rules=kern.envelope.extra_rules
                              + (KvLenRule(kern.family, 6_000, "test", "test"),))
    old = planner.MIN_KV_CHUNK
    planner.MIN_KV_CHUNK = 1024
    try:
        S, HEADS, D = 12_000, 56, 128
        g = torch.Generator(device="cuda").manual_seed(0)
        qkv = torch.randn(S, 3 * HEADS * D, device="cuda", dtype=torch.bfloat16, generator=g)
        q, k, v = [t.view(S, HEADS, D).transpose(0, 1).unsqueeze(0) for t in qkv.split(HEADS * D, -1)]
        att = SafeAttention(Policy(kernel="sage", verify="off"), kernels=[Kernel(env, kern.fn, kern.tolerance, kern.fn_lse)],
                            rt=runtime())

        def comfy(*a, **kw):
            raise AssertionError("the guarded kernel must run this call")

        def call():
            return att(comfy, q, k, v, HEADS, skip_reshape=True, skip_output_reshape=True)
        fused = call()
        assert run_stats.value("plan:kv_chunks") == 1 and run_stats.value("kv_merge_fused") >= 1
        L.set_fused(False)
        old_merge = call()
        assert run_stats.value("kv_merge_torch") >= 1
        torch.cuda.synchronize()
        d = (fused.float() - old_merge.float()).abs()
        assert float(d.max()) <= 2 ** -7 * float(old_merge.float().abs().max()), float(d.max())
        assert float(d.mean()) < 1e-4
    finally:
        planner.MIN_KV_CHUNK = old
