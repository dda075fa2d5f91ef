"""GPU stress, benchmark and probe runs of SafeSage's guarded attention against raw sageattention.

Everything compares in one process, on the same inputs: the guarded call
(SafeAttention), the same kernel on pre-made in-limit inputs (contiguous HND
copies), and PyTorch SDPA. The unguarded call on the real (strided) inputs runs
in a child process, because an illegal memory access poisons the CUDA context.

    python -m bench.kernels.gpu_attention stress --out bench/results/stress_h200.json
    python -m bench.kernels.gpu_attention bench  --out bench/results/attention_h200.json
    python -m bench.kernels.gpu_attention probe  --out bench/results/probe_h200.json
    python -m bench.kernels.gpu_attention host   --out bench/results/host_overhead_h200.json
    python -m bench.kernels.gpu_attention stress --family sage2_fp8pv_perwarp --out ...   (sage 2.2.0)

``--family`` picks the sage kernel family (default: the one ``sageattn`` dispatches to on
this GPU, ``safe_ops.facts.devices``). With sage 2.2.0 on an H200, ``sage2_fp8pv_perwarp`` is the
sm_120 dispatch (``sageattn_qk_int8_pv_fp8_cuda`` per_warp, fp32+fp16: what ``sageattn`` runs on
an RTX 5090, minus the #388 length rule) and ``sage2_sm90`` the native sm_90 path; the raw
(unguarded) call is that family's function called exactly as SafeSage calls it.

Needs a CUDA GPU and sageattention. Writes JSON with the command line, versions
and GPU name; docs/BENCHMARKS.md is generated from these files by
``python -m bench.common.tables``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from bench.kernels import attention_sections
from bench.common.cmdline import command

HEADS, D = 56, 128
FAMILY = os.environ.get("SAFESAGE_BENCH_FAMILY") or None   # set by --family (children inherit it)


def env_info() -> dict:
    import importlib.metadata as md
    info = {"command": command("kernels.gpu_attention"),
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "family": FAMILY or (bench_runtime().sage_family if torch.cuda.is_available() else None),
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for pkg in ("sageattention", "triton"):
        try:
            info[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            info[pkg] = None
    return info


DTYPE = getattr(torch, os.environ.get("SAFESAGE_BENCH_DTYPE", "bfloat16"))   # --dtype


def h3_qkv(S: int, layout: str, seed: int = 0, dtype=None):
    """q/k/v [B,56,S,128] HND: 'strided' = views into one [S, 3*56*128] qkv buffer (MiniMax H3),
    'strided_b2' the same with batch 2 ([2, S, 21504]), 'contiguous' separate HND tensors."""
    dtype = dtype or DTYPE
    g = torch.Generator(device="cuda").manual_seed(seed)
    if layout in ("strided", "strided_b2"):
        b = 2 if layout == "strided_b2" else 1
        qkv = torch.randn(b, S, 3 * HEADS * D, device="cuda", dtype=dtype, generator=g)
        return [t.view(b, S, HEADS, D).transpose(1, 2) for t in qkv.split(HEADS * D, -1)]
    return [torch.randn(1, HEADS, S, D, device="cuda", dtype=dtype, generator=g) for _ in range(3)]


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def tail_row_err(a, b, rows: int = 256) -> float:
    """Worst per-row relative error over the last ``rows`` query rows of every head: an index
    that wraps past the end of a 32-bit range corrupts only the rows above the wrap, which a
    whole-head L2 hides (1 wrong row of 199,730 moves it by <1e-3)."""
    a, b = a[:, :, -rows:].float(), b[:, :, -rows:].float()
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-6)).max())


WRONG_ROW = 0.5   # a correct fp8/int8 row is ~0.05-0.15 off; a row read from elsewhere is ~1.4


def per_head_rel(a, b):
    return [rel_l2(a[:, h], b[:, h]) for h in range(a.shape[1])]


def sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def bench_runtime():
    """The runtime, with the sage family forced to ``--family`` when one was given."""
    import dataclasses

    from safe_ops.facts.devices import runtime
    rt = runtime()
    return dataclasses.replace(rt, sage_family=FAMILY, sage_error=None) if FAMILY else rt


def sage_kern():
    from safe_ops.families import registry  # noqa: F401  (registers every family)
    from safe_ops.families.registry import sage_kernel
    k = sage_kernel(bench_runtime())
    if k is None:
        raise SystemExit(f"no usable sage kernel for family {FAMILY or bench_runtime().sage_family}")
    return k


def guarded(policy=None):
    from safe_ops.attention.override import SafeAttention
    from safe_ops.policy import Policy
    return SafeAttention(policy or Policy(kernel="sage", verify="off"), kernels=[sage_kern()], rt=bench_runtime())


def raw_sage(q, k, v):
    """The family's kernel called directly on the given HND tensors (no guard)."""
    return sage_kern().fn(q, k, v, "HND", None)


def comfy_attention(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                    skip_output_reshape=False, **kwargs):
    """What ComfyUI hands the override here (its attention_pytorch's contract, HND with
    skip_reshape): PyTorch SDPA. SafeSage runs it for every call no guarded kernel takes."""
    if not skip_reshape:
        d = q.shape[-1] // heads
        q, k, v = (t.unflatten(-1, (-1, d)).transpose(1, 2) for t in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=kwargs.get("scale"))
    return o if skip_output_reshape else o.transpose(1, 2).flatten(2)


noop = comfy_attention        # the name the benches and GPU tests call it by


# ------------------------------------------------------------------ unguarded child
def child(S: int, layout: str, out_path: str) -> None:
    """Raw sageattn on the given inputs; writes its error vs SDPA if it returns at all."""
    q, k, v = h3_qkv(S, layout)
    res = {"S": S, "layout": layout, "batch": q.shape[0], "dtype": str(q.dtype)}
    o = raw_sage(q, k, v)
    torch.cuda.synchronize()
    ref = sdpa(q, k, v)
    heads = per_head_rel(o, ref)
    res.update(rel_err=rel_l2(o, ref), worst_head_rel_err=max(heads), last_head_rel_err=heads[-1],
               tail_worst_row_rel_err=tail_row_err(o, ref), finite=bool(torch.isfinite(o).all()))
    with open(out_path, "w") as f:
        json.dump(res, f)


FAULT_MARKS = ("CUDA error", "illegal memory access", "Triton Error [CUDA]", "misaligned address",
               "unspecified launch failure", "AcceleratorError")


def run_child(S: int, layout: str, timeout: int = 300) -> dict:
    tmp = f"/tmp/safesage_child_{S}_{layout}.json"
    if os.path.exists(tmp):
        os.remove(tmp)
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "bench.kernels.gpu_attention", "child", "--S", str(S), "--layout", layout, "--child-out", tmp],
                       capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    res = {"S": S, "layout": layout, "returncode": p.returncode, "seconds": round(time.time() - t0, 1)}
    if p.returncode < 0:
        res["signal"] = -p.returncode
    tail = (p.stderr or "").strip().splitlines()[-3:]
    if p.returncode != 0:
        res["stderr_tail"] = tail
    if os.path.exists(tmp):
        with open(tmp) as f:
            res.update(json.load(f))
    tol = sage_kern().tolerance
    res["tolerance"] = tol
    res["outcome"] = outcome(p.returncode, p.stderr or "", res, tol)
    return res


def outcome(returncode: int, stderr: str, res: dict, tol: float) -> str:
    """correct | wrong | fault | error for one unguarded child. A nonzero exit is a fault only
    when CUDA says so (or a signal killed it): a Python error such as "SM90 kernel is not
    available" is the build refusing the call ("error"), not the kernel faulting."""
    if returncode == 0:
        ok = (res.get("worst_head_rel_err", 1) <= tol and res.get("finite", True)
              and res.get("tail_worst_row_rel_err", 0) <= WRONG_ROW)
        return "correct" if ok else "wrong"
    return "fault" if returncode < 0 or any(m in stderr for m in FAULT_MARKS) else "error"


# ------------------------------------------------------------------------- stress
def _partial(args, res: dict) -> None:
    """Write what is measured so far (a later fault or timeout keeps it)."""
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


def inlimit_ok(q) -> bool:
    """Whether contiguous HND copies of tensors shaped like ``q`` are inside the family's envelope."""
    from safe_ops.families.envelope import AttnCall, TensorDesc, check
    d = TensorDesc.contiguous(tuple(q.shape), "HND")
    call = AttnCall(d, d, d, str(q.dtype).replace("torch.", ""), "HND", False, "cuda",
                    bench_runtime().arch_name, q.element_size())
    return not check(call, sage_kern().envelope)


def stress(args) -> dict:
    from safe_ops.ui import run_stats
    results = []
    sizes = [int(s) for s in args.sizes.split(",")]
    side = torch.cuda.Stream()
    layouts = args.layouts.split(",")
    for S in sizes:
        for layout in layouts:
            torch.cuda.empty_cache()
            q, k, v = h3_qkv(S, layout)
            ref = sdpa(q, k, v)
            torch.cuda.synchronize()
            # the kernel's own error on in-limit inputs of the same values (where such exist)
            inlimit = None
            if inlimit_ok(q):
                qc, kc, vc = (t.contiguous() for t in (q, k, v))
                inlimit = rel_l2(raw_sage(qc, kc, vc), ref)
                del qc, kc, vc
            for stream_name in ("default", "side"):
                run_stats.reset()
                att = guarded()
                st = torch.cuda.current_stream() if stream_name == "default" else side
                if stream_name == "side":
                    side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(st):
                    o = att(noop, q, k, v, HEADS, skip_reshape=True, skip_output_reshape=True)
                torch.cuda.current_stream().wait_stream(st)
                torch.cuda.synchronize()
                heads = per_head_rel(o, ref)
                plan = next(iter(run_stats.PLANS.values()), "")
                results.append({"S": S, "layout": layout, "stream": stream_name, "plan": plan,
                                "guarded_rel_err": rel_l2(o, ref), "guarded_worst_head": max(heads),
                                "guarded_tail_worst_row": tail_row_err(o, ref),
                                "inlimit_rel_err": inlimit, "fault": False})
                print(json.dumps(results[-1])[:300], flush=True)
                _partial(args, {"env": env_info(), "guarded": results, "partial": True})
                del o
            del q, k, v, ref
            torch.cuda.synchronize()
    unguarded = []
    if not args.skip_children:
        for S in sizes:
            for layout in layouts:
                r = run_child(S, layout)
                unguarded.append(r)
                print("unguarded", json.dumps(r)[:300], flush=True)
                _partial(args, {"env": env_info(), "guarded": results, "unguarded": unguarded, "partial": True})
    return {"env": env_info(), "guarded": results, "unguarded": unguarded}


# -------------------------------------------------------------------------- bench
def _time_ms(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def _peak_extra(fn) -> int:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    o = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del o
    return peak


def bench(args) -> dict:
    from safe_ops.ui import run_stats
    rows = []
    comfy_fn, sdpa_source = None, "torch.nn.functional.scaled_dot_product_attention (torch's default backend order)"
    if args.comfy:
        from tools.harness.comfy_attention_fn import load
        fn, where = load(args.comfy, cpu=False)
        if where.startswith("stand-in"):
            raise SystemExit(f"--comfy {args.comfy}: {where}")
        comfy_fn, sdpa_source = fn, f"attention_pytorch of {where} (skip_reshape, skip_output_reshape: as H3 calls it)"
    for S in [int(s) for s in args.sizes.split(",")]:
        torch.cuda.empty_cache()
        q, k, v = h3_qkv(S, "strided")
        qc, kc, vc = (t.contiguous() for t in (q, k, v))
        run_stats.reset()
        att = guarded()
        g = lambda: att(noop, q, k, v, HEADS, skip_reshape=True, skip_output_reshape=True)  # noqa: E731
        kin = lambda: raw_sage(qc, kc, vc)  # noqa: E731
        # "sdpa" is what auto weighs a sage kernel against: ComfyUI's own attention as H3 calls it
        # (with --comfy: attention_pytorch, its SDPA backend priority included), else torch's SDPA
        sd = (lambda: comfy_fn(q, k, v, HEADS, skip_reshape=True, skip_output_reshape=True)) if comfy_fn else (
            lambda: sdpa(q, k, v))
        td = lambda: sdpa(q, k, v)  # noqa: E731 - torch's default backend order, for comparison
        reps = args.reps
        # interleave to cancel drift: g, kin, sdpa, g, kin, sdpa ...
        tg, tk, ts, tt = [], [], [], []
        for _ in range(2):
            tg.append(_time_ms(g, reps))
            tk.append(_time_ms(kin, reps))
            ts.append(_time_ms(sd, reps))
            if comfy_fn:
                tt.append(_time_ms(td, reps))
        flops = 4 * S * S * HEADS * D
        # the same plan with the repack copied into the other layout (checks the planner's pick)
        alt_ms = None
        plan = att.prepared_plans()[0].plan
        if plan.repack:
            import dataclasses

            from safe_ops.attention.call_forms import normalise
            from safe_ops.families.envelope import check
            from safe_ops.attention.planner import sub_call
            alt = dataclasses.replace(plan, layout="HND" if plan.layout == "NHD" else "NHD")
            call = att.prepared_plans()[0].call
            if not check(sub_call(call, plan.head_group or HEADS, plan.q_chunk or S, alt.repack, alt.layout),
                         att.kernels[plan.kernel].envelope):
                nn = normalise((q, k, v, HEADS), {"skip_reshape": True, "skip_output_reshape": True})
                alt_ms = _time_ms(lambda: att.executor.run(alt, nn), reps)
        row = {"S": S, "plan": next(iter(run_stats.PLANS.values()), ""),
               "other_layout_repack_ms": alt_ms,
               "guarded_ms": min(tg), "inlimit_kernel_ms": min(tk), "sdpa_ms": min(ts), "sdpa_source": sdpa_source,
               "torch_sdpa_default_ms": min(tt) if tt else None,
               "guarded_over_inlimit": min(tg) / min(tk), "guarded_over_sdpa": min(tg) / min(ts),
               "tflops": {sage_kern().family: flops / min(tk) / 1e9, "sdpa": flops / min(ts) / 1e9,
                          "guarded": flops / min(tg) / 1e9,
                          **({"torch_sdpa_default": flops / min(tt) / 1e9} if tt else {})},
               "extra_peak_bytes_guarded": _peak_extra(g), "extra_peak_bytes_inlimit_kernel": _peak_extra(kin),
               "extra_peak_bytes_sdpa": _peak_extra(sd)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del q, k, v, qc, kc, vc
    host = attention_sections.host_overhead(sys.modules[__name__], args.host_S)
    return {"env": env_info(), "rows": rows, "host_overhead": host}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["stress", "bench", "probe", "host", "child"])
    ap.add_argument("--out")
    ap.add_argument("--sizes", default="38000,99866,169000")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--host-S", type=int, default=256)
    ap.add_argument("--skip-children", action="store_true")
    ap.add_argument("--S", type=int)
    ap.add_argument("--layout")
    ap.add_argument("--child-out")
    ap.add_argument("--layouts", default="strided,contiguous", help="stress: strided,strided_b2,contiguous")
    ap.add_argument("--dtype", default=None, help="bfloat16 (default) or float16")
    ap.add_argument("--family", default=None, help="sage kernel family (default: what sageattn runs here)")
    ap.add_argument("--comfy", default=None, help="bench: a ComfyUI tree on PYTHONPATH; its attention_pytorch is "
                    "the 'sdpa' row (what ComfyUI itself runs: its SDPA backend priority), torch's default beside it")
    args = ap.parse_args()
    global FAMILY, DTYPE
    if args.dtype:
        os.environ["SAFESAGE_BENCH_DTYPE"] = args.dtype
        DTYPE = getattr(torch, args.dtype)
    if args.family:
        FAMILY = os.environ["SAFESAGE_BENCH_FAMILY"] = args.family
    if args.mode == "child":
        child(args.S, args.layout, args.child_out)
        return
    if args.mode == "host":
        from bench.cost import host_path
        res = {"env": env_info(), "host_overhead": attention_sections.host_overhead(sys.modules[__name__], args.host_S)}
        # SafeSage's own host time per call with null kernels (issue #29): same stream, hop, passthrough
        res["host_path"] = host_path.measure("cuda")
        for key in ("host_us_per_guarded_call", "host_us_per_passthrough_call", "host_us_per_hop_call"):
            res[key] = res["host_path"][key]
    else:
        res = {"stress": stress, "bench": bench,
               "probe": lambda a: attention_sections.probe(sys.modules[__name__], a)}[args.mode](args)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps(res)[:2000])


if __name__ == "__main__":
    main()
