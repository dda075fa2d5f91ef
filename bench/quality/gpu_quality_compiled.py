"""The quality guard on a torch.compile'd H3-shaped stack with real kernels (issue #36 point 2; device only).

bench/quality/gpu_quality.py's stack (H3's shape: 56 heads x 128, bf16; q/k RMS-normalised per head; the
outlier blocks with 4 of 128 q/k channels scaled up) as one ``torch.nn.Module`` compiled with
``torch.compile`` (``--backend``, default inductor, as TorchCompileModel's default), each block's
attention called through ComfyUI's own wrapped attention_pytorch with SafeSage's override in
``transformer_options`` -- the path ComfyUI's layers take. Each step starts the way SafeSage's
APPLY_MODEL wrapper starts a model evaluation under TorchCompileModel: eagerly, outside the compiled
module (``QualityGuard.forward_start`` with ComfyUI's ``sigmas`` / ``sample_sigmas``), then the
compiled module runs. Recorded per sage family (kernels: that family, then comfy-kitchen -- the
emulated RTX order of bench/quality/gpu_quality.py):

* ``graph_breaks``, ``breaks_per_call`` (breaks / attention calls per forward, torch._dynamo.explain)
  and ``safesage_opaque_ops`` in the graphs;
* the guard: ``probes`` (step 1), ``blocks_moved`` and each block's choice, ``moved_calls`` (step 2);
* ``compiled_vs_eager_rel_l2``: step 2's compiled output against the same guard run eagerly.

    COMFYUI_PATH=$SS_COMFY PYTHONPATH=$PYTHONPATH:$SS_COMFY python3 -m bench.quality.gpu_quality_compiled --families sage1_triton \\
        --out bench/results/quality_compiled_sage106_h100.json

ComfyUI's attention function as in bench/quality/gpu_quality.py: the tree $COMFYUI_PATH names, from PYTHONPATH.
"""
from __future__ import annotations

import argparse
import json

import torch

from bench.common.benchutil import env_info
from bench.quality.gpu_quality import EMULATED_ORDER, HEADS, Stack, outlier_factors, rel, timed


class Compiled(torch.nn.Module):
    """The stack as one module (what TorchCompileModel compiles is the diffusion model)."""

    def __init__(self, stack: Stack, attend):
        super().__init__()
        self.stack, self.attend = stack, attend

    def forward(self, x):
        return self.stack.run(x, self.attend)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--outliers-from", type=int, default=6)
    ap.add_argument("--factors", default="32")
    ap.add_argument("--families", default="sage1_triton")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--quality", default="balanced")
    ap.add_argument("--emulate-arch", default=None, metavar="smNNN",
                    help="SafeSage's runtime as on that arch (benchutil.emulated_runtime), e.g. sm120 for sage2_fp8pv_perwarp")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (SAFESAGE_EXTRA_FAMILIES=fake_quality_families)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    from safe_ops.attention.override import SafeAttention
    from safe_ops.facts.devices import runtime
    from safe_ops.families.registry import kernel_of
    from safe_ops.policy import Policy
    from safe_ops.quality import guard as qguard
    from safe_ops.ui import run_stats
    from tools.harness.comfy_attention_fn import attention

    dev = torch.device(a.device)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rt = runtime()
    if a.emulate_arch:
        from bench.common.benchutil import emulated_runtime
        rt = emulated_runtime(a.emulate_arch, real=rt)
    comfy_fn, comfy_label = attention()            # ComfyUI's wrap_attn-wrapped attention_pytorch
    ck = kernel_of(rt.ck_family)
    factors = outlier_factors(a.blocks, a.outliers_from, [int(f) for f in a.factors.split(",")])
    sched = torch.tensor([1.0, 0.5, 0.0], device=dev)
    stack = Stack(0, a.blocks, factors, dev, dt)
    x0 = torch.randn(1, a.tokens, HEADS * 128, generator=torch.Generator().manual_seed(100)).to(dev, dt)
    result = {**env_info("quality.gpu_quality_compiled"), "tokens": a.tokens, "blocks": a.blocks, "outlier_factors": factors,
              "backend": a.backend, "quality": a.quality, "emulated_arch": a.emulate_arch, "comfy_function": comfy_label,
              "emulated_order": EMULATED_ORDER, "ck_family": ck.family if ck else None, "families": {}}

    def attend_with(att):
        def attend(i, q, k, v):
            return comfy_fn(q, k, v, HEADS, skip_reshape=True, skip_output_reshape=True,
                            transformer_options={"block_index": i, "optimized_attention_override": att})
        return attend

    def step(att, run, sigma_index):
        att.quality.forward_start({"sigmas": sched[sigma_index:sigma_index + 1], "sample_sigmas": sched})
        return timed(lambda: run(x0))

    for fam in a.families.split(","):
        kern = kernel_of(fam)
        if kern is None:
            result["families"][fam] = {"skipped": f"{fam} is not installed here ({rt.sage_error})"}
            continue
        kernels = [kern] + ([ck] if ck is not None else [])
        # eager: the same guard, uncompiled (the outputs to compare with)
        eager_att = SafeAttention(Policy(kernel="sage", quality=a.quality), kernels=kernels, rt=rt)
        model = Compiled(stack, attend_with(eager_att))
        step(eager_att, model, 0)
        eager_out, eager_ms = step(eager_att, model, 1)
        qguard.run_ended()
        # compiled
        att = SafeAttention(Policy(kernel="sage", quality=a.quality), kernels=kernels, rt=rt)
        model = Compiled(stack, attend_with(att))
        torch._dynamo.reset()
        ex = torch._dynamo.explain(model)(x0)
        op = getattr(getattr(torch.ops, "safesage", None), "attention", None)
        ops = sum(1 for g in ex.graphs for n in g.graph.nodes if op is not None and n.target in (op, op.default))
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=a.backend)
        compiled(x0)                                    # compiles (outside a sampling run: as planned)
        qguard.run_ended()
        run_stats.reset()
        _, step1_ms = step(att, compiled, 0)            # measures
        out, step2_ms = step(att, compiled, 1)          # runs the choices
        qguard.run_ended()
        rep = run_stats.snapshot()
        choices = (rep.get("quality_last_run") or {}).get("choices") or {}
        q = rep.get("quality") or {}
        result["families"][fam] = {
            "graphs": ex.graph_count, "graph_breaks": ex.graph_break_count,
            "breaks_per_call": ex.graph_break_count / a.blocks, "safesage_opaque_ops": ops,
            "break_reasons": sorted({str(b.reason).splitlines()[0][:160] for b in ex.break_reasons})[:6],
            "probes": q.get("probes"), "blocks_moved": q.get("blocks_moved"), "moved_calls": q.get("moved_calls"),
            "plan_changes": q.get("plan_changes"), "attention_calls": rep.get("attention_calls"),
            "lines": choices.get("lines"),
            "blocks": [{"block": c["block"], "outlier_factor": factors[c["block"]], "planned": c["planned"],
                        "planned_error": c["planned_error"], "target": c["target"], "family": c["family"],
                        "moved": c["moved"]} for c in choices.get("blocks", [])],
            "compiled_vs_eager_rel_l2": round(rel(out, eager_out), 6),
            "step1_ms": round(step1_ms, 1), "step2_ms": round(step2_ms, 1), "eager_step2_ms": round(eager_ms, 1)}
        print(fam, json.dumps({k: v for k, v in result["families"][fam].items() if k != "blocks"}), flush=True)
        torch._dynamo.reset()
        del compiled, model, att, eager_att
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
