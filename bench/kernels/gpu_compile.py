"""SafeSage's attention override under torch.compile: graph breaks per attention call, per arm
(issue 26 point 1). A toy 2-block model at an H3-like shape (56 heads x 128, bf16, a few
thousand tokens; q/k/v views of one qkv projection) whose attention is, per arm:

* ``comfy``             ComfyUI's attention_pytorch alone (no override);
* ``safesage_sdpa``     through SafeSage with kernel="sdpa" (handed to that same function);
* ``sage_direct:<fn>``  sage called directly: sage 1.x ``sageattn``; with sage 2.2 also
                        ``sageattn_qk_int8_pv_fp8_cuda(..., qk_quant_gran="per_warp",
                        pv_accum_dtype="fp32+fp16")`` (the sm_120 path) when that build is importable;
* ``safesage_guarded:<family>``  SafeSage guarding that family's kernel (SafeAttention with the
                        kernel handed in, as bench/kernels/gpu_attention.py does; ``--family`` as there,
                        e.g. sage2_fp8pv_perwarp, emulated on the H200 by its runtime);
* ``safesage_guarded:fake_cpu``  (``--device cpu``) a CPU stand-in family (PyTorch SDPA with a
                        CPU envelope): SafeSage's opaque op without sage.

For each arm: ``torch._dynamo.explain`` (graph count, graph breaks, the reasons, SafeSage opaque
ops), ``breaks_per_call`` (breaks / attention calls per forward), the compiled output's
relative L2 against the same arm eager, and (on CUDA) median eager/compiled ms.

    PYTHONPATH=$PYTHONPATH:$SS_COMFY python3 -m bench.kernels.gpu_compile --tag sage106 --family sage1_triton
    PYTHONPATH=$PYTHONPATH:$SS_COMFY python3 -m bench.kernels.gpu_compile --tag sage22_sm120 --family sage2_fp8pv_perwarp
    PYTHONPATH=$COMFYUI_PATH python3 -m bench.kernels.gpu_compile --device cpu --tag cpu --tokens 256 --heads 4 --dim 32

Writes bench/results/torch_compile_<tag>.json (``--out`` to override) with the command line.
ComfyUI's attention comes from the tree --comfy names, else $SS_COMFY (bench/device_setup.sh) or
$COMFYUI_PATH, imported from PYTHONPATH as above (tools.harness.comfy_attention_fn.load): a stand-in with
its contract when none is named or that tree is not the ComfyUI PYTHONPATH imports, recorded in the JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
import traceback

import torch

from bench.common.benchutil import time_ms
from bench.common.cmdline import command

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Toy(torch.nn.Module):
    """Two blocks: qkv projection (one buffer, q/k/v views as H3), attention, out projection."""

    def __init__(self, attn, heads, dim, dtype, device):
        super().__init__()
        w = heads * dim
        g = torch.Generator(device="cpu").manual_seed(0)
        self.qkv = torch.nn.ModuleList([torch.nn.Linear(w, 3 * w, bias=False) for _ in range(2)])
        self.out = torch.nn.ModuleList([torch.nn.Linear(w, w, bias=False) for _ in range(2)])
        for p in self.parameters():
            p.data.copy_(torch.randn(p.shape, generator=g) * w ** -0.5)
        self.to(device=device, dtype=dtype).requires_grad_(False)
        self.attn, self.heads = attn, heads

    def forward(self, x):
        for i in range(2):
            q, k, v = self.qkv[i](x).chunk(3, dim=-1)
            x = x + self.out[i](self.attn(q, k, v, self.heads, i))
        return x


def sage_direct_fns() -> dict:
    """name -> fn(q, k, v) on [B,S,H,D] (NHD), for the sage functions importable here."""
    out = {}
    try:
        import sageattention
    except Exception:  # noqa: BLE001
        return out
    if hasattr(sageattention, "sageattn"):
        out["sageattn"] = lambda q, k, v: sageattention.sageattn(q, k, v, tensor_layout="NHD")
    f = getattr(sageattention, "sageattn_qk_int8_pv_fp8_cuda", None)
    if f is not None:
        out["sm120_per_warp"] = lambda q, k, v: f(q, k, v, tensor_layout="NHD", qk_quant_gran="per_warp",
                                                 pv_accum_dtype="fp32+fp16")
    return out


def guarded_att(family: str, device: str):
    from safe_ops.attention.override import SafeAttention
    from safe_ops.policy import Policy
    if family == "fake_cpu":
        from safe_ops.families.family import Kernel
        from safe_ops.families.sage1 import SAGE1_TRITON
        from safe_ops.families.sdpa import SDPA_KERNEL
        from safe_ops.facts.devices import runtime
        env = dataclasses.replace(SAGE1_TRITON, family="fake_cpu", devices=("cpu",), head_dims=(16, 32, 64, 128))
        return SafeAttention(Policy(kernel="sage", verify="first"), kernels=[Kernel(env, SDPA_KERNEL.fn, 0.05)],
                             rt=runtime())
    from bench.kernels import gpu_attention as ga
    ga.FAMILY = os.environ["SAFESAGE_BENCH_FAMILY"] = family
    return SafeAttention(Policy(kernel="sage", verify="first"), kernels=[ga.sage_kern()], rt=ga.bench_runtime())


def arms(args, comfy_fn) -> dict:
    """arm name -> (attention fn(q, k, v, heads, block) for the toy, or the reason it is skipped)."""
    from safe_ops.attention.override import SafeAttention
    from safe_ops.policy import Policy
    out: dict = {"comfy": lambda q, k, v, h, i: comfy_fn(q, k, v, h, transformer_options={"block_index": i})}
    sdpa = SafeAttention(Policy(kernel="sdpa", verify="off"), kernels=[])
    out["safesage_sdpa"] = lambda q, k, v, h, i: comfy_fn(
        q, k, v, h, transformer_options={"block_index": i, "optimized_attention_override": sdpa})
    if args.device == "cpu":
        families = ["fake_cpu"]
    else:
        direct = sage_direct_fns()
        if not direct:
            out["sage_direct"] = "sageattention does not import here"
        for name, fn in direct.items():
            def run(q, k, v, h, i, fn=fn):
                b, s, w = q.shape
                d = w // h
                return fn(*(t.view(b, s, h, d) for t in (q, k, v))).reshape(b, s, w)
            out[f"sage_direct:{name}"] = run
        families = args.family or []
    for fam in families:
        try:
            att = guarded_att(fam, args.device)
        except BaseException as e:  # noqa: BLE001 - SystemExit from sage_kern: recorded
            out[f"safesage_guarded:{fam}"] = f"{type(e).__name__}: {e}"
            continue
        out[f"safesage_guarded:{fam}"] = lambda q, k, v, h, i, att=att: comfy_fn(
            q, k, v, h, transformer_options={"block_index": i, "optimized_attention_override": att})
    return out


def rel_l2(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def measure(name, attn, args, x) -> dict:
    from safe_ops.ui import run_stats
    model = Toy(attn, args.heads, args.dim, x.dtype, x.device)
    run_stats.reset()
    eager = model(x)                              # warm-up: plans and verifies
    torch._dynamo.reset()
    ex = torch._dynamo.explain(model)(x)
    op = getattr(getattr(torch.ops, "safesage", None), "attention", None)
    ops = sum(1 for g in ex.graphs for n in g.graph.nodes if op is not None and n.target in (op, op.default))
    reasons: list = []
    for b in ex.break_reasons:
        r = str(b.reason).splitlines()[0][:160]
        if r not in reasons:
            reasons.append(r)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=args.backend)
    got = compiled(x)
    res = {"graphs": ex.graph_count, "graph_breaks": ex.graph_break_count, "attention_calls_per_forward": 2,
           "breaks_per_call": ex.graph_break_count / 2, "safesage_opaque_ops": ops, "break_reasons": reasons[:6],
           "compiled_vs_eager_rel_l2": rel_l2(got, eager), "stats_eager_explain_compiled": {k: v for k, v in run_stats.snapshot().items() if isinstance(v, int)}}
    if x.is_cuda:
        res.update({f"{k}_ms": v for k, v in time_ms({"eager": lambda: model(x), "compiled": lambda: compiled(x)},
                                                     args.reps).items()})
    torch._dynamo.reset()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tag", required=True, help="results name: bench/results/torch_compile_<tag>.json")
    ap.add_argument("--out", help="output JSON (default from --tag)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=56)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--family", action="append", help="sage family for a safesage_guarded arm (repeatable)")
    ap.add_argument("--backend", default=None, help="torch.compile backend (default inductor on cuda, aot_eager on cpu)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--comfy", default=os.environ.get("SS_COMFY") or os.environ.get("COMFYUI_PATH"))
    args = ap.parse_args()
    args.backend = args.backend or ("inductor" if args.device == "cuda" else "aot_eager")
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    from tools.harness import comfy_attention_fn
    comfy_fn, source = comfy_attention_fn.load(args.comfy, args.device == "cpu")
    out_path = args.out or os.path.join(ROOT, "bench", "results", f"torch_compile_{args.tag}.json")
    import importlib.metadata as md
    versions = {}
    for pkg in ("sageattention", "triton"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    result = {"command": command("kernels.gpu_compile"), "tag": args.tag,
              "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, **versions,
              "comfy_attention": source, "shape": {"tokens": args.tokens, "heads": args.heads, "dim": args.dim,
                                                   "dtype": str(dtype)},
              "backend": args.backend, "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "arms": {}}
    x = torch.randn(1, args.tokens, args.heads * args.dim, generator=torch.Generator().manual_seed(1)).to(
        device=args.device, dtype=dtype)
    for name, attn in arms(args, comfy_fn).items():
        if isinstance(attn, str):
            result["arms"][name] = {"skipped": attn}
            continue
        try:
            result["arms"][name] = measure(name, attn, args, x)
        except Exception as e:  # noqa: BLE001 - recorded per arm
            result["arms"][name] = {"error": f"{type(e).__name__}: {str(e)[:400]}",
                                    "traceback": traceback.format_exc()[-2000:]}
        print(name, json.dumps({k: v for k, v in result["arms"][name].items() if k != "traceback"})[:400],
              flush=True)
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", out_path)


if __name__ == "__main__":
    main()
