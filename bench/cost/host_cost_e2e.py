"""host_cost's ``e2e`` section -> ``e2e_small_over_plain``: what the SafeSageAttention node costs a
sampling run (bench/cost/host_cost.py runs it after its set-up, until the deadline its budget leaves).

A 50-block eager H3-shaped model at 4,096 tokens (bench/quality/gpu_quality.py's synthetic stack: 56 heads x 128,
bf16, q/k/v HND views of NHD memory; every block calls ComfyUI's attention function as MiniMax H3 does,
``skip_reshape=True`` with its ``transformer_options``, and sets ``block_index`` on them as Flux does). The
model sits in a real ``comfy.model_patcher.ModelPatcher``; the node arm is that patcher after
``safe_ops.patch.apply_safesage(patcher, Policy())`` -- the SafeSageAttention node's own call, at its
defaults (kernel auto, quality balanced, verify first) -- the plain arm the same patcher without it. A
sampling run goes as ComfyUI's sampler takes it: the model options cloned, the patcher's wrappers merged
into them by ``comfy.sampler_helpers.prepare_model_patcher``, the run inside the OUTER_SAMPLE wrappers and
each step's forward inside the APPLY_MODEL wrappers (``comfy.patcher_extension.WrapperExecutor``), each
step on a copy of the transformer options carrying ``sigmas`` / ``sample_sigmas`` (device tensors).
ComfyUI's attention function and SafeSage's runtime are those bench/cost/host_cost.py sets up (``ctx``:
``--use-sage-attention``'s function, ``--emulate-arch``), so both arms run what an RTX card of that arch
runs. Runs alternate node, plain, node, plain, ... (a warm-up run of each first: JIT, first-call checks,
plans); each step is timed with a device synchronize before and after (wall ms; CUDA events beside it).
The ratio is the median step from step 2 on, node / plain; step 1 (the quality guard's probe) is reported
apart; the spread is the per-pair ratios' range. The runs stop at the deadline once ``--e2e-min-runs``
per arm are done (``--e2e-max-runs`` at most).
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

from bench.quality.gpu_quality import DIM, HEADS, Stack
from bench.cost.host_cost_timing import Timeline, interleave, stats, sync

#: the target ``e2e_small_over_plain`` is held to
TARGET = 1.01
#: the JSON's ``method.e2e``
E2E_METHOD = ("sampling runs alternating node / plain through ComfyUI's ModelPatcher, "
              "prepare_model_patcher and wrapper executors; each step synchronized before "
              "and after (wall ms); median of steps 2..N per arm; step 1 apart")


class BoundRuntime:
    """SafeSage's ``runtime`` answers ``rt`` in every loaded safe_ops module that holds the real function
    (apply_safesage reads it; bench/repro's probe pack does the same inside a server); undone on exit."""

    def __init__(self, rt):
        self.rt, self.changed = rt, []

    def __enter__(self):
        import safe_ops.facts.devices as devices
        real = devices.runtime
        for name, m in list(sys.modules.items()):
            if (name == "safe_ops" or name.startswith("safe_ops.")) and vars(m).get("runtime") is real:
                self.changed.append((m, real))
                m.runtime = lambda device=None: self.rt
        return self

    def __exit__(self, *exc):
        for m, real in self.changed:
            m.runtime = real


class StackModel(torch.nn.Module):
    """The diffusion model of the e2e arms: gpu_quality.Stack's blocks, each block's attention through
    ComfyUI's function as MiniMax H3 calls it (``skip_reshape=True``, its transformer_options), the block
    index set on those options as Flux does."""

    def __init__(self, stack: Stack, attention, blocks: int):
        super().__init__()
        self.stack, self.attention, self.blocks = stack, attention, blocks

    def forward(self, x, transformer_options):
        for i in range(self.blocks):
            transformer_options["block_index"] = i
            q, k, v = self.stack.qkv(i, x)
            o = self.attention(q, k, v, HEADS, mask=None, skip_reshape=True, transformer_options=transformer_options)
            x = x + o.to(x.dtype)
        return x


def sample(patcher, x0, sigmas, dev) -> list:
    """One sampling run of ``patcher``'s model, as ComfyUI's sampler drives it (module docstring); the
    wall ms of each step (synchronized before and after) and its CUDA-event ms."""
    import comfy.model_patcher as cmp
    import comfy.patcher_extension as pe
    import comfy.sampler_helpers as helpers

    opts = cmp.create_model_options_clone(patcher.model_options)
    opts.setdefault("transformer_options", {})
    helpers.prepare_model_patcher(patcher, {}, opts)
    dm = patcher.model.diffusion_model

    def apply_model(x, t, c_concat=None, c_crossattn=None, control=None, transformer_options={}, **kw):
        return dm(x, transformer_options)

    def outer_sample(x, sig):
        steps = []
        for s in range(len(sig) - 1):
            to = opts["transformer_options"].copy()            # calc_cond_batch: one copy per forward
            to["sigmas"], to["sample_sigmas"] = sig[s:s + 1], sig
            run = pe.WrapperExecutor.new_class_executor(apply_model, patcher.model,
                                                        pe.get_all_wrappers(pe.WrappersMP.APPLY_MODEL, to))
            sync(dev)
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if dev.type == "cuda" else None
            t0 = time.perf_counter()
            if ev:
                ev[0].record()
            out = run.execute(x, sig[s:s + 1], None, None, None, to)
            if ev:
                ev[1].record()
            sync(dev)
            steps.append(((time.perf_counter() - t0) * 1e3, ev[0].elapsed_time(ev[1]) if ev else None))
            del out
        return steps

    outer = pe.get_all_wrappers(pe.WrappersMP.OUTER_SAMPLE, opts, is_model_options=True)
    return pe.WrapperExecutor.new_class_executor(outer_sample, None, outer).execute(x0, sigmas)


def e2e_section(ctx, a, tl: Timeline, deadline: float) -> dict:
    import comfy.model_patcher as cmp
    from safe_ops.patch import apply_safesage
    from safe_ops.policy import Policy
    from safe_ops.ui import run_stats

    dev, dt = ctx["dev"], ctx["dt"]
    stack = Stack(0, a.blocks, [1] * a.blocks, dev, dt)         # no outlier block: the steady state keeps its plan
    base = torch.nn.Module()
    base.diffusion_model = StackModel(stack, ctx["comfy"]["fn"], a.blocks)
    plain = cmp.ModelPatcher(base, dev, dev)
    with BoundRuntime(ctx["rt"]):
        node, summary = apply_safesage(plain, Policy())           # the SafeSageAttention node at its defaults
    x0 = torch.randn(1, a.tokens, HEADS * DIM, generator=torch.Generator().manual_seed(100)).to(dev, dt)
    sigmas = torch.linspace(1.0, 0.0, a.steps + 1, device=dev)
    arms = {"node": node, "plain": plain}
    for name, p in arms.items():                                 # JIT, first-call checks, plans: untimed
        w = sample(p, x0, sigmas[[0, a.steps // 2, a.steps]], dev)
        tl.mark(f"e2e: warm-up run of {name} (2 steps): {[round(s[0], 1) for s in w]} ms")
    plans = run_stats.snapshot().get("plans")                    # made at the warm-up (a plan is said once)
    run_stats.reset()
    runs: dict = {k: [] for k in arms}
    gpu: dict = {k: [] for k in arms}
    quality = []

    def one(name):
        def go():
            steps = sample(arms[name], x0, sigmas, dev)
            runs[name].append([s[0] for s in steps])
            if steps[0][1] is not None:
                gpu[name].append([s[1] for s in steps])
            if name == "node":
                q = run_stats.snapshot().get("quality_last_run") or {}
                blocks = (q.get("choices") or {}).get("blocks") or []
                quality.append({"summary": q.get("summary"), "blocks": len(blocks),
                                "moved": [b["block"] for b in blocks if b.get("moved")]})
            return None
        return go

    interleave({k: one(k) for k in arms}, a.e2e_min_runs, a.e2e_max_runs, deadline, clock=lambda: tl.now())
    tl.mark(f"e2e: {len(runs['node'])} runs per arm of {a.steps} steps")
    res = e2e_summary(runs, "node", "plain")
    snap = run_stats.snapshot()
    out = {"tokens": a.tokens, "blocks": a.blocks, "steps_per_run": a.steps, "runs_per_arm": len(runs["node"]),
           "order": "node, plain, node, plain, ... (one sampling run each), after one untimed warm-up run of each",
           "e2e_small_over_plain": res["ratio"], "target": TARGET,
           "meets_target": res["ratio"] <= TARGET, **res,
           "runs_ms": {k: [[round(t, 2) for t in r] for r in v] for k, v in runs.items()},
           "cuda_event_steps_from_2_ms": {k: stats([t for r in v for t in r[1:]]) for k, v in gpu.items() if v},
           "node_status": summary.get("text", "").splitlines(), "quality_runs": quality,
           "ran": {"plans_at_warm_up": plans, "attention_calls": snap.get("attention_calls"),
                   "fallbacks": snap.get("fallbacks"), "fallback_reasons": snap.get("fallback_reasons"),
                   "quality": snap.get("quality"), "forwards": snap.get("forwards")}}
    return out


def e2e_summary(runs: dict, num: str, den: str) -> dict:
    """From per-run step times ({arm: [[step1_ms, step2_ms, ...], ...]}, runs paired by index): the
    median step from step 2 on per arm, their ratio (``num`` / ``den``) with the range of the per-pair
    ratios, and step 1 apart."""
    rest = {k: [t for r in v for t in r[1:]] for k, v in runs.items()}
    first = {k: [r[0] for r in v] for k, v in runs.items()}
    per_pair = [statistics.median(a[1:]) / statistics.median(b[1:]) for a, b in zip(runs[num], runs[den])]
    return {"ratio": round(statistics.median(rest[num]) / statistics.median(rest[den]), 4),
            "per_pair": [round(min(per_pair), 4), round(max(per_pair), 4)], "pairs": len(per_pair),
            "steps_from_2_ms": {k: stats(v) for k, v in rest.items()},
            "step1_ms": {k: stats(v) for k, v in first.items()},
            "step1_over_median_step": {k: round(statistics.median(first[k]) / statistics.median(rest[k]), 4)
                                       for k in runs},
            "step1_extra_ms": round(statistics.median(first[num]) - statistics.median(first[den]), 2),
            "per_step_ratio": [round(statistics.median(a[i] for a in runs[num]) /
                                     statistics.median(b[i] for b in runs[den]), 4)
                               for i in range(min(len(r) for r in runs[num] + runs[den]))]}
