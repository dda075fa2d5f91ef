"""SafeSage demo: python3 -m safe_ops.demo  (from the repository root; needs only torch)

1. What is here (GPU, sageattention and the kernel family it would run).
2. The plan SafeSage chooses for the reporter's graph (MiniMax H3 ref2va,
   1664x960, 362 frames, 3 reference images) on every known kernel family,
   each labelled with the GPUs and sageattention / comfy-kitchen versions that
   run it, in the words of the Preflight node's report.
3. Guarded attention on H3-shaped strided q/k/v views, checked against a
   float64/float32 reference: on a CUDA GPU with sageattention, the real kernel
   just past its int32 limit; on the CPU (or without sage), a stand-in kernel
   with sage 1.0.6's index arithmetic whose offsets are held to int16 instead
   of int32 (the index width, not the precision: it computes in float32), so
   the same repack and head-group plans run at a CPU-sized shape and refuse any
   launch outside the envelope.
4. The token-chunked H3 SwiGLU MLP against the unchunked one.

No model download, no ComfyUI. Exit status 0 when every check passed. It needs
a Python with torch (ComfyUI's own); on a machine without one, run
``python3 tools/demo.py`` from a git checkout: it prepares a private venv with
torch first (tools/ is not part of the registry archive).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import warnings

NO_TORCH = (
    "SafeSage demo: this Python has no torch. Run it with ComfyUI's own Python, which ships torch:\n"
    "    <ComfyUI python> -m safe_ops.demo\n"
    "or, from a git checkout of the pack on a machine without torch:\n"
    "    python3 tools/demo.py\n"
    "which prepares a private venv with torch under ~/.cache/safesage/demo-venv (one time, your own "
    "environments are not touched) and runs the demo there."
)

try:
    with warnings.catch_warnings():
        # a torch without NumPy (the demo's own venv: it needs none) warns at import; nothing here uses it
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
        import torch
except ImportError:  # pragma: no cover - a fresh machine without torch
    if __name__ == "__main__":
        sys.exit(NO_TORCH)
    raise

from .ui import run_stats
from .attention.override import SafeAttention
from .families.family import Kernel
from .families.registry import family_users, sage_kernel
from .families.envelope import AttnCall, TensorDesc, check
from .families.sage1 import SAGE1_TRITON
from .models.h3.mlp_reference import chunked_swiglu, reference_swiglu
from .policy import Policy
from .models.h3.dims import H3_FFN, H3_HEAD_DIM, H3_HEADS, H3_HIDDEN, h3_tokens
from .ui.preflight import preflight
from .facts.devices import runtime


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _h3_views(S: int, heads: int, d: int, device, dtype, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(S, 3 * heads * d, device=device, dtype=dtype, generator=g)
    return [t.view(S, heads, d).transpose(0, 1).unsqueeze(0) for t in qkv.split(heads * d, -1)]


def _stand_in(env):
    """sage 1.0.6's index arithmetic with int16 offset limits (computes in the inputs' dtype); asserts
    every launch is inside that envelope."""
    def fn(q, k, v, layout, scale):
        hnd = (lambda t: t.transpose(1, 2)) if layout == "NHD" else (lambda t: t)
        qh, kh, vh = hnd(q), hnd(k), hnd(v)
        desc = lambda t: TensorDesc(tuple(t.shape), tuple(t.stride()))  # noqa: E731
        call = AttnCall(desc(qh), desc(kh), desc(vh), str(q.dtype)[6:], layout, False, q.device.type)
        viol = check(call, env)
        assert not viol, f"stand-in kernel launched outside its envelope: {viol[0]}"
        o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, scale=scale)
        return o if layout == "HND" else o.transpose(1, 2)
    return fn


def section(title: str) -> None:
    print(f"\n== {title} ==")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m safe_ops.demo", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--tokens", type=int, default=0, help="attention sequence length to run (default: by device)")
    a = ap.parse_args(argv)
    dev = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else
                       (a.device if a.device != "auto" else "cpu"))
    ok = True

    section("runtime")
    rt = runtime()
    print(rt.summary())

    section("the reporter's graph: MiniMax H3 ref2va 1664x960x362, 3 reference images")
    t = h3_tokens(1664, 960, 362, ref_images=3)
    print(f"packed tokens: {t.total:,} (video {t.video:,}, audio {t.audio:,}, refs {t.refs:,}, "
          f"text ~{t.text}); attention q/k/v: [1, {H3_HEADS}, S, {H3_HEAD_DIM}] views, token stride "
          f"{3 * H3_HEADS * H3_HEAD_DIM:,}")
    for row in preflight(t.total, budget_bytes=8 << 30):
        v = row["violations"]
        print(f"- {row['family']}: " + (f"{len(v)} violation(s), e.g. {v[0]}" if v else "inside its envelope"))
        print(f"    used by: {family_users(row['family']) or 'no GPU or package version SafeSage knows'}")
        print(f"    -> {row['plan']}")
    if rt.sage_family:
        print(f"this machine runs {rt.sage_family}")

    section("guarded attention on H3-shaped strided views")
    run_stats.reset()
    real = sage_kernel(rt) if dev.type == "cuda" else None
    if real is not None:
        S = a.tokens or 100_500
        heads, d, dtype = H3_HEADS, H3_HEAD_DIM, torch.bfloat16
        kernel, label = real, f"real {rt.sage_family}"
    else:
        S = a.tokens or 1_400
        heads, d, dtype = 4, 16, torch.float32
        env = dataclasses.replace(
            SAGE1_TRITON, family="stand_in_sage1_int16", devices=(dev.type,), head_dims=(16,),
            terms=tuple(dataclasses.replace(x, itype="i16" if x.itype == "i32" else x.itype)
                        for x in SAGE1_TRITON.terms))
        kernel, label = Kernel(env, _stand_in(env), 0.01), "stand-in kernel (sage 1.0.6's index arithmetic, offsets limited to int16 to fit a CPU-sized call)"
    q, k, v = _h3_views(S, heads, d, dev, dtype)
    # quality "faults only": the per-block guard measures inside ComfyUI's sampler, which the demo has not
    att = SafeAttention(Policy(kernel="sage", verify="first", quality="faults only"), kernels=[kernel], rt=rt)
    t0 = time.perf_counter()
    out = att(None, q, k, v, heads, skip_reshape=True, skip_output_reshape=True)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    err = _rel(out, ref)
    tol = kernel.tolerance
    print(f"{label}, S={S:,}, {heads}x{d} heads, {str(dtype)[6:]} on {dev}: {dt * 1e3:.1f} ms")
    for shape, plan in run_stats.PLANS.items():
        print(f"plan for {shape}: {plan.split('; because')[0]}")
    print(f"relative L2 error vs fp32 reference: {err:.4f} (tolerance {tol}) -> {'OK' if err <= tol else 'FAIL'}")
    print(f"probes: {run_stats.value('probes')}, probe failures: {run_stats.value('probe_failures')}, "
          f"fallbacks: {run_stats.value('fallbacks')}")
    ok &= err <= tol and run_stats.value("probe_failures") == 0

    section("token-chunked H3 SwiGLU MLP")
    S_mlp = 38_000 if dev.type == "cuda" else 300
    mdtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(S_mlp, H3_HIDDEN, device=dev, dtype=mdtype, generator=g)
    w1 = torch.randn(2 * H3_FFN, H3_HIDDEN, device=dev, dtype=mdtype, generator=g) * H3_HIDDEN ** -0.5
    w2 = torch.randn(H3_HIDDEN, H3_FFN, device=dev, dtype=mdtype, generator=g) * H3_FFN ** -0.5
    chunk = 8192 if dev.type == "cuda" else 64
    full = reference_swiglu(x, w1, None, w2, None)
    chunked = chunked_swiglu(x, w1, None, w2, None, chunk)
    same = torch.equal(full, chunked)
    merr = _rel(chunked, full)
    print(f"S={S_mlp:,}, hidden {H3_HIDDEN}, ffn {H3_FFN}, {str(mdtype)[6:]} on {dev}, chunk {chunk}: "
          f"{'bitwise equal' if same else f'rel. error {merr:.2e}'} to the unchunked MLP "
          f"-> {'OK' if merr < 1e-5 else 'FAIL'}")
    ok &= merr < 1e-5

    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
