"""The quality guard on an H3-shaped 50-block attention stack (issue #28's bench; device only).

Each block: the hidden state x [1, S, 56*128] (bf16), RMS-normalised (H3's norm1) -> per-head q/k/v
by three fixed random 128x128 maps, q and k RMS-normalised per head (as H3's qk norm), then in the outlier blocks 4 of the 128 q/k
channels scaled by the outlier factor (H3's late blocks, issue #28); attention; x += its output.
q/k/v are HND views of NHD memory, as H3 hands them to ComfyUI (skip_reshape=True).

Arms per seed, all through SafeSage's own code path (``SafeAttention`` with ComfyUI's
attention_pytorch as ComfyUI's function where $COMFYUI_PATH has one) in one process:

* ``fp32``: the stack with float32 SDPA (the reference of every final-output error);
* ``sdpa_only``: ComfyUI's own attention for every block (kernel=sdpa);
* ``kitchen_only``: comfy-kitchen int8_attention for every block (quality "faults only");
* ``sage_only`` per sage family: that family for every block (quality "faults only");
* the guard per sage family: kernel=sage with [that family, comfy-kitchen] -- the emulated RTX order
  "sage > comfy-kitchen > ComfyUI's own" -- quality ``balanced`` (or ``--quality``): step 1 (measures),
  step 2 (runs the choices). Per block: index, outlier factor, the family chosen, its error, the sage
  error and the target, as the guard measured them (rel. L2 against ComfyUI's own attention on 1,024
  sampled rows); the stack's final-output error of step 2 and its time; the probe's cost
  (step 1 minus sage-only's step, both timed here) as ``probe_overhead_fraction`` =
  probe ms / (30 x step ms).

The sage families are the ones a user's GPU dispatches to: sage 1.0.6 (``sage1_triton``), sage 2.2.0's
sm_120 path (``sage2_fp8pv_perwarp``, RTX 50xx) and sm_89 path (``sage2_sm89_fp8pv``, RTX 40xx); sage 1
and 2 are one package name, so each installation is its own process (``--families``).

    export COMFYUI_PATH=$SS_COMFY       # after `source bench/device_setup.sh; ss_base`
    PYTHONPATH=$PYTHONPATH:$SS_COMFY python3 -m bench.quality.gpu_quality --families sage2_fp8pv_perwarp,sage2_sm89_fp8pv --out bench/results/quality_guard_sage22_h200.json
    PYTHONPATH=$PYTHONPATH:$SS_COMFY python3 -m bench.quality.gpu_quality --families sage1_triton --out bench/results/quality_guard_sage106_h200.json
    PYTHONPATH=$PYTHONPATH:$SS_COMFY python3 -m bench.quality.gpu_quality --cost-only --tokens 169000 --blocks 8 --families sage2_fp8pv_perwarp --out ...

ComfyUI's attention_pytorch is that of the tree $COMFYUI_PATH names, imported from PYTHONPATH
(tools/harness/comfy_attention_fn.py: an error when PYTHONPATH imports no ComfyUI or another one);
without COMFYUI_PATH the stand-in with its contract. ``comfy_function`` in the JSON says which.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from bench.common.benchutil import env_info

HEADS, DIM = 56, 128
OUTLIER_CHANNELS = 4
STEPS_PER_RUN = 30
EMULATED_ORDER = ("the sage family > comfy-kitchen int8_attention > ComfyUI's own attention: the order on an "
                  "RTX 40xx/50xx card (issue #28: sage ~2-2.5x SDPA there), given to SafeSage as kernel=sage "
                  "with the kernels in that order; on the H200 itself SDPA is fastest")


def outlier_factors(blocks: int, first: int, factors: list[int]) -> list[int]:
    """1 for a benign block; blocks ``first``.. cycle through ``factors`` in equal runs."""
    n = blocks - first
    out = [1] * blocks
    for j in range(n):
        out[first + j] = factors[min(j * len(factors) // max(n, 1), len(factors) - 1)]
    return out


class Stack:
    """The block maps of one seed (see the module docstring)."""

    def __init__(self, seed: int, blocks: int, factors: list[int], dev, dt=torch.bfloat16):
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.w = [[(torch.randn(DIM, DIM, generator=g) / DIM ** 0.5).to(dev, dt) for _ in range(3)]
                  for _ in range(blocks)]
        self.chan = [torch.randperm(DIM, generator=g)[:OUTLIER_CHANNELS].to(dev) for _ in range(blocks)]
        self.factors = factors

    def qkv(self, i: int, x: torch.Tensor):
        S = x.shape[1]
        h = torch.nn.functional.rms_norm(x, (x.shape[-1],)).view(1, S, HEADS, DIM)    # H3's norm1
        q, k, v = (h @ w for w in self.w[i])
        q, k = (torch.nn.functional.rms_norm(t, (DIM,)) for t in (q, k))
        f = self.factors[i]
        if f != 1:
            scale = torch.ones(DIM, device=x.device, dtype=x.dtype)
            scale[self.chan[i]] = float(f)
            q, k = q * scale, k * scale
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)     # HND views of NHD memory

    def run(self, x0: torch.Tensor, attend, before=None) -> torch.Tensor:
        x = x0.clone()
        for i in range(len(self.w)):
            if before is not None:
                before(i)
            q, k, v = self.qkv(i, x)
            o = attend(i, q, k, v)                       # HND [1, H, S, D]
            x = x + o.transpose(1, 2).reshape(x.shape).to(x.dtype)
        return x


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    return out, (time.perf_counter() - t0) * 1e3


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=38000)
    ap.add_argument("--blocks", type=int, default=50)
    ap.add_argument("--outliers-from", type=int, default=40)
    ap.add_argument("--factors", default="16,32")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--families", default="sage2_fp8pv_perwarp,sage2_sm89_fp8pv")
    ap.add_argument("--quality", default="balanced")
    ap.add_argument("--cost-only", action="store_true", help="only the probe's cost (no fp32 / baseline arms)")
    ap.add_argument("--ref-cache", default="/tmp/safesage_quality_ref", help="fp32 final outputs, per seed")
    ap.add_argument("--no-baselines", action="store_true", help="no sdpa_only / kitchen_only arms")
    ap.add_argument("--kitchen", default=None, help="the comfy-kitchen family (default: the installed one)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run with the tests' fake families")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import safe_ops.quality.targets as targets
    from safe_ops.attention.override import SafeAttention
    from safe_ops.facts.devices import runtime
    from safe_ops.families.registry import kernel_of
    from safe_ops.policy import Policy
    from safe_ops.quality import guard as qguard
    from safe_ops.ui import run_stats
    from tools.harness.comfy_attention_fn import attention

    dev = torch.device(a.device)
    dt = getattr(torch, a.dtype)
    rt = runtime()
    comfy_fn, comfy_label = attention()
    comfy_fn = getattr(comfy_fn, "__wrapped__", comfy_fn)
    ck = kernel_of(a.kitchen or rt.ck_family)
    factors = outlier_factors(a.blocks, a.outliers_from, [int(f) for f in a.factors.split(",")])
    sched = torch.tensor([1.0, 0.5, 0.0])
    result = {**env_info("quality.gpu_quality"), "tokens": a.tokens, "blocks": a.blocks, "heads": HEADS, "head_dim": DIM,
              "outlier_factors": factors, "outlier_channels": OUTLIER_CHANNELS, "quality": a.quality,
              "balanced_factor": targets.BALANCED_FACTOR, "strict_error": targets.STRICT_ERROR,
              "comfy_function": comfy_label, "emulated_order": EMULATED_ORDER, "ck_family": ck.family if ck else None,
              "runs": [], "arms": {}}

    def attend_with(att):
        def attend(i, q, k, v):
            return att(comfy_fn, q, k, v, HEADS, skip_reshape=True, skip_output_reshape=True,
                       transformer_options={"block_index": i})
        return attend

    def step(att, x0, stack, sigma):
        att.quality.forward_start({"sigmas": torch.tensor([sigma], device=dev), "sample_sigmas": sched})
        return timed(lambda: stack.run(x0, attend_with(att)))

    warm_stack = Stack(99, 2, [1, factors[-1]], dev, dt)
    warm_x = torch.randn(1, 4096, HEADS * DIM).to(dev, dt)

    def warm(att):
        """Every kernel an arm runs, once, on a 2-block 4,096-token stack (the sm_89 PTX is JIT-compiled
        on the H200 at first use): the timed steps below pay none of it."""
        step(att, warm_x, warm_stack, 1.0)
        step(att, warm_x, warm_stack, 0.5)
        qguard.run_ended()

    for seed in [int(s) for s in a.seeds.split(",")]:
        stack = Stack(seed, a.blocks, factors, dev, dt)
        x0 = torch.randn(1, a.tokens, HEADS * DIM, generator=torch.Generator().manual_seed(100 + seed)).to(dev, dt)
        arms = result["arms"].setdefault(str(seed), {})
        ref = None
        if not a.cost_only:
            path = os.path.join(a.ref_cache, f"fp32_{a.tokens}_{a.blocks}_{a.factors}_{seed}.pt")
            if os.path.exists(path):
                ref = torch.load(path).to(dev)
                arms["fp32"] = {"ms": None, "cached": path}
            else:
                from torch.nn.attention import SDPBackend, sdpa_kernel

                def fp32(i, q, k, v):
                    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION if dev.type == "cuda" else SDPBackend.MATH):
                        return torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
                ref, ms = timed(lambda: stack.run(x0, fp32))      # the same bf16 stack, attention in fp32
                arms["fp32"] = {"ms": round(ms, 1)}
                os.makedirs(a.ref_cache, exist_ok=True)
                torch.save(ref.cpu(), path)
            baselines = {} if a.no_baselines else {"sdpa_only": (Policy(kernel="sdpa", quality="faults only"), None)}
            if ck is not None and not a.no_baselines:
                baselines["kitchen_only"] = (Policy(kernel="sage", quality="faults only"), [ck])
            for name, (pol, kernels) in baselines.items():
                att = SafeAttention(pol, kernels=kernels, rt=rt)
                warm(att)
                out, ms = step(att, x0, stack, 1.0)
                arms[name] = {"ms": round(ms, 1), "final_error": round(rel(out, ref), 5)}
                qguard.run_ended()
        for fam in a.families.split(","):
            kern = kernel_of(fam)
            if kern is None:
                result.setdefault("missing", []).append(fam)
                continue
            plain = SafeAttention(Policy(kernel="sage", quality="faults only"), kernels=[kern], rt=rt)
            warm(plain)
            out, sage_ms = step(plain, x0, stack, 1.0)
            qguard.run_ended()
            if ref is not None:
                arms[f"sage_only:{fam}"] = {"ms": round(sage_ms, 1), "final_error": round(rel(out, ref), 5)}
            kernels = [kern] + ([ck] if ck is not None else [])
            guard = SafeAttention(Policy(kernel="sage", quality=a.quality), kernels=kernels, rt=rt)
            warm(guard)
            run_stats.reset()
            _, step1_ms = step(guard, x0, stack, 1.0)                 # measures
            out, step2_ms = step(guard, x0, stack, 0.5)               # runs the choices
            qguard.run_ended()
            rep = run_stats.snapshot()
            choices = (rep.get("quality_last_run") or {}).get("choices") or {}
            # ComfyUI's own attention is the reference the guard measures against: its error is 0 there
            blocks = [{"index": c["block"], "outlier_factor": factors[c["block"]], "family": c["family"],
                       "error": c["error"] if c["family"] != "sdpa" else 0.0, "candidates": c.get("candidates"), "sage_family": fam, "sage_error": c["planned_error"],
                       "target": c["target"], "moved": c["moved"], "why": c["why"]}
                      for c in choices.get("blocks", [])]
            probe_ms = max(step1_ms - sage_ms, 0.0)
            run = {"seed": seed, "sage_family": fam, "blocks": blocks, "lines": choices.get("lines"),
                   "step1_ms": round(step1_ms, 1), "step2_ms": round(step2_ms, 1), "sage_only_ms": round(sage_ms, 1),
                   "probe_ms": round(probe_ms, 1),
                   "probe_overhead_fraction": round(probe_ms / (STEPS_PER_RUN * sage_ms), 6),
                   "quality_stats": rep.get("quality"), "command": result["command"]}
            if ref is not None:
                run["final_error"] = round(rel(out, ref), 5)
                run["sage_only_final_error"] = arms[f"sage_only:{fam}"]["final_error"]
            result["runs"].append(run)
            print(json.dumps({k: run[k] for k in ("seed", "sage_family", "lines", "probe_overhead_fraction")}
                             | {"final_error": run.get("final_error")}), flush=True)
            del plain, guard
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result["arms"], indent=1))


if __name__ == "__main__":
    main()
