"""comfy-kitchen ``int8_attention`` on aligned and misaligned q/k/v views (ComfyUI #15494): what it
does with each, against what SafeSage's ck_int8 envelope predicts (safe_ops/families/ck_int8.py
AlignRule).

    python3 -m bench.kernels.ck_align_probe --out bench/results/ck240_align_h200.json      (GPU, comfy-kitchen)
    python3 -m bench.kernels.ck_align_probe --dry-run --out /tmp/ck_align_dry.json         (CPU: cases + predictions)

Every case runs in its own subprocess (``--case NAME``), so a fault in one (a sticky CUDA error,
a crash) cannot take the others with it. Per case the JSON records the tensors (shape, strides,
base-pointer alignment), the envelope's prediction ("ok" | "qk": the Q/K quantiser's check |
"v": the V quantiser's), and the measurement: ``int8_attention`` on the views (raised and what,
whether a CUDA error followed, finite output, rel. L2 vs fp32 SDPA on the same inputs), the same on
contiguous copies (what SafeSage's repack plan hands it), and ``prequantize_int8_attention`` (the
path ComfyUI's container function takes). ``agrees``: the measured outcome is the predicted one.
Small shapes: 4 heads x 512 tokens x 128 (80 for one case).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback

import torch

from bench.common.cmdline import command

H, S, D = 4, 512, 128

# name -> (spec, expected outcome derived by hand from the launchers' conditions)
CASES: dict[str, tuple[dict, str]] = {
    "contiguous_hnd":         ({"build": "fresh"}, "ok"),
    "h3_views":               ({}, "ok"),                               # H3's own views, batch 1
    "h3_views_batch2":        ({"B": 2}, "ok"),
    "qkv_offset2":            ({"offset": 2}, "qk"),                    # 4 bytes in: q/k need 8
    "qkv_offset4":            ({"offset": 4}, "v"),                     # 8 bytes in: v needs 16
    "qkv_offset8":            ({"offset": 8}, "ok"),
    "q_only_offset2":         ({"offset": 2, "which": "q"}, "qk"),
    "k_only_offset2":         ({"offset": 2, "which": "k"}, "qk"),
    "v_only_offset2":         ({"offset": 2, "which": "v"}, "v"),
    "v_only_offset4":         ({"offset": 4, "which": "v"}, "v"),
    "token_stride_pad2":      ({"pad": 2}, "qk"),                       # rows 3*H*D+2 wide
    "token_stride_pad4":      ({"pad": 4}, "v"),                        # 8-byte token stride: v only
    "head_stride_130":        ({"build": "head_stride_130"}, "qk"),
    "batch1_stride_odd":      ({"build": "batch1_stride_odd"}, "ok"),   # extent 1: exempt (0.2.31+)
    "head1_stride_odd":       ({"build": "head1_stride_odd"}, "ok"),
    "k_heads_broadcast":      ({"build": "k_heads_broadcast"}, "qk"),   # stride 0, extent 4
    "v_heads_broadcast":      ({"build": "v_heads_broadcast"}, "ok"),   # v allows stride 0
    "fp32_offset4":           ({"dtype": "float32", "offset": 4}, "ok"),
    "fp32_offset2":           ({"dtype": "float32", "offset": 2}, "qk"),
    "fp16_offset2":           ({"dtype": "float16", "offset": 2}, "qk"),
    "headdim80_offset1":      ({"D": 80, "offset": 1}, "ok"),           # padded into fresh copies
}


def build(spec: dict, device: str, seed: int = 0):
    """q/k/v [B,H,S,D] for ``spec``: views into one [B, S, 3*H*D + pad] buffer whose rows start
    ``offset`` elements into its storage (H3's layout), or one of the special builds."""
    dt = getattr(torch, spec.get("dtype", "bfloat16"))
    B, d = spec.get("B", 1), spec.get("D", D)
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dt)

    kind = spec.get("build", "buffer")
    if kind == "fresh":
        return rnd(B, H, S, d), rnd(B, H, S, d), rnd(B, H, S, d)
    if kind == "head_stride_130":
        return [rnd(B, S, H, 130)[..., :d].transpose(1, 2) for _ in range(3)]
    if kind == "batch1_stride_odd":
        return [torch.as_strided(rnd(S * H * d + 8), (1, H, S, d), (7, S * d, d, 1)) for _ in range(3)]
    if kind == "head1_stride_odd":
        return [torch.as_strided(rnd(S * d + 8), (1, 1, S, d), (S * d + 8, 7, d, 1)) for _ in range(3)]
    if kind in ("k_heads_broadcast", "v_heads_broadcast"):
        q, k, v = rnd(B, H, S, d), rnd(B, H, S, d), rnd(B, H, S, d)
        one = rnd(B, 1, S, d).expand(B, H, S, d)
        return (q, one, v) if kind == "k_heads_broadcast" else (q, k, one)
    offset, pad, which = spec.get("offset", 0), spec.get("pad", 0), spec.get("which", "qkv")
    row = 3 * H * d + pad
    buf = rnd(offset + B * S * row)[offset:].view(B, S, row)[..., :3 * H * d]
    views = [t.view(B, S, H, d).transpose(1, 2) for t in buf.split(H * d, -1)]
    return tuple(views[i] if "qkv"[i] in which else rnd(B, H, S, d) for i in range(3))


def predict(q, k, v, version: str) -> tuple[str, list[str]]:
    """The ck_int8 envelope's answer for comfy-kitchen ``version``: its alignment violations and the
    check that raises first (q/k's quantiser runs before v's)."""
    from safe_ops.attention.call_forms import describe_tensor, dtype_name
    from safe_ops.families.ck_int8 import ck_family_for
    from safe_ops.families.envelope import FAMILIES, AttnCall, check
    env = FAMILIES[ck_family_for(version) or "ck_int8"]
    call = AttnCall(describe_tensor(q), describe_tensor(k), describe_tensor(v), dtype_name(q.dtype), "HND",
                    False, "cuda", "", q.element_size())
    viol = [v for v in check(call, env) if v.rule == "align"]
    first = "qk" if any(x.tensor in "qk" for x in viol) else "v" if viol else "ok"
    return first, [str(x) for x in viol]


def describe(t) -> dict:
    from safe_ops.attention.call_forms import base_alignment
    return {"shape": list(t.shape), "stride": list(t.stride()), "align_bytes": base_alignment(t)}


def outcome(msg: str | None) -> str:
    if msg is None:
        return "ok"
    if "quant_qk_per_thread_int8" in msg and "alignment" in msg:
        return "qk"
    if "quant_v_int8" in msg and "aligned" in msg:
        return "v"
    return "other"


def attempt(fn, q, k, v) -> dict:
    """``fn(q, k, v)``: raised (and what), a CUDA error afterwards, finite, rel. L2 vs fp32 SDPA."""
    r: dict = {"error": None}
    try:
        o = fn(q, k, v)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - recorded
        r["error"] = f"{type(e).__name__}: {e}"[:400]
        o = None
    try:
        torch.cuda.synchronize()
        r["cuda_error_after"] = None
    except Exception as e:  # noqa: BLE001 - a sticky error: the subprocess ends here anyway
        r["cuda_error_after"] = f"{type(e).__name__}: {e}"[:400]
        return r
    r["outcome"] = outcome(r["error"])
    if o is not None:
        r["finite"] = bool(torch.isfinite(o).all())
        try:
            ref = reference(q, k, v)
            r["rel_l2"] = float((o.float() - ref).norm() / ref.norm())
        except Exception as e:  # noqa: BLE001 - the reference's own failure, not the kernel's
            r["reference_error"] = f"{type(e).__name__}: {e}"[:400]
    return r


def reference(q, k, v):
    """fp32 SDPA on fresh contiguous copies: the case's own views (a misaligned base, an odd stride)
    are what is probed, and PyTorch's fused kernels reject or fault on some of them too (on the
    H100: "cutlassF: no kernel found" for an odd token stride, a misaligned address for an fp32
    view 8 bytes in), which is no finding about comfy-kitchen."""
    q, k, v = (t.to(torch.float32).clone(memory_format=torch.contiguous_format) for t in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def run_case(name: str, version: str) -> dict:
    import comfy_kitchen as ck
    spec, expected = CASES[name]
    q, k, v = build(spec, "cuda")
    pred, viol = predict(q, k, v, version)
    res = {"name": name, "spec": spec, "expected": expected, "predicted": pred, "violations": viol,
           "tensors": {n: describe(t) for n, t in zip("qkv", (q, k, v))}, "comfy_kitchen_file": ck.__file__}
    res["measured"] = attempt(lambda a, b, c: ck.int8_attention(a, b, c), q, k, v)
    res["repacked"] = attempt(lambda a, b, c: ck.int8_attention(a.contiguous(), b.contiguous(), c.contiguous()),
                              q, k, v)
    if hasattr(ck, "prequantize_int8_attention"):
        res["prequantized"] = attempt(
            lambda a, b, c: ck.int8_attention_from_prequantized(ck.prequantize_int8_attention(a, b, c)), q, k, v)
    res["agrees"] = res["measured"].get("outcome") == pred
    return res


def dry_case(name: str, version: str) -> dict:
    spec, expected = CASES[name]
    q, k, v = build(spec, "cpu")
    pred, viol = predict(q, k, v, version)
    return {"name": name, "spec": spec, "expected": expected, "predicted": pred, "violations": viol,
            "tensors": {n: describe(t) for n, t in zip("qkv", (q, k, v))}}


def child(name: str, version: str, timeout: int) -> dict:
    """``--case name`` in a subprocess; its last stdout line is the case's JSON."""
    cmd = [sys.executable, "-m", "bench.kernels.ck_align_probe", "--case", name, "--ck-version", version]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=os.environ.copy())
    except subprocess.TimeoutExpired:
        return {"name": name, "crashed": f"timed out after {timeout} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"name": name, "crashed": f"exit {p.returncode}", "stderr_tail": p.stderr[-2000:]}
    return json.loads(lines[-1])


def ck_version() -> str | None:
    import importlib.metadata as md
    try:
        return md.version("comfy-kitchen")
    except md.PackageNotFoundError:
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON result path")
    ap.add_argument("--dry-run", action="store_true", help="CPU: the cases and the envelope's predictions only")
    ap.add_argument("--case", help="run one case here and print its JSON (what the parent runs per case)")
    ap.add_argument("--ck-version", default=None, help="envelope version to predict for (default: installed, "
                                                       "else 0.2.40)")
    ap.add_argument("--timeout", type=int, default=120, help="seconds per case subprocess")
    ap.add_argument("--cases", default=None, help="comma-separated case names to run (default: every case)")
    ap.add_argument("--merge", default=None, help="an earlier result JSON: its cases not run now are kept")
    args = ap.parse_args(argv)
    version = args.ck_version or ck_version() or "0.2.40"
    if args.case:
        try:
            print(json.dumps(run_case(args.case, version)))
        except Exception:  # noqa: BLE001 - the parent records it
            print(json.dumps({"name": args.case, "crashed": traceback.format_exc()[-2000:]}))
        return 0
    res: dict = {"command": command("kernels.ck_align_probe"), "ck_version_predicted_for": version,
                 "dry_run": bool(args.dry_run)}
    if args.dry_run:
        res["cases"] = [dry_case(n, version) for n in CASES]
    else:
        from bench.common import benchutil
        res["env"] = benchutil.env_info("kernels.ck_align_probe")
        names = args.cases.split(",") if args.cases else list(CASES)
        unknown = [n for n in names if n not in CASES]
        if unknown:
            ap.error(f"unknown case(s): {', '.join(unknown)}")
        ran = {n: child(n, version, args.timeout) for n in names}
        kept: dict = {}
        if args.merge:
            with open(args.merge) as f:
                earlier = json.load(f)
            kept = {c["name"]: c for c in earlier.get("cases", []) if c.get("name") not in ran}
            res["merged_from"] = {"path": args.merge, "command": earlier.get("command"),
                                  "cases_kept": sorted(kept)}
        res["cases"] = [ran[n] if n in ran else kept[n] for n in CASES if n in ran or n in kept]
        res["summary"] = {"cases": len(res["cases"]), "agree": sum(bool(c.get("agrees")) for c in res["cases"]),
                          "disagree": [c["name"] for c in res["cases"] if not c.get("agrees")]}
    for c in res["cases"]:
        m = c.get("measured", {})
        print(f"{c['name']:22s} expected {c.get('expected', '?'):3s} predicted {c.get('predicted', '?'):3s}"
              + (f" measured {m.get('outcome', '?'):5s} rel_l2 {m.get('rel_l2', float('nan')):.4f}" if m else "")
              + (f" CRASHED {c['crashed'][:60]}" if "crashed" in c else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
