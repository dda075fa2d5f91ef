"""The fused key-chunk merge's Triton kernel on the CPU, run by test_lse_merge.py in a child process
(triton on the path; this script sets TRITON_INTERPRET=1 itself, after checking that the pack loads
and merges on the CPU without importing triton).

    python tests/unit/lse_merge_interp.py          # from the repository root

Checks, each an assertion (a failure exits non-zero with its traceback):
1. importing safe_ops' attention code and a CPU merge without the interpreter leave the pack's Triton
   module (lse_merge_triton.py, the one that imports triton) unimported;
2. with the kernel built for the interpreter, the fused merge (KeyChunkMerge's own choice: the dispatch)
   equals the torch reference merge to float32 rounding (then one rounding to the result's dtype) on
   random chunks: several shapes, NHD/HND/padded-D strides, a strided result slice, 1-4 chunks,
   bf16/fp16/fp32, and LSE edge cases (-inf in one or every chunk, +-1e4 offsets, equal LSEs);
3. test_attention.py's kv_chunks tests pass with the fused merge doing the merges (launches counted);
4. the kernel compiles (not interpreted) for sm_90 and sm_120 with the specialization a real launch
   gets (skipped, with the reason in the summary, when triton's internals for that differ).
The last line printed is a JSON summary.
"""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

summary: dict = {}


def pack_loads_without_triton() -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    import safe_ops.attention.override  # noqa: F401  (executor, lse_merge and everything they import)
    from safe_ops.attention.lse_merge import KeyChunkMerge
    o = torch.randn(1, 2, 8, 16)
    dst = torch.empty_like(o)
    m = KeyChunkMerge(dst, 2)
    m.add(o, torch.zeros(1, 2, 8))
    m.add(o, torch.zeros(1, 2, 8))
    torch.testing.assert_close(dst, o)
    assert m.fused is None, "the torch merge on the CPU without the interpreter"
    # torch itself imports triton where it is installed (torch._dynamo, which opaque_op.py's
    # custom op loads); the pack's own Triton module is what must wait for a block that can use it
    assert "safe_ops.attention.lse_merge_triton" not in sys.modules, "the pack imported its Triton merge at load"
    summary["fused_module_imported_at_load"] = False
    summary["triton_imported_by_torch_at_load"] = "triton" in sys.modules


def reference(os_, ls):
    from safe_ops.attention.lse_merge import lse_merge
    acc = run = None
    for o, lse in zip(os_, ls):
        acc, run = lse_merge(acc, run, o.clone(), lse.clone())   # (lse_merge updates fp32 chunks in place)
    return acc


def chunk_output(kind, B, H, S, D, dtype, g):
    if kind == "nhd":                                   # a transposed NHD launch output
        return torch.randn(B, S, H, D, generator=g).to(dtype).transpose(1, 2)
    if kind == "pad":                                   # a padded head dim sliced back (sage pads D)
        return torch.randn(B, H, S, D + 8, generator=g).to(dtype)[..., :D]
    return torch.randn(B, H, S, D, generator=g).to(dtype)


def lses(n, B, H, S, g, edge):
    ls = [torch.randn(B, H, S, generator=g) * 4 for _ in range(n)]
    if edge and n >= 2:
        ls[0][0, 0, :3] = float("-inf")
        ls[1][0, 0, :2] = float("-inf")             # rows 0-1: -inf in the first two chunks
        ls[-1][0, -1, :4] += 1e4                    # one chunk dominates
        ls[0][-1, 0, :4] -= 1e4                     # one chunk vanishes
        for t in ls:
            t[-1, -1, :3] = 2.5                     # equal LSEs
    elif edge:
        ls[0][0, 0, :3] = float("-inf")
    return ls


def compare(out, ref, tag) -> None:
    eps = torch.finfo(out.dtype).eps if out.dtype != torch.float32 else 0.0
    out, ref = out.float(), ref.float()
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(out), nan), f"{tag}: NaN rows differ"
    o, r = out[~nan], ref[~nan]
    # float32 rounding (a few ulps of the largest value) + one rounding to the result's dtype
    tol = 1e-5 * r.abs().max().clamp_min(1.0) + eps * r.abs()
    bad = (o - r).abs() > tol
    assert not bad.any(), f"{tag}: max |diff| {(o - r).abs().max().item():.3g}"


def fused_matches_reference() -> None:
    from safe_ops.attention import lse_merge as L
    from safe_ops.ui import run_stats
    run_stats.reset()
    g = torch.Generator().manual_seed(0)
    cases = 0
    for (B, H, S, D, kind) in ((1, 3, 37, 40, "nhd"), (2, 2, 16, 64, "hnd"), (1, 4, 5, 128, "pad"),
                               (2, 3, 9, 16, "nhd")):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for n in (1, 2, 3, 4):
                for edge in (False, True):
                    os_ = [chunk_output(kind, B, H, S, D, dtype, g) for _ in range(n)]
                    ls = lses(n, B, H, S, g, edge)
                    ref = reference(os_, ls)
                    for out_dtype in {dtype, torch.float32}:
                        big = torch.full((B, H + 2, S + 3, D), 7.0, dtype=out_dtype)
                        dst = big[:, 1:H + 1, 2:S + 2]        # a strided slice of a larger result
                        m = L.KeyChunkMerge(dst, n)
                        for o, lse in zip(os_, ls):
                            m.add(o.clone(), lse.clone())
                        assert m.fused is not None, "the fused merge was not chosen under the interpreter"
                        tag = f"B{B} H{H} S{S} D{D} {kind} {dtype}->{out_dtype} n={n} edge={edge}"
                        compare(dst, ref, tag)
                        assert (big[:, 0] == 7).all() and (big[:, :, :2] == 7).all() and (big[:, :, -1] == 7).all(), \
                            f"{tag}: wrote outside the result slice"
                        cases += 1
    assert run_stats.value("kv_merge_fused") == cases and run_stats.value("kv_merge_torch") == 0
    summary["fused_cases"] = cases


def kv_chunks_tests_with_fused_merge() -> None:
    import pytest
    from safe_ops.attention import lse_merge_triton as T
    launches = []
    orig = T.merge

    def counting(*a, **k):
        launches.append(1)
        return orig(*a, **k)
    T.merge = counting
    try:
        rc = pytest.main(["-q", "-p", "no:cacheprovider", os.path.join(ROOT, "tests", "unit", "test_attention.py"),
                          "-k", "kv_chunks or lse"])
    finally:
        T.merge = orig
    assert rc == 0, f"test_attention.py kv_chunks tests under the fused merge: pytest exit {rc}"
    assert launches, "no fused merge launch in test_attention.py's kv_chunks tests"
    summary["kv_chunks_test_fused_launches"] = len(launches)


def compiles_for_gpus() -> None:
    import triton
    from safe_ops.attention import lse_merge_triton as T
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, make_backend
        from triton.runtime.jit import create_function_from_signature
    except ImportError as e:
        summary["compile"] = f"skipped: this triton ({triton.__version__}) lacks {e}"
        return
    B, H, S, D = 1, 56, 1000, 128
    o1 = torch.randn(B, S, H, D).bfloat16().transpose(1, 2)
    o2 = torch.randn(B, S, H, D).bfloat16().transpose(1, 2)
    acc = torch.randn(B, S, H, D).transpose(1, 2)
    l1, l2 = torch.randn(B, H, S), torch.randn(B, H, S)
    dst = torch.empty(B, H, S, D, dtype=torch.bfloat16)
    done = []
    old = os.environ.pop("TRITON_INTERPRET")
    try:
        fn = triton.jit(getattr(T.merge_kernel, "fn", T.merge_kernel))   # compiled, not interpreted
        for cc in (90, 120):
            tgt = GPUTarget("cuda", cc, 32)
            backend = make_backend(tgt)
            binder = create_function_from_signature(fn.signature, fn.params, backend)
            for a, la, b, lb, out, lo in ((o1, l1, o2, l2, dst, None), (acc, l1, o2, l2, acc, l1)):
                _, args, kw = T.launch_args(a, la, b, lb, out, lo)
                kw = dict(kw, debug=False)
                bound, spec, opts = binder(*args, **kw)
                opts, sig, cx, attrs = fn._pack_args(backend, kw, bound, spec, opts)
                k = triton.compile(ASTSource(fn, sig, cx, attrs), target=tgt, options=opts.__dict__)
                assert k.asm.get("cubin"), f"sm_{cc}: no cubin"
                done.append(f"sm_{cc} {sig['a_ptr']}->{sig['o_ptr']}")
    finally:
        os.environ["TRITON_INTERPRET"] = old
    summary["compiled"] = done


def main() -> None:
    pack_loads_without_triton()
    os.environ["TRITON_INTERPRET"] = "1"            # before the first import of lse_merge_triton
    from safe_ops.attention import lse_merge
    assert lse_merge.fused_module().INTERPRETED
    fused_matches_reference()
    assert "safe_ops.attention.lse_merge_triton" in sys.modules
    kv_chunks_tests_with_fused_merge()
    compiles_for_gpus()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
