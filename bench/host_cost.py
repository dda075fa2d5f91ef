"""What SafeSage costs, as ratios measured in one process on one host (issue #39 point 2).

Sections (``--sections``, default all; each writes its part of the JSON as soon as it is done):

* ``e2e`` -> ``e2e_small_over_plain``: a 50-block eager H3-shaped model at 4,096 tokens (bench/gpu_quality.py's
  synthetic stack: 56 heads x 128, bf16, q/k/v HND views of NHD memory; every block calls ComfyUI's attention
  function as MiniMax H3 does, ``skip_reshape=True`` with its ``transformer_options``, and sets
  ``block_index`` on them as Flux does). The model sits in a real ``comfy.model_patcher.ModelPatcher``; the
  node arm is that patcher after ``safe_ops.patch.apply_safesage(patcher, Policy())`` -- the SafeSageAttention
  node's own call, at its defaults (kernel auto, quality balanced, verify first) -- the plain arm the same
  patcher without it. A sampling run goes as ComfyUI's sampler takes it: the model options cloned, the
  patcher's wrappers merged into them by ``comfy.sampler_helpers.prepare_model_patcher``, the run inside the
  OUTER_SAMPLE wrappers and each step's forward inside the APPLY_MODEL wrappers
  (``comfy.patcher_extension.WrapperExecutor``), each step on a copy of the transformer options carrying
  ``sigmas`` / ``sample_sigmas`` (device tensors). ComfyUI is set up as ``--use-sage-attention`` makes it
  (its function is ``attention_sage`` when sageattention imports; ``attention_pytorch`` otherwise, said in
  the JSON). With ``--emulate-arch`` (default sm89 on a GPU) sage 2.2's own dispatch and SafeSage's runtime
  read that arch (bench/benchutil.py), so both arms run what an RTX card of that arch runs. Runs alternate
  node, plain, node, plain, ... (a warm-up run of each first: JIT, first-call checks, plans); each step is
  timed with a device synchronize before and after (wall ms; CUDA events beside it). The ratio is the
  median step from step 2 on, node / plain; step 1 (the quality guard's probe) is reported apart; the
  spread is the per-pair ratios' range.
* ``guarded`` -> ``guarded_over_kernel_host`` per family: the host time of a guarded call / the same kernel
  called as ComfyUI calls it, at a small H3-shaped call (``--host-tokens``, default 256). Every family
  installed for the (emulated) runtime (``installed_kernels``). The kernel alone: ComfyUI's ``attention_sage``
  for the family sageattn dispatches to (``attention_comfy_kitchen_int8`` for comfy-kitchen where the ComfyUI
  has it); for a family no ComfyUI function runs (sage2_sm80, comfy-kitchen on 0dd9b154) the family's own
  call as SafeSage's adapter makes it, plus the output reshape ComfyUI's own path does (labelled). The
  guarded call: ComfyUI's function (wrap_attn) with ``SafeAttention(Policy(kernel="sage"), kernels=[that
  family])`` as ``optimized_attention_override``; node defaults otherwise (verify first: the check runs in
  the warm-up; quality balanced inside a started forward with no step known, bench/host_path.py's steady
  state "no block moved"). Where ComfyUI's call is timed, the family's own function alone is timed beside it
  (``family_fn``: what sageattn's dispatch adds). Target 1.05 where the kernel's own host time is >= 100 us;
  everywhere the guard's us / that kernel's GPU time at ``--gpu-tokens`` (38,000, H3's call as ComfyUI makes
  it, CUDA events, median of 3) is given beside it (``guard_us_over_kernel_gpu``).
* ``passthrough`` -> ``passthrough_over_comfy_host``: a call SafeSage hands on / ComfyUI's own function alone,
  ComfyUI's real ``attention_pytorch`` (SDPA): under ``kernel=sdpa`` (handed on unread) and a masked call
  under the node defaults (no guarded kernel takes a mask); the headline is the larger.
* ``legacy_hop`` (``--legacy-hop`` runs only it; GPU only): ``safe_ops.attention.streams.legacy_hop(device)``
  per call as installed -- on the legacy stream (no hop: sage 2.x's every call) and on a side stream (a hop
  made) -- with ``torch.cuda.current_stream`` and ``torch._C._cuda_getCurrentStream`` alone beside it, all
  interleaved. Kept under ``legacy_hop[<--tag>]`` (before / after); other tags already in ``--out`` are kept,
  so a before run and an after run land in one file: ``legacy_hop_change`` is after / before per row, and
  the same divided by the ``torch.cuda.current_stream`` row's (two processes: the host's drift between them
  is in the plain ratio). Every section of an existing ``--out`` that this run does not run is kept;
  ``runs`` lists the processes that wrote the file.

Host time (``guarded``, ``passthrough``, ``legacy_hop``): CPU wall time per call (``time.perf_counter_ns``)
over a block of ``--calls`` calls with no synchronize inside the block, the device synchronized before each
block (outside the timing), so the calls only queue their launches (a block's few hundred launches stay
under the launch queue's depth: the host never waits on the device inside a block). The arms alternate
block by block (A B A B ...); per arm the median over the blocks; the ratio is the ratio of the medians and
its spread the range of the per-round ratios. Beside each arm the device time of one block with the launches
queued behind ``torch.cuda._sleep`` (``gpu_us_per_call``): where it is below the host time the GPU was not
the bottleneck. Each host measurement runs rounds for ``--host-s`` seconds (at least ``--min-reps``; less
time, down to ``--host-min-s``, where the run is behind); the e2e runs stop where those, and RESERVE_S, still
fit in ``--budget-s`` (the whole process, default 110 s), at least ``--e2e-min-runs`` per arm. On a fresh
machine the node's warm-up step pays the JIT of the 8.9+PTX sage build's kernels on an sm_90 card and the
Triton quantisers' compile (67-97 s on three fresh H100 starts, 2026-12-06): then the run can pass its budget.
A timeline is printed and kept in the JSON (``runs[i].timeline``, per process).

    python3 -m bench.host_cost --out bench/results/host_cost_h100.json                      (GPU: every section)
    python3 -m bench.host_cost --legacy-hop --tag before --out bench/results/host_cost_h100.json
    python3 -m bench.host_cost --cpu --tiny --out /tmp/host_cost_cpu.json                    (plumbing smoke)

ComfyUI comes from PYTHONPATH (``export PYTHONPATH=$PYTHONPATH:$SS_COMFY`` after bench/device_setup.sh).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import statistics
import sys
import time

import torch

from bench.benchutil import emulate_sage_arch, emulated_runtime, env_info
from bench.gpu_quality import DIM, HEADS, Stack

OVERRIDE_KEY = "optimized_attention_override"
SECTIONS = ("e2e", "guarded", "passthrough", "legacy_hop")
#: seconds kept for what follows the e2e rounds, besides --host-s per host measurement (the kernels'
#: GPU times at --gpu-tokens, imports, the JSON)
RESERVE_S = 6.0


class HostBudget:
    """Seconds of rounds for each host measurement left: ``--host-s``, less where the run is behind
    (a fresh machine's JIT in the e2e warm-up) so the measurements left still end within ``--budget-s``,
    never under ``--host-min-s``; at least ``--min-reps`` rounds whatever the clock says."""

    def __init__(self, a, tl: Timeline, measurements: int):
        self.a, self.tl, self.left = a, tl, max(measurements, 1)

    def deadline(self, part: float = 1.0) -> float:
        """The ``time.perf_counter()`` this measurement's rounds stop at (``part`` of its share)."""
        a = self.a
        fair = (a.budget_s - RESERVE_S - self.tl.now()) / self.left
        secs = max(min(a.host_s, fair), a.host_min_s) if a.host_s > 0 else 0.0
        self.left = max(self.left - 1, 1) if part >= 1.0 else self.left
        return time.perf_counter() + secs * part
TARGETS = {"e2e_small_over_plain": 1.01, "guarded_over_kernel_host": 1.05, "kernel_host_us_floor": 100.0}


# ------------------------------------------------------------------------------------------ timing
class Timeline:
    """Seconds since the process's start, printed and kept."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.marks: list = []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def mark(self, what: str) -> None:
        t = round(self.now(), 1)
        self.marks.append([t, what])
        print(f"[host_cost +{t:6.1f}s] {what}", flush=True)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def host_block_us(fn, calls: int, dev: torch.device) -> float:
    """Host microseconds per call over ``calls`` calls, no synchronize inside (see the module docstring)."""
    _sync(dev)
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - t0) / calls / 1e3


def gpu_us_per_call(fn, calls: int, host_us: float, dev: torch.device) -> float | None:
    """Device microseconds per call: the block's launches queued behind a ``torch.cuda._sleep`` long
    enough to cover their host time, so the events between them time the device's work alone."""
    if dev.type != "cuda":
        return None
    _sync(dev)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(3e3 * calls * max(host_us, 1.0)))       # ~2 GHz cycles: about 1.5x the host time
    a.record()
    for _ in range(calls):
        fn()
    b.record()
    torch.cuda.synchronize(dev)
    return round(a.elapsed_time(b) * 1e3 / calls, 2)


def interleave(arms: dict, min_reps: int, max_reps: int, deadline: float, clock=time.perf_counter) -> dict:
    """A B A B ...: each round calls every arm once, in order; each returns one measurement. Stops after
    ``max_reps`` rounds, or once ``min_reps`` are done and ``clock()`` has passed ``deadline``."""
    out: dict = {k: [] for k in arms}
    for rep in range(max_reps):
        for name, fn in arms.items():
            out[name].append(fn())
        if rep + 1 >= min_reps and clock() > deadline:
            break
    return out


def stats(xs: list) -> dict:
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3),
            "n": len(xs)}


def ratio_of(num: list, den: list) -> dict:
    """The ratio of the medians, and the range of the per-round ratios (rounds paired by index)."""
    per = [n / d for n, d in zip(num, den) if d]
    return {"ratio": round(statistics.median(num) / statistics.median(den), 4),
            "per_round": [round(min(per), 4), round(max(per), 4)] if per else None, "rounds": len(per)}


def host_arms(arms: dict, calls: int, dev, min_reps: int, max_reps: int, deadline: float,
              device_time: bool = True) -> dict:
    """``interleave`` over host blocks of each arm (each arm warmed first) until ``deadline``
    (``time.perf_counter()``); per arm its per-call us stats, the rounds, and (``device_time``) its
    device us per call."""
    for fn in arms.values():
        for _ in range(min(calls, 20)):
            fn()
    _sync(dev)
    rounds = interleave({k: (lambda f=f: host_block_us(f, calls, dev)) for k, f in arms.items()},
                        min_reps, max_reps, deadline)
    _sync(dev)
    out = {}
    for k, f in arms.items():
        med = statistics.median(rounds[k])
        out[k] = {"host_us": stats(rounds[k]), "rounds_us": [round(x, 2) for x in rounds[k]],
                  "gpu_us_per_call": gpu_us_per_call(f, calls, med, dev) if device_time else None}
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


# ------------------------------------------------------------------------------------------ set-up
def comfy_setup(cpu: bool) -> dict:
    """ComfyUI from PYTHONPATH, set up as ``--use-sage-attention`` makes it where sageattention imports
    (``--cpu`` with ``cpu``): its attention functions and the one a model's attention gets."""
    spec = importlib.util.find_spec("comfy")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("host_cost: ComfyUI is not importable: put a ComfyUI tree on PYTHONPATH "
                         "(export PYTHONPATH=$PYTHONPATH:$SS_COMFY)")
    import comfy.cli_args as cli
    sage = not cpu and torch.cuda.is_available() and importlib.util.find_spec("sageattention") is not None
    if "comfy.model_management" not in sys.modules:
        if cpu:
            cli.args.cpu = True
        if sage:
            cli.args.use_sage_attention = True        # what --use-sage-attention sets (read again per call)
    import comfy.ldm.modules.attention as att
    sage = sage and bool(getattr(att, "SAGE_ATTENTION_IS_AVAILABLE", False))
    fn = att.attention_sage if sage else att.attention_pytorch
    return {"att": att, "fn": fn, "torch_fn": att.attention_pytorch, "sage_fn": att.attention_sage if sage else None,
            # newer ComfyUI's --use-ck-attention function, where comfy-kitchen's int8_attention runs here
            "ck_fn": (getattr(att, "attention_comfy_kitchen_int8", None)
                      if getattr(att, "COMFY_KITCHEN_INT8_ATTENTION_IS_AVAILABLE", False) else None),
            "label": ("attention_sage (ComfyUI as --use-sage-attention starts it)" if sage else
                      "attention_pytorch (no sageattention here: ComfyUI's own attention)"),
            "tree": os.path.dirname(list(spec.submodule_search_locations)[0])}


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


def h3_views(S: int, dev, dt, heads: int = HEADS, dim: int = DIM):
    """q/k/v [1, heads, S, dim]: HND views into one [1, S, 3*heads*dim] buffer, as MiniMax H3 hands them."""
    qkv = torch.randn(1, S, 3 * heads * dim, device=dev, dtype=dt, generator=torch.Generator(device=dev).manual_seed(0))
    return [t.view(1, S, heads, dim).transpose(1, 2) for t in qkv.split(heads * dim, -1)]


# --------------------------------------------------------------------------------------- e2e
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
            _sync(dev)
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if dev.type == "cuda" else None
            t0 = time.perf_counter()
            if ev:
                ev[0].record()
            out = run.execute(x, sig[s:s + 1], None, None, None, to)
            if ev:
                ev[1].record()
            _sync(dev)
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
           "e2e_small_over_plain": res["ratio"], "target": TARGETS["e2e_small_over_plain"],
           "meets_target": res["ratio"] <= TARGETS["e2e_small_over_plain"], **res,
           "runs_ms": {k: [[round(t, 2) for t in r] for r in v] for k, v in runs.items()},
           "cuda_event_steps_from_2_ms": {k: stats([t for r in v for t in r[1:]]) for k, v in gpu.items() if v},
           "node_status": summary.get("text", "").splitlines(), "quality_runs": quality,
           "ran": {"plans_at_warm_up": plans, "attention_calls": snap.get("attention_calls"),
                   "fallbacks": snap.get("fallbacks"), "fallback_reasons": snap.get("fallback_reasons"),
                   "quality": snap.get("quality"), "forwards": snap.get("forwards")}}
    return out


# ----------------------------------------------------------------------------------- guarded
def kernel_alone(kern, kind: str, ctx, q, k, v, to_plain):
    """(the kernel called as ComfyUI calls it, a label saying how) for one family."""
    c, rt = ctx["comfy"], ctx["rt"]
    S = q.shape[2]
    if kind == "sage" and kern.family == rt.sage_family and c["sage_fn"] is not None:
        f = c["sage_fn"]
        return (lambda: f(q, k, v, HEADS, mask=None, skip_reshape=True, transformer_options=to_plain),
                f"ComfyUI's attention_sage (sageattn dispatching as on {ctx['arch_label']})")
    if kind == "ck" and kern.family == rt.ck_family and c["ck_fn"] is not None:
        f = c["ck_fn"]
        return (lambda: f(q, k, v, HEADS, mask=None, skip_reshape=True, transformer_options=to_plain),
                "ComfyUI's attention_comfy_kitchen_int8")
    fn = kern.fn
    return (lambda: fn(q, k, v, "HND", None).transpose(1, 2).reshape(1, S, HEADS * DIM),
            "the family's own call as SafeSage's adapter makes it, output reshaped as ComfyUI's sage path does "
            "(this ComfyUI has no function that runs this kernel)")


def device_ms(fn, reps: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        o = fn()
        b.record()
        torch.cuda.synchronize()
        del o
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def guarded_section(ctx, a, tl: Timeline) -> dict:
    from safe_ops.attention.override import SafeAttention
    from safe_ops.families.registry import family_kind, installed_kernels, kernel_of
    from safe_ops.policy import Policy
    from safe_ops.ui import run_stats

    dev, dt, rt = ctx["dev"], ctx["dt"], ctx["rt"]
    kernels = [kernel_of(kk.family) for kk in installed_kernels(rt)]
    kernels = [kk for kk in kernels if kk is not None]
    if not kernels:
        return {"skipped": f"no guarded kernel family is installed here ({rt.summary()})"}
    q, k, v = h3_views(a.host_tokens, dev, dt)
    to_plain = {"block_index": 0}
    fams: dict = {}
    big = None
    for kern in kernels:
        fam, kind = kern.family, family_kind(kern.family)
        alone, label = kernel_alone(kern, kind, ctx, q, k, v, to_plain)
        c = ctx["comfy"]
        func = c["sage_fn"] if kind == "sage" and c["sage_fn"] is not None else c["torch_fn"]
        att = SafeAttention(Policy(kernel="sage"), kernels=[kern], rt=rt)
        if att.quality.active:
            att.quality.forward_start({})          # a started forward, no step known (bench/host_path.py)
        to_g = {OVERRIDE_KEY: att, "block_index": 0}
        guarded = lambda att_to=to_g, f=func: f(q, k, v, HEADS, mask=None, skip_reshape=True,  # noqa: E731
                                                 transformer_options=att_to)
        run_stats.reset()
        try:
            timed = {"kernel": alone, "guarded": guarded}
            if "adapter" not in label:           # the family's own function beside ComfyUI's call of it
                timed["family_fn"] = (lambda fn=kern.fn: fn(q, k, v, "HND", None).transpose(1, 2)
                                      .reshape(1, a.host_tokens, HEADS * DIM))
            arms = host_arms(timed, a.calls, dev, a.min_reps, a.max_reps, ctx["budget"].deadline())
        except Exception as e:  # noqa: BLE001 - a family that cannot run here: said, the others go on
            fams[fam] = {"error": f"{type(e).__name__}: {e}"[:400], "kernel_call": label}
            tl.mark(f"guarded: {fam} failed: {type(e).__name__}: {e}"[:200])
            continue
        snap = run_stats.snapshot()
        r = ratio_of(arms["guarded"]["rounds_us"], arms["kernel"]["rounds_us"])
        k_us, g_us = arms["kernel"]["host_us"]["median"], arms["guarded"]["host_us"]["median"]
        row = {"kind": kind, "kernel_call": label, "guarded_call": f"{getattr(func, '__name__', func)} with "
               "SafeAttention(Policy(kernel='sage'), kernels=[this family]) as optimized_attention_override",
               "plans": [[p.plan.kind, p.plan.kernel] for p in att.prepared_plans()],
               "ran": {"plans": snap.get("plans"), "fallbacks": snap.get("fallbacks"),
                       "fallback_reasons": snap.get("fallback_reasons")},
               "kernel": arms["kernel"], "guarded": arms["guarded"],
               "guarded_over_kernel_host": r["ratio"], "per_round": r["per_round"], "rounds": r["rounds"],
               "guard_us": round(g_us - k_us, 2), "target_applies": k_us >= TARGETS["kernel_host_us_floor"]}
        if row["target_applies"]:
            row["meets_target"] = r["ratio"] <= TARGETS["guarded_over_kernel_host"]
        if "family_fn" in arms:
            row["family_fn"] = arms["family_fn"]
            row["guarded_over_family_fn_host"] = ratio_of(arms["guarded"]["rounds_us"], arms["family_fn"]["rounds_us"])
        if dev.type == "cuda" and a.gpu_tokens:
            try:
                if big is None:
                    big = h3_views(a.gpu_tokens, dev, dt)
                big_alone, _ = kernel_alone(kern, kind, ctx, *big, dict(to_plain))
                ms = device_ms(big_alone)
                row["kernel_gpu_ms"] = {"tokens": a.gpu_tokens, "ms": round(ms, 3)}
                row["guard_us_over_kernel_gpu"] = round(max(row["guard_us"], 0.0) / (ms * 1e3), 7)
            except Exception as e:  # noqa: BLE001
                row["kernel_gpu_ms"] = {"tokens": a.gpu_tokens, "error": f"{type(e).__name__}: {e}"[:300]}
        else:
            row["kernel_gpu_ms"] = {"skipped": "no CUDA device" if dev.type != "cuda" else "--gpu-tokens 0"}
        fams[fam] = row
        tl.mark(f"guarded: {fam}: kernel {k_us:.1f} us, guarded {g_us:.1f} us, ratio {r['ratio']} "
                f"({r['rounds']} rounds); plans {row['plans']}")
        del att
    big = None
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {"tokens": a.host_tokens, "calls_per_block": a.calls, "families": fams,
            "guarded_over_kernel_host": {f: r.get("guarded_over_kernel_host") for f, r in fams.items()}}


# ------------------------------------------------------------------------------- passthrough
def passthrough_section(ctx, a, tl: Timeline) -> dict:
    from safe_ops.attention.override import SafeAttention
    from safe_ops.policy import Policy
    from safe_ops.ui import run_stats

    dev, dt, rt = ctx["dev"], ctx["dt"], ctx["rt"]
    f = ctx["comfy"]["torch_fn"]
    q, k, v = h3_views(a.host_tokens, dev, dt)
    mask = torch.zeros(a.host_tokens, a.host_tokens, device=dev, dtype=dt)
    by_sdpa = SafeAttention(Policy(kernel="sdpa"), rt=rt)
    defaults = SafeAttention(Policy(), rt=rt)
    for att in (by_sdpa, defaults):
        if att.quality.active:
            att.quality.forward_start({})
    plain_to, sdpa_to, def_to = {"block_index": 0}, {OVERRIDE_KEY: by_sdpa, "block_index": 0}, {OVERRIDE_KEY: defaults,
                                                                                                "block_index": 0}

    def call(to, m=None):
        return lambda: f(q, k, v, HEADS, mask=m, skip_reshape=True, transformer_options=to)

    run_stats.reset()
    arms = host_arms({"comfy": call(plain_to), "handed_on_sdpa_policy": call(sdpa_to),
                      "comfy_masked": call(plain_to, mask), "handed_on_masked_defaults": call(def_to, mask)},
                     a.calls, dev, a.min_reps, a.max_reps, ctx["budget"].deadline())
    snap = run_stats.snapshot()
    r1 = ratio_of(arms["handed_on_sdpa_policy"]["rounds_us"], arms["comfy"]["rounds_us"])
    r2 = ratio_of(arms["handed_on_masked_defaults"]["rounds_us"], arms["comfy_masked"]["rounds_us"])
    tl.mark(f"passthrough: kernel=sdpa {r1['ratio']}, masked under the defaults {r2['ratio']} ({r1['rounds']} rounds)")
    med = {k2: arms[k2]["host_us"]["median"] for k2 in arms}
    return {"tokens": a.host_tokens, "calls_per_block": a.calls, "comfy_function": "attention_pytorch (SDPA)",
            "arms": arms, "sdpa_policy": {**r1, "extra_us": round(med["handed_on_sdpa_policy"] - med["comfy"], 2)},
            "masked_defaults": {**r2, "extra_us": round(med["handed_on_masked_defaults"] - med["comfy_masked"], 2)},
            "passthrough_over_comfy_host": max(r1["ratio"], r2["ratio"]),
            "ran": {"plans": snap.get("plans"), "attention_calls": snap.get("attention_calls"),
                    "fallbacks": snap.get("fallbacks"), "fallback_reasons": snap.get("fallback_reasons")}}


# -------------------------------------------------------------------------------- legacy_hop
def legacy_hop_section(ctx, a, tl: Timeline) -> dict:
    from safe_ops.attention import streams

    dev = ctx["dev"]
    if dev.type != "cuda":
        return {"skipped": "no CUDA device: legacy_hop hops between CUDA streams"}
    dev = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream(dev)
    idx = dev.index

    def on_side(fn):
        def go():
            with torch.cuda.stream(side):
                return fn()
        return go

    hop_side = lambda: streams.legacy_hop(dev)          # noqa: E731
    arms = {"legacy_hop_on_legacy_stream": lambda: streams.legacy_hop(dev),
            "torch.cuda.current_stream": lambda: torch.cuda.current_stream(dev)}
    if getattr(torch._C, "_cuda_getCurrentStream", None) is not None:
        arms["torch._C._cuda_getCurrentStream"] = lambda: torch._C._cuda_getCurrentStream(idx)
    assert streams.legacy_hop(dev) is None, "the caller is on the legacy stream here"
    res = host_arms(arms, a.hop_calls, dev, a.min_reps, a.max_reps, ctx["budget"].deadline(0.5),
                    device_time=False)
    with torch.cuda.stream(side):
        made = streams.legacy_hop(dev)
        res["legacy_hop_on_side_stream"] = host_arms({"x": hop_side}, a.hop_calls, dev, a.min_reps, a.max_reps,
                                                     ctx["budget"].deadline(0.5), device_time=False)["x"]
    src = getattr(streams, "__file__", None)
    sha = hashlib.sha1(open(src, "rb").read()).hexdigest()[:12] if src and os.path.exists(src) else None
    out = {k: {"host_us": v["host_us"]} for k, v in res.items()}
    tl.mark("legacy_hop: " + ", ".join(f"{k} {v['host_us']['median']} us" for k, v in out.items()))
    return {"calls_per_block": a.hop_calls, "streams_py_sha1": sha, "side_stream_hop_made": made is not None,
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "pid": os.getpid(), **out}


def hop_change(tags: dict) -> dict | None:
    """after / before per row where both tags are in the file. The two tags ran in separate processes,
    so the host's drift between them is in each ratio; ``normalised_by_current_stream`` divides it by
    the same ratio of the ``torch.cuda.current_stream`` row (code neither tag changed)."""
    b, f = tags.get("before"), tags.get("after")
    if not b or not f:
        return None
    rows = [k for k in f if isinstance(f.get(k), dict) and "host_us" in f[k] and isinstance(b.get(k), dict)]
    ratio = {k: f[k]["host_us"]["median"] / b[k]["host_us"]["median"] for k in rows}
    out = {"note": "after / before of the medians, from two processes (pids "
                   f"{b.get('pid')}, {f.get('pid')}): the host's drift between them is in these ratios",
           "after_over_before": {k: round(v, 4) for k, v in ratio.items()}}
    cs = "torch.cuda.current_stream"
    if cs in ratio:
        out["normalised_by_current_stream"] = {k: round(v / ratio[cs], 4) for k, v in ratio.items() if k != cs}
    return out


# ---------------------------------------------------------------------------------------- main
def gpu_tag() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    for t in ("h100", "h200", "a100", "l40"):
        if t in name:
            return t
    return "".join(c for c in name if c.isalnum())[:16] or "gpu"


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="JSON to write (default bench/results/host_cost_<gpu>.json)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="any of " + ",".join(SECTIONS))
    ap.add_argument("--legacy-hop", action="store_true", help="only the legacy_hop section (merged into --out)")
    ap.add_argument("--tag", default="installed", help="legacy_hop's key: before | after (the code installed)")
    ap.add_argument("--emulate-arch", default=None,
                    help="the user's GPU arch (sm89, sm120) for sage's dispatch and SafeSage's runtime; "
                         "default sm89 on a GPU; 'none' for the real one")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (the smoke: GPU-only parts skip, saying why)")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes and few rounds (the plumbing smoke)")
    ap.add_argument("--tokens", type=int, default=4096, help="e2e tokens")
    ap.add_argument("--blocks", type=int, default=50, help="e2e blocks")
    ap.add_argument("--steps", type=int, default=8, help="e2e steps per sampling run")
    ap.add_argument("--e2e-min-runs", type=int, default=3, help="e2e runs per arm at least")
    ap.add_argument("--e2e-max-runs", type=int, default=10, help="e2e runs per arm at most")
    ap.add_argument("--host-tokens", type=int, default=256, help="tokens of the host-time calls")
    ap.add_argument("--gpu-tokens", type=int, default=38000, help="tokens of each kernel's GPU time (0: none)")
    ap.add_argument("--calls", type=int, default=50, help="calls per host block")
    ap.add_argument("--hop-calls", type=int, default=2000, help="calls per legacy_hop block")
    ap.add_argument("--min-reps", type=int, default=10, help="host rounds per measurement at least")
    ap.add_argument("--max-reps", type=int, default=1000, help="host rounds per measurement at most")
    ap.add_argument("--host-s", type=float, default=3.0, help="seconds of host rounds per measurement (each "
                    "guarded family, the passthrough arms, legacy_hop)")
    ap.add_argument("--host-min-s", type=float, default=1.0,
                    help="seconds of host rounds per measurement at least, where the run is behind its budget")
    ap.add_argument("--budget-s", type=float, default=110.0, help="the whole run's seconds: the e2e runs stop "
                    "where the host measurements' --host-s each (and RESERVE_S) still fit")
    ap.add_argument("--repo-rev", default=None, help="the code's commit, recorded")
    a = ap.parse_args(argv)
    if a.legacy_hop:
        a.sections = "legacy_hop"
    if a.tiny:
        a.tokens, a.blocks, a.steps, a.e2e_min_runs, a.e2e_max_runs = 64, 2, 3, 2, 2
        a.host_tokens, a.gpu_tokens, a.calls, a.hop_calls, a.min_reps, a.max_reps = 64, 0, 5, 50, 2, 3
        a.host_s = a.host_min_s = 0.0
    return a


def main(argv=None) -> dict:
    a = parse(argv)
    tl = Timeline()
    wanted = [s for s in a.sections.split(",") if s]
    bad = [s for s in wanted if s not in SECTIONS]
    if bad:
        raise SystemExit(f"host_cost: unknown section(s) {bad} (any of {SECTIONS})")
    cuda = torch.cuda.is_available() and not a.cpu
    dev = torch.device("cuda" if cuda else "cpu")
    dt = torch.bfloat16 if cuda else torch.float32
    out_path = a.out or os.path.join("bench", "results", f"host_cost_{gpu_tag() if cuda else 'cpu'}.json")
    comfy = comfy_setup(cpu=not cuda)
    from safe_ops.facts.devices import runtime
    arch = a.emulate_arch or ("sm89" if cuda else "none")
    real_arch = None
    if cuda and arch != "none":
        try:
            real_arch = emulate_sage_arch(arch)                 # sage 2.2 dispatches as on that arch
        except (ImportError, AttributeError) as e:               # sage 1.x: one Triton kernel everywhere
            real_arch = f"not emulated ({type(e).__name__}: {e})"
        rt = emulated_runtime(arch)
    else:
        rt, arch = runtime(), "none"
    ctx = {"dev": dev, "dt": dt, "rt": rt, "comfy": comfy, "arch_label": arch if arch != "none" else rt.arch_name}
    tl.mark(f"set up: {dev}, {comfy['label']}, runtime {rt.summary()}")
    result: dict = {}
    if os.path.exists(out_path):
        try:
            with open(out_path) as fh:
                result = json.load(fh)
        except (OSError, ValueError):
            result = {}
    result.update({**env_info("host_cost"), "machine": platform.node(), "cores": os.cpu_count(),
                   "device": str(dev), "dtype": str(dt), "repo_rev": a.repo_rev, "emulated_arch": arch,
                   "sage_real_arch": real_arch, "runtime": rt.summary(), "comfy_attention": comfy["label"],
                   "comfy_tree": comfy["tree"], "budget_s": a.budget_s, "tiny": a.tiny, "sections_run": wanted,
                   "method": {"host_time": "CPU wall time per call over blocks of calls with no synchronize inside "
                                           "a block, the device synchronized between blocks (outside the timing); "
                                           "arms alternate block by block; medians; ratio of medians, spread = range "
                                           "of the per-round ratios; gpu_us_per_call: the device's time per call "
                                           "with the launches queued behind torch.cuda._sleep",
                              "e2e": "sampling runs alternating node / plain through ComfyUI's ModelPatcher, "
                                     "prepare_model_patcher and wrapper executors; each step synchronized before "
                                     "and after (wall ms); median of steps 2..N per arm; step 1 apart"},
                   "targets": TARGETS})
    result["skipped"] = {k: v for k, v in (result.get("skipped") or {}).items() if k not in wanted}
    result["runs"] = (result.get("runs") or []) + [{"command": result["command"], "time_utc": result["time_utc"],
                                                     "pid": os.getpid(), "sections": wanted,
                                                     "legacy_hop_tag": a.tag if "legacy_hop" in wanted else None}]
    result.pop("timeline", None)
    from safe_ops.families.registry import installed_kernels
    host_measurements = ((len(installed_kernels(rt)) if "guarded" in wanted else 0) + ("passthrough" in wanted)
                         + ("legacy_hop" in wanted))
    e2e_deadline = a.budget_s - RESERVE_S - a.host_s * host_measurements
    ctx["budget"] = HostBudget(a, tl, host_measurements)
    runners = {"e2e": e2e_section, "guarded": guarded_section, "passthrough": passthrough_section,
               "legacy_hop": legacy_hop_section}

    def write():
        result["runs"][-1]["timeline"] = tl.marks          # this process's; earlier runs keep theirs
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with open(out_path, "w") as fh:
            json.dump(result, fh, indent=1, default=str)

    for s in SECTIONS:
        if s not in wanted:
            continue
        if s == "e2e":
            tl.mark(f"e2e: start (runs until +{e2e_deadline:.0f}s, at least {a.e2e_min_runs} per arm)")
            part = e2e_section(ctx, a, tl, e2e_deadline)
        else:
            tl.mark(f"{s}: start (up to {a.host_s:.0f} s of rounds per measurement, at least {a.min_reps})")
            part = runners[s](ctx, a, tl)
        part.update(pid=os.getpid(), time_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        if "skipped" in part:
            print(f"[host_cost] {s} skipped: {part['skipped']}", flush=True)
            result["skipped"][s] = part["skipped"]
        if s == "legacy_hop":
            if "skipped" in part:
                continue
            tags = result.get("legacy_hop") if isinstance(result.get("legacy_hop"), dict) else {}
            tags[a.tag] = part
            result["legacy_hop"] = tags
            result["legacy_hop_change"] = hop_change(tags)
        else:
            result[s] = part
            key = {"e2e": "e2e_small_over_plain", "guarded": "guarded_over_kernel_host",
                   "passthrough": "passthrough_over_comfy_host"}[s]
            result[key] = part.get(key)
        write()
    tl.mark(f"wrote {out_path}")
    write()
    print(json.dumps({k: result.get(k) for k in ("e2e_small_over_plain", "guarded_over_kernel_host",
                                                 "passthrough_over_comfy_host", "legacy_hop_change", "skipped")},
                     indent=1, default=str))
    return result


if __name__ == "__main__":
    main()
