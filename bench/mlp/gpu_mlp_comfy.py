#!/usr/bin/env python3
"""MiniMax H3's MLP through ComfyUI's own ops: unpatched ``MLP.forward`` vs the pack's
``safe_ops.models.h3.mlp.h3_mlp_forward`` with ComfyUI's cast memoised (``safe_ops.models.h3.cast_memo.install()``:
exactly what the SafeSage node installs), one process, same module.

The module is ComfyUI 0dd9b154's ``comfy.ldm.minimax.model.MLP`` at the real size (hidden 5376,
ffn 14336) built with ComfyUI's own operations, weights loaded through ComfyUI's state-dict
path, on the GPU:

  fp8    ``comfy.ops.mixed_precision_ops`` with float8_e4m3fn weights + ``weight_scale`` (what an
         fp8_scaled checkpoint loads as): each Linear quantises its input and comfy-kitchen runs
         ``torch._scaled_mm``.
  bf16   ``comfy.ops.disable_weight_init`` with bf16 weights (a bf16 checkpoint).
  int8   ``mixed_precision_ops`` with TensorWiseINT8 weights (comfy-kitchen's int8 GEMM, SwiGLU
         fused into fc2's input quantiser by ``linear_input_act``), where comfy-kitchen runs it.
  lowvram_bf16  ``comfy.ops.manual_cast`` with bf16 weights left in host memory (ComfyUI's
         lowvram / offloaded layers): every Linear call really casts, copying its weight to the
         GPU. Adds the variant ``per_chunk``: ComfyUI's forward per chunk without the memo, i.e.
         one cast per Linear per chunk -- what the memo saves.

Every variant records how many casts ComfyUI really ran in one call (``casts_per_call``, counted
under the memo): 2 (fc1, fc2) for the unpatched forward and for the pack's chunked one.

Per (mode, S, variant): CUDA-event time (median of ``--reps`` after warm-up, variants
interleaved), once from an idle GPU and once queued behind ~30 ms of GPU work (the host-side
setup of a call then overlaps, as inside a model), extra peak memory over the call, and the output against the unpatched one
(bitwise flag and max abs diff). ``--profile`` adds per-kernel CUDA time of one call of each
variant at the largest S (torch.profiler).

    PYTHONPATH=$COMFYUI_PATH python -m bench.mlp.gpu_mlp_comfy --comfy $COMFYUI_PATH --out bench/results/mlp_comfy_h200.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback


import torch

from bench.common.cmdline import command
from bench.common.benchutil import profile_table, time_ms

HIDDEN, FFN = 5376, 14336
DEV = "cuda"
SLEEP_CYCLES = 60_000_000    # ~30 ms at H200 clocks


def _fp8_state(out_f, in_f, gen):
    w = torch.randn(out_f, in_f, generator=gen) * in_f ** -0.5
    scale = w.abs().amax() / 448.0
    return {"weight": (w / scale).to(torch.float8_e4m3fn), "weight_scale": scale.float(),
            "comfy_quant": torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()), dtype=torch.uint8)}


def _int8_state(out_f, in_f, gen):
    w = torch.randn(out_f, in_f, generator=gen) * in_f ** -0.5
    scale = w.abs().amax() / 127.0
    return {"weight": (w / scale).round().clamp(-127, 127).to(torch.int8), "weight_scale": scale.float(),
            "comfy_quant": torch.tensor(list(json.dumps({"format": "int8_tensorwise"}).encode()), dtype=torch.uint8)}


def build(mode: str):
    import comfy.ops
    from comfy.ldm.minimax.model import MLP
    gen = torch.Generator().manual_seed(11)
    if mode == "lowvram_bf16":
        m = MLP(HIDDEN, FFN, dtype=torch.bfloat16, device="cpu", operations=comfy.ops.manual_cast)
        for lin in (m.fc1, m.fc2):
            w = torch.randn(lin.out_features, lin.in_features, generator=gen) * lin.in_features ** -0.5
            lin.weight = torch.nn.Parameter(w.to(torch.bfloat16).pin_memory() if DEV == "cuda"
                                            else w.to(torch.bfloat16), requires_grad=False)
        return m
    if mode == "bf16":
        m = MLP(HIDDEN, FFN, dtype=torch.bfloat16, device=DEV, operations=comfy.ops.disable_weight_init)
        for lin in (m.fc1, m.fc2):
            w = torch.randn(lin.out_features, lin.in_features, generator=gen) * lin.in_features ** -0.5
            lin.weight = torch.nn.Parameter(w.to(DEV, torch.bfloat16), requires_grad=False)
        return m
    ops = comfy.ops.mixed_precision_ops({}, compute_dtype=torch.bfloat16)
    m = MLP(HIDDEN, FFN, dtype=torch.bfloat16, device=DEV, operations=ops)
    make = _fp8_state if mode == "fp8" else _int8_state
    for lin in (m.fc1, m.fc2):
        sd = {k: (v if k == "comfy_quant" else v.to(DEV))   # ComfyUI reads comfy_quant on the host
              for k, v in make(lin.out_features, lin.in_features, gen).items()}
        lin.load_state_dict(sd, strict=False)
    layout = getattr(m.fc1.weight, "_layout_cls", None) or getattr(m.fc1, "layout_type", None)
    if layout is None:
        raise RuntimeError(f"{mode}: ComfyUI did not load a quantised weight")
    return m


class CastCount:
    """ComfyUI's real casts: a counter put under the pack's memo (installed after it)."""

    def __init__(self):
        import comfy.ops
        self.n = 0
        real = comfy.ops.cast_bias_weight

        def counted(*a, **k):
            self.n += 1
            return real(*a, **k)
        comfy.ops.cast_bias_weight = counted

    def of(self, fn) -> int:
        n0 = self.n
        o = fn()
        del o
        return self.n - n0


def peak_extra(fn) -> int:
    if DEV == "cpu":
        return 0
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    o = fn()
    torch.cuda.synchronize()
    del o
    return torch.cuda.max_memory_allocated() - base


def profile(fn, top=12) -> list[dict]:
    total, rows = profile_table(fn, top)
    return [{"total_kernel_ms": total}] + rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--comfy", default=os.environ.get("COMFYUI_PATH"))
    ap.add_argument("--out")
    ap.add_argument("--modes", default="fp8,bf16,int8,lowvram_bf16")
    ap.add_argument("--sizes", default="38000,99866,169000")
    ap.add_argument("--chunks", default="auto,16384", help="chunk settings of the patched variants")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny dims (hidden 64, ffn 96): checks the script only")
    a = ap.parse_args()
    global DEV, HIDDEN, FFN
    from bench.common.synth_h3 import setup_comfy
    setup_comfy(a.comfy)
    if a.smoke:
        DEV, HIDDEN, FFN = "cpu", 64, 96
        import comfy.cli_args
        comfy.cli_args.args.cpu = True
    elif not torch.cuda.is_available():
        sys.exit("gpu_mlp_comfy: needs a CUDA GPU")
    import comfy.model_management  # noqa: F401  (GPU init as ComfyUI does)
    from safe_ops.models.h3 import mlp, cast_memo, mlp_plan
    from safe_ops.ui import run_stats
    casts = CastCount()
    if not cast_memo.install():
        sys.exit("gpu_mlp_comfy: this ComfyUI has no comfy.ops.cast_bias_weight/uncast_bias_weight")
    import importlib.metadata as md
    res = {"bench": "h3_mlp_comfy_ops", "command": command("mlp.gpu_mlp_comfy"),
           "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (smoke)", "dims": [HIDDEN, FFN], "comfyui": a.comfy,
           "comfy_kitchen": next((md.version(p) for p in ("comfy-kitchen", "comfy_kitchen")
                                  if _has(md, p)), None),
           "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "auto_budget_bytes": mlp_plan.auto_budget_bytes(torch.device(DEV)), "runs": [], "errors": {}}
    sizes = [int(s) for s in a.sizes.split(",")]
    chunks = [c for c in a.chunks.split(",") if c]
    for mode in a.modes.split(","):
        try:
            m = build(mode)
        except Exception as e:  # noqa: BLE001
            res["errors"][mode] = f"{type(e).__name__}: {e}"
            print(mode, "build failed:", res["errors"][mode], flush=True)
            continue
        for S in sizes:
            try:
                with torch.inference_mode():
                    x = torch.randn(1, S, HIDDEN, device=DEV, dtype=torch.bfloat16,
                                    generator=torch.Generator(device=DEV).manual_seed(S))
                    stats = run_stats.Section("bench_mlp", mlp.MLP_COUNTERS)
                    fns = {"unpatched": lambda: type(m).forward(m, x)}
                    for c in chunks:
                        fns[f"chunked:{c}"] = (lambda c=c: mlp.h3_mlp_forward(m, x, mlp_plan.parse_chunk_setting(c),
                                                                              stats=stats))
                    if mode.startswith("lowvram"):
                        c0 = mlp_plan.resolve_chunk(mlp_plan.parse_chunk_setting(chunks[0]), S, HIDDEN, FFN,
                                                    x.dtype, x.device, None)
                        fns["per_chunk"] = lambda c0=c0: mlp.run_chunked(lambda xc: type(m).forward(m, xc), x, c0)
                    ref = fns["unpatched"]()
                    rows = {}
                    for name, fn in fns.items():
                        o = fn()
                        d = (o.float() - ref.float()).abs().max().item()
                        rows[name] = {"mode": mode, "S": S, "variant": name, "bitwise_equal": bool(torch.equal(o, ref)),
                                      "max_abs_diff": d, "peak_extra_bytes": peak_extra(fn),
                                      "casts_per_call": casts.of(fn)}
                        del o
                    del ref
                    stats.reset()
                    t = time_ms(fns, a.reps)
                    tq = time_ms(fns, a.reps, queued_cycles=SLEEP_CYCLES if DEV != "cpu" else 0)
                    st = stats.as_dict()
                    for name, r in rows.items():
                        r["time_ms"] = t[name]
                        r["ratio_vs_unpatched"] = t[name] / t["unpatched"]
                        r["time_ms_queued"] = tq[name]
                        r["ratio_vs_unpatched_queued"] = tq[name] / tq["unpatched"]
                        r["peak_vs_unpatched"] = r["peak_extra_bytes"] / max(rows["unpatched"]["peak_extra_bytes"], 1)
                        if name.startswith("chunked:"):
                            c = mlp_plan.parse_chunk_setting(name.split(":", 1)[1])
                            r["chunk_tokens"] = mlp_plan.resolve_chunk(c, S, HIDDEN, FFN, x.dtype, x.device, None)
                        res["runs"].append(r)
                        print(json.dumps(r), flush=True)
                    res.setdefault("mlp_stats", {})[f"{mode}:{S}"] = st
                    if a.profile and S == max(sizes):
                        res.setdefault("profiles", {})[mode] = {n: profile(fn) for n, fn in fns.items()}
                        print(json.dumps(res["profiles"][mode])[:2500], flush=True)
                    del x
            except Exception as e:  # noqa: BLE001
                res["errors"][f"{mode}:{S}"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1200:]}"
                print(mode, S, "failed:", res["errors"][f"{mode}:{S}"], flush=True)
            if DEV != "cpu":
                torch.cuda.empty_cache()
        del m
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


def _has(md, p):
    try:
        md.version(p)
        return True
    except md.PackageNotFoundError:
        return False


if __name__ == "__main__":
    main()
