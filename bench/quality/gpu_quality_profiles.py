"""The quality guard under the node's defaults on drift profiles beyond the bench's own (issue #37 point 3; device only).

bench/quality/gpu_quality.py's H3-shaped stack (56 heads x 128, bf16), its drift laid out by a profile:

* ``default``   today's layout: blocks 40-49 of 50 drift (4 of 128 q/k channels x16, then x32);
* ``majority``  blocks 20-49 drift (x16, then x32): most of the run's blocks;
* ``gradual``   the factor rises block by block from 1 (block 10) to 32 (block 49), geometrically;
* ``heads``     blocks 40-49, x32, in 4 of the 56 heads only;
* ``keys``      blocks 40-49, x32, in the keys only (queries untouched);
* ``majority_informative``  blocks 10-49 drift at :data:`INFORMATIVE_FACTOR` (x8): most of the run's
  blocks, while the SDPA-only stack stays informative (final error under 0.1; ``majority``'s x16/x32
  on 30 blocks puts it at 0.31). bench.quality.quality_budget checks that bound on the GPU.

Arms per profile and sage path, in one process: ``fp32`` (the reference: the same stack, attention in
float32), ``sdpa_only`` (ComfyUI's own for every block), ``kitchen_only`` (comfy-kitchen int8_attention
for every block), ``sage_only`` (the sage path for every block, SafeSage with quality "faults only"),
and ``guard``: SafeSage at the node's defaults -- ``kernel=auto``, ``quality=balanced`` -- on the
emulated user GPU (``--emulate-arch``: SafeSage's runtime and sage 2.2's own dispatch read that arch),
with ComfyUI's function the one ComfyUI hands the override when started with ``--use-sage-attention``
(its attention_sage): step 1 measures, step 2 runs the choices. Per block: the planned family, its
error, the target, where it moved. Per arm: the stack's final-output rel. L2 against fp32 (step 2
for the guard) and the step's ms; ``guard_over_sage_step`` = guard step 2 ms / sage_only ms.

    python3 -m bench.quality.gpu_quality_profiles --emulate-arch sm120 --tokens 16384 --out bench/results/quality_guard_profiles_h100.json

One process per sage path (sage 1 and 2 are one package name); ``--merge`` joins the paths' JSONs into
the one result, ``profiles[name][path]`` (CPU):

    python3 -m bench.quality.gpu_quality_profiles --merge sage106_sm89=A.json sage22_sm120=B.json --repo-rev REV \
        --out bench/results/quality_guard_profiles_h100.json
"""
from __future__ import annotations

import argparse
import json

import torch

from bench.common.benchutil import emulate_dispatch, emulated_runtime, env_info
from bench.quality.gpu_quality import DIM, HEADS, OUTLIER_CHANNELS, rel, timed

PROFILES = ("default", "majority", "gradual", "heads", "keys", "majority_informative")
#: ``majority_informative``'s factor (module docstring)
INFORMATIVE_FACTOR = 8


def profile_blocks(name: str, blocks: int, heads: int = HEADS, factor: float | None = None) -> list[dict]:
    """Per block: ``factor`` (1: benign), ``heads`` (None: all) and ``keys_only``. ``heads``: the
    stack's heads (the ``heads`` profile drifts 4 of them); ``factor``: ``majority_informative``'s, if
    not :data:`INFORMATIVE_FACTOR`."""
    spec = [{"factor": 1, "heads": None, "keys_only": False} for _ in range(blocks)]

    def span(first, factors, **kw):
        n = blocks - first
        for j in range(n):
            spec[first + j].update(factor=factors[min(j * len(factors) // n, len(factors) - 1)], **kw)

    if name == "default":
        span(blocks * 4 // 5, [16, 32])
    elif name == "majority":
        span(blocks * 2 // 5, [16, 32])
    elif name == "gradual":
        first = blocks // 5
        for j, i in enumerate(range(first, blocks)):
            spec[i]["factor"] = round(32 ** (j / max(blocks - 1 - first, 1)), 2)
    elif name == "heads":
        span(blocks * 4 // 5, [32], heads=(0, 19, 37, 55) if heads == HEADS else (0, heads // 3, 2 * heads // 3, heads - 1))
    elif name == "keys":
        span(blocks * 4 // 5, [32], keys_only=True)
    elif name == "majority_informative":
        span(blocks // 5, [INFORMATIVE_FACTOR if factor is None else factor])
    else:
        raise SystemExit(f"unknown profile {name!r} (one of {', '.join(PROFILES)})")
    return spec


class ProfileStack:
    """gpu_quality.Stack's blocks with a profile's drift (see the module docstring)."""

    def __init__(self, seed: int, spec: list[dict], dev, dt=torch.bfloat16, heads: int = HEADS, dim: int = DIM):
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.heads, self.dim = heads, dim
        self.w = [[(torch.randn(dim, dim, generator=g) / dim ** 0.5).to(dev, dt) for _ in range(3)] for _ in spec]
        self.chan = [torch.randperm(dim, generator=g)[:OUTLIER_CHANNELS].to(dev) for _ in spec]
        self.spec = spec

    def qkv(self, i: int, x: torch.Tensor):
        S, H, D = x.shape[1], self.heads, self.dim
        h = torch.nn.functional.rms_norm(x, (x.shape[-1],)).view(1, S, H, D)
        q, k, v = (h @ w for w in self.w[i])
        q, k = (torch.nn.functional.rms_norm(t, (D,)) for t in (q, k))
        s = self.spec[i]
        if s["factor"] != 1:
            scale = torch.ones(H, D, device=x.device, dtype=x.dtype)
            for h in (s["heads"] if s["heads"] is not None else range(H)):
                scale[h, self.chan[i]] = float(s["factor"])
            k = k * scale
            if not s["keys_only"]:
                q = q * scale
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def run(self, x0: torch.Tensor, attend) -> torch.Tensor:
        x = x0.clone()
        for i in range(len(self.w)):
            q, k, v = self.qkv(i, x)
            o = attend(i, q, k, v)
            x = x + o.transpose(1, 2).reshape(x.shape).to(x.dtype)
        return x


def merge(named: list[str], repo_rev: str | None, note: str | None) -> dict:
    """``path=JSON`` items (one process's result each) as one result: ``paths[path]`` its run's fields,
    ``profiles[name][path]`` its profiles."""
    doc: dict = {"harness": "bench.quality.gpu_quality_profiles", "repo_rev": repo_rev, "note": note, "paths": {},
                 "profiles": {}}
    for item in named:
        path, _, fname = item.partition("=")
        if not fname:
            raise SystemExit(f"--merge takes PATH=JSON items, not {item!r}")
        with open(fname) as f:
            run = json.load(f)
        doc["paths"][path] = {k: v for k, v in run.items() if k != "profiles"}
        for name, prof in run["profiles"].items():
            doc["profiles"].setdefault(name, {})[path] = prof
    first = next(iter(doc["paths"].values()), {})
    for key in ("gpu", "tokens", "blocks", "seed", "policy"):
        doc[key] = first.get(key)
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--merge", nargs="+", metavar="PATH=JSON", help="join per-path results (no GPU)")
    ap.add_argument("--repo-rev", default=None, help="with --merge: the pack's revision the runs ran")
    ap.add_argument("--note", default=None, help="with --merge: a note for the result")
    ap.add_argument("--profiles", default=",".join(PROFILES))
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--blocks", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--emulate-arch", default="sm120", help="the user's GPU arch SafeSage and sage dispatch for")
    ap.add_argument("--comfy-sage", action=argparse.BooleanOptionalAction, default=True,
                    help="ComfyUI started with --use-sage-attention (its attention_sage is the function handed in)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.merge:
        with open(a.out, "w") as fh:
            json.dump(merge(a.merge, a.repo_rev, a.note), fh, indent=1)
        print("wrote", a.out)
        return

    import comfy.ldm.modules.attention as comfy_att
    from safe_ops.attention.override import SafeAttention
    from safe_ops.families.registry import kernel_of
    from safe_ops.policy import Policy
    from safe_ops.quality import guard as qguard
    from safe_ops.ui import run_stats

    dev, dt = torch.device("cuda"), torch.bfloat16
    real_arch = emulate_dispatch(a.emulate_arch)
    rt = emulated_runtime(a.emulate_arch)
    own = getattr(comfy_att.attention_pytorch, "__wrapped__", comfy_att.attention_pytorch)
    sage_fn = getattr(comfy_att.attention_sage, "__wrapped__", comfy_att.attention_sage)
    func = sage_fn if a.comfy_sage else own
    ck = kernel_of(rt.ck_family)
    sage = kernel_of(rt.sage_family)
    sched = torch.tensor([1.0, 0.5, 0.0], device=dev)
    result = {**env_info("quality.gpu_quality_profiles"), "emulated_arch": a.emulate_arch, "real_arch": real_arch,
              "tokens": a.tokens, "blocks": a.blocks, "seed": a.seed,
              "policy": {"kernel": "auto", "quality": "balanced",
                         "comfy_flag": "--use-sage-attention" if a.comfy_sage else None},
              "sage_family": rt.sage_family, "ck_family": rt.ck_family, "profiles": {}}

    def attend_with(att, f):
        def attend(i, q, k, v):
            return att(f, q, k, v, HEADS, skip_reshape=True, skip_output_reshape=True,
                       transformer_options={"block_index": i})
        return attend

    def step(att, stack, x0, f, sigma_index):
        att.quality.forward_start({"sigmas": sched[sigma_index:sigma_index + 1], "sample_sigmas": sched})
        return timed(lambda: stack.run(x0, attend_with(att, f)))

    x0 = torch.randn(1, a.tokens, HEADS * DIM, generator=torch.Generator().manual_seed(100 + a.seed)).to(dev, dt)
    for name in a.profiles.split(","):
        spec = profile_blocks(name, a.blocks)
        stack = ProfileStack(a.seed, spec, dev, dt)
        prof = result["profiles"][name] = {"factors": [s["factor"] for s in spec],
                                           "heads": spec[-1]["heads"], "keys_only": spec[-1]["keys_only"], "arms": {}}

        def fp32(i, q, k, v):
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
        ref, ms = timed(lambda: stack.run(x0, fp32))
        prof["arms"]["fp32"] = {"ms": round(ms, 1)}
        arms = {"sdpa_only": (Policy(kernel="sdpa", quality="faults only"), None, own)}
        if ck is not None:
            arms["kitchen_only"] = (Policy(kernel="sage", quality="faults only"), [ck], own)
        if sage is not None:
            arms["sage_only"] = (Policy(kernel="sage", quality="faults only"), [sage], own)
        for arm, (pol, kernels, f) in arms.items():
            att = SafeAttention(pol, kernels=kernels, rt=rt)
            step(att, stack, x0, f, 0)                      # warm-up (first-call checks, PTX JIT)
            out, ms = step(att, stack, x0, f, 0)
            qguard.run_ended()
            prof["arms"][arm] = {"ms": round(ms, 1), "final_error": round(rel(out, ref), 5)}
        att = SafeAttention(Policy(kernel="auto", quality="balanced"), rt=rt)     # the node's defaults
        prof["move_order"] = att.quality_order(func)
        step(att, stack, x0, func, 0)                       # warm-up run (its own choices, discarded)
        step(att, stack, x0, func, 1)
        qguard.run_ended()
        run_stats.reset()
        _, step1_ms = step(att, stack, x0, func, 0)         # measures
        out, step2_ms = step(att, stack, x0, func, 1)       # runs the choices
        qguard.run_ended()
        rep = run_stats.snapshot()
        choices = (rep.get("quality_last_run") or {}).get("choices") or {}
        blocks = [{"block": c["block"], "factor": spec[c["block"]]["factor"], "planned": c["planned"],
                   "planned_error": c["planned_error"], "target": c["target"], "family": c["family"],
                   "error": c["error"], "moved": c["moved"], "candidates": c.get("candidates")}
                  for c in choices.get("blocks", [])]
        moved = [b for b in blocks if b["moved"]]
        sage_ms = prof["arms"].get("sage_only", {}).get("ms")
        prof["guard"] = {"final_error": round(rel(out, ref), 5), "step1_ms": round(step1_ms, 1),
                         "step2_ms": round(step2_ms, 1), "lines": choices.get("lines"),
                         "blocks_moved": len(moved), "moved_to": sorted({b["family"] for b in moved}),
                         "benign_moved": sum(1 for b in moved if b["factor"] == 1),
                         "drifting_kept": sum(1 for b in blocks if b["factor"] != 1 and not b["moved"]),
                         "guard_over_sage_step": round(step2_ms / sage_ms, 4) if sage_ms else None,
                         "quality_stats": rep.get("quality"), "blocks": blocks}
        print(name, json.dumps({k: v for k, v in prof["guard"].items() if k not in ("blocks", "quality_stats")}),
              json.dumps({k: v.get("final_error") for k, v in prof["arms"].items()}), flush=True)
        with open(a.out, "w") as fh:
            json.dump(result, fh, indent=1)
        del att
        torch.cuda.empty_cache()
    print("wrote", a.out)


if __name__ == "__main__":
    main()
