#!/usr/bin/env python3
"""Benchmark: one real-size MiniMax H3 block MLP, token-chunked vs unpatched (hazard H-4).

hidden 5376, ffn 14336 (fc1 [28672, 5376], fc2 [5376, 14336]), fp8 e4m3 weights with a
per-tensor scale, bf16 activations, at S = 38,000 / 99,866 / 169,000 tokens. Pure torch (no
ComfyUI import); the chunked side is ``safe_ops.models.h3.mlp`` itself.

Modes (same process, same weights and input):
  dequant    ComfyUI's fallback for fp8 weights whose matmul is not run natively (and the
             LoRA path): each weight dequantised to bf16 once per MLP call
             (``q.to(bf16) * scale``, comfy-kitchen's formula), then
             unpatched: fc1 over all tokens -> ``_swiglu_eager`` -> fc2
             chunked:   safe_ops.models.h3.mlp_reference.chunked_swiglu with the same dequantised weights.
  scaled_mm  ComfyUI's native fp8 path (mixed_precision_ops + comfy-kitchen): each Linear
             quantises its input to fp8 with scale 1.0 and runs ``torch._scaled_mm``
             (unpatched: whole-sequence input copies; chunked: the same function per chunk
             through safe_ops.models.h3.mlp.run_chunked). Skipped where _scaled_mm is unavailable.

Per (mode, S, variant): peak allocated bytes (``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats``; reported absolute and above the baseline of input + fp8 weights),
time (CUDA events, warmup + median of N), and output equality against unpatched (max abs
diff, bitwise flag). Writes JSON.

    python -m bench.mlp.bench_mlp --out bench/results/mlp_h200.json
    python -m bench.mlp.bench_mlp --smoke            # tiny sizes, runs on CPU
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common.cmdline import command
from safe_ops.models.h3 import mlp, mlp_plan, mlp_reference

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


# ---------------------------------------------------------------------------------------
def make_fp8_linear(out_f, in_f, device, gen):
    w = torch.randn(out_f, in_f, generator=gen, device="cpu") * in_f ** -0.5
    scale = (w.abs().amax() / FP8_MAX).float()
    q = (w / scale).to(FP8)
    return q.to(device), scale.to(device)


def swiglu_eager(x):  # comfy.ops._swiglu_eager at 0dd9b154
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate).mul_(up)


def dequant(q, s, dtype):
    # comfy-kitchen's dequantize_per_tensor_fp8 formula
    return q.to(dtype=dtype) * s.to(device=q.device, dtype=dtype)


# -- dequant mode -----------------------------------------------------------------------
def dequant_unpatched(x, W, chunk=None):
    (q1, s1), (q2, s2) = W
    w1 = dequant(q1, s1, x.dtype)
    w2 = dequant(q2, s2, x.dtype)
    return F.linear(swiglu_eager(F.linear(x, w1)), w2)


def dequant_chunked(x, W, chunk):
    (q1, s1), (q2, s2) = W
    w1 = dequant(q1, s1, x.dtype)
    w2 = dequant(q2, s2, x.dtype)
    return mlp_reference.chunked_swiglu(x, w1, None, w2, None, chunk)


# -- scaled_mm mode ---------------------------------------------------------------------
def _quant_input(x):
    # comfy TensorCoreFP8E4M3Layout.quantize with scale None -> 1.0, comfy-kitchen
    # quantize_per_tensor_fp8: x * (1/scale) clamped to +-448, cast to fp8
    one = torch.ones((), device=x.device, dtype=torch.float32)
    t = x * (1.0 / one).to(x.dtype)
    t = torch.clamp(t, -FP8_MAX, FP8_MAX, out=t)
    return t.to(FP8), one


def _fp8_linear(x, q, s):
    xq, xs = _quant_input(x)
    return torch._scaled_mm(xq.contiguous(), q.t(), scale_a=xs, scale_b=s, out_dtype=x.dtype)


def scaled_unpatched(x, W, chunk=None):
    (q1, s1), (q2, s2) = W
    return _fp8_linear(swiglu_eager(_fp8_linear(x, q1, s1)), q2, s2)


def scaled_chunked(x, W, chunk):
    return mlp.run_chunked(lambda xc: scaled_unpatched(xc, W), x, chunk)


def scaled_mm_available(device):
    try:
        a = torch.zeros(16, 32, device=device).to(FP8)
        b = torch.zeros(16, 32, device=device).to(FP8)
        one = torch.ones((), device=device)
        torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        return True, None
    except Exception as e:  # pragma: no cover - device dependent
        return False, repr(e)[:300]


MODES = {
    "dequant": (dequant_unpatched, dequant_chunked),
    "scaled_mm": (scaled_unpatched, scaled_chunked),
}


# ---------------------------------------------------------------------------------------
class Timer:
    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn, warmup, reps):
        out = None
        for _ in range(warmup):
            out = fn()
            del out
        times = []
        for _ in range(reps):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                out = fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                out = fn()
                times.append((time.perf_counter() - t0) * 1e3)
            if _ < reps - 1:
                del out
        return out, times


def peak_of(fn, device):
    """(result, peak allocated bytes during fn, bytes allocated before fn)."""
    if device.type != "cuda":
        return fn(), None, None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize(device)
    return out, torch.cuda.max_memory_allocated(device), base


def compare(a, b):
    if a.shape != b.shape:
        return {"bitwise": False, "max_abs_diff": None, "note": "shape mismatch"}
    d = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    scale = b.float().abs().max().item() if b.numel() else 0.0
    return {"bitwise": bool(torch.equal(a, b)), "max_abs_diff": d,
            "rel_max_abs_diff": (d / scale) if scale else 0.0}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/mlp_<gpu>.json, "
                                                "bench/results/mlp_smoke.json with --smoke)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, any device (CPU ok)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--seqs", default=None, help="comma list of S (default 38000,99866,169000)")
    ap.add_argument("--chunks", default=None,
                    help="comma list of chunk settings: auto and/or token counts (default auto,8192,16384)")
    ap.add_argument("--modes", default="dequant,scaled_mm")
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--ffn", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--budget-mib", type=float, default=mlp_plan.AUTO_BUDGET_BYTES / 2 ** 20,
                    help="memory budget the 'auto' chunk is planned for (safe_ops.models.h3.mlp default)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() and not a.smoke else "cpu"))
    if a.smoke:
        hidden, ffn = a.hidden or 64, a.ffn or 96
        seqs = [int(s) for s in (a.seqs or "0,1,333,1000").split(",")]
        chunks = (a.chunks or "auto,100,256").split(",")
        warmup, reps = a.warmup if a.warmup is not None else 1, a.reps or 2
        budget = int(a.budget_mib * 2 ** 20) if a.budget_mib != mlp_plan.AUTO_BUDGET_BYTES / 2 ** 20 \
            else mlp_plan.per_token_bytes(hidden, ffn, 2) * 300
    else:
        hidden, ffn = a.hidden or 5376, a.ffn or 14336
        seqs = [int(s) for s in (a.seqs or "38000,99866,169000").split(",")]
        chunks = (a.chunks or "auto,8192,16384").split(",")
        warmup, reps = a.warmup if a.warmup is not None else 2, a.reps or 7
        budget = int(a.budget_mib * 2 ** 20)
    dtype = torch.bfloat16
    modes = [m for m in a.modes.split(",") if m]

    gen = torch.Generator().manual_seed(a.seed)
    xgen = torch.Generator(device=device).manual_seed(a.seed + 1)
    W = (make_fp8_linear(2 * ffn, hidden, device, gen), make_fp8_linear(hidden, ffn, device, gen))
    sm_ok, sm_err = scaled_mm_available(device)

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    result = {
        "bench": "h3_mlp_chunking",
        "command": command("mlp.bench_mlp") if argv is None
        else "bench_mlp.py " + " ".join(argv),
        "torch": torch.__version__, "cuda": torch.version.cuda, "device": str(device), "gpu": gpu,
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "shape": {"hidden": hidden, "ffn": ffn, "fc1": [2 * ffn, hidden], "fc2": [hidden, ffn],
                  "weights": "float8_e4m3fn, per-tensor fp32 scale", "activations": "bfloat16"},
        "auto_budget_bytes": budget, "per_token_bytes": mlp_plan.per_token_bytes(hidden, ffn, 2),
        "warmup": warmup, "reps": reps, "scaled_mm_available": sm_ok, "scaled_mm_error": sm_err,
        "notes": ("peak_bytes = torch.cuda.max_memory_allocated during one MLP call after "
                  "reset_peak_memory_stats; working_bytes = peak minus the bytes allocated before "
                  "the call (input x + fp8 weights + anything else resident). time_ms: CUDA events, "
                  "median of reps after warmup. Equality vs the unpatched run of the same mode."),
        "runs": [],
    }
    timer = Timer(device)
    for mode in modes:
        if mode == "scaled_mm" and not sm_ok:
            result["runs"].append({"mode": mode, "skipped": f"torch._scaled_mm unavailable: {sm_err}"})
            continue
        unpatched_fn, chunked_fn = MODES[mode]
        for S in seqs:
            try:
                _bench_one(result, timer, mode, unpatched_fn, chunked_fn, S, W, hidden, ffn, dtype,
                           device, xgen, chunks, budget, warmup, reps)
            except Exception as e:  # recorded, the other sizes still run
                result["runs"].append({"mode": mode, "S": S, "error": repr(e)[:500]})
                print(f"[{mode}] S={S}: ERROR {e!r}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    result["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    out = a.out
    if out is None:
        tag = "smoke" if a.smoke else "".join(ch if ch.isalnum() else "_" for ch in gpu.lower())[:40]
        out = os.path.join(ROOT, "bench", "results", f"mlp_{tag}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    return result


def _bench_one(result, timer, mode, unpatched_fn, chunked_fn, S, W, hidden, ffn, dtype, device, xgen,
               chunks, budget, warmup, reps):
    x = torch.randn(S, hidden, generator=xgen, device=device).to(dtype)
    ref, peak_u, base_u = peak_of(lambda: unpatched_fn(x, W), device)
    ref = ref.cpu()  # off the device: the chunked runs' peaks must not include it
    _, times_u = timer(lambda: unpatched_fn(x, W), warmup, reps)
    row = {"mode": mode, "S": S, "variant": "unpatched", "chunk_tokens": S,
           "peak_bytes": peak_u, "working_bytes": (peak_u - base_u) if peak_u is not None else None,
           "time_ms_median": statistics.median(times_u), "time_ms_all": times_u}
    result["runs"].append(row)
    print(f"[{mode}] S={S:>7} unpatched     peak={_gib(peak_u)} work={_gib(row['working_bytes'])} "
          f"t={row['time_ms_median']:.2f} ms", flush=True)
    for setting in chunks:
        c = mlp_plan.plan_chunk(S, hidden, ffn, 2, budget) if setting == "auto" else min(int(setting), max(S, 1))
        c = max(c, 1)
        y, peak_c, base_c = peak_of(lambda: chunked_fn(x, W, c), device)
        eq = compare(y, ref.to(y.device))
        del y
        _, times_c = timer(lambda: chunked_fn(x, W, c), warmup, reps)
        t_c = statistics.median(times_c)
        work_c = (peak_c - base_c) if peak_c is not None else None
        row_c = {"mode": mode, "S": S, "variant": f"chunked:{setting}", "chunk_tokens": c,
                 "n_chunks": -(-S // c) if S else 0,
                 "peak_bytes": peak_c, "working_bytes": work_c,
                 "time_ms_median": t_c, "time_ms_all": times_c,
                 "time_ratio_vs_unpatched": (t_c / row["time_ms_median"]) if row["time_ms_median"] else None,
                 "peak_reduction": (1 - peak_c / peak_u) if peak_u else None,
                 "working_reduction": (1 - work_c / row["working_bytes"])
                 if work_c is not None and row["working_bytes"] else None,
                 **{"equal_" + k: v for k, v in eq.items()}}
        result["runs"].append(row_c)
        print(f"[{mode}] S={S:>7} chunk={setting:>6}({c:>6}) peak={_gib(peak_c)} work={_gib(work_c)} "
              f"t={t_c:.2f} ms ratio={row_c['time_ratio_vs_unpatched'] or 0:.3f} "
              f"bitwise={eq['bitwise']} maxdiff={eq['max_abs_diff']}", flush=True)


def _gib(b):
    return "   n/a   " if b is None else f"{b / 2 ** 30:7.3f}GiB"


if __name__ == "__main__":
    main()
