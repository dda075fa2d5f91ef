"""host_cost's per-call sections: the host time of one attention call, guarded or handed on, beside the
same call without SafeSage, and of ``legacy_hop`` (bench/cost/host_cost.py runs them after its set-up; each is
timed as bench/cost/host_cost_timing.py says: blocks of calls, arms alternated, ratio of the medians).

* ``guarded`` -> ``guarded_over_kernel_host`` per family: the host time of a guarded call / the same kernel
  called as ComfyUI calls it, at a small H3-shaped call (``--host-tokens``, default 256). Every family
  installed for the (emulated) runtime (``installed_kernels``). The kernel alone: ComfyUI's ``attention_sage``
  for the family sageattn dispatches to (``attention_comfy_kitchen_int8`` for comfy-kitchen where the ComfyUI
  has it); for a family no ComfyUI function runs (sage2_sm80, comfy-kitchen on 0dd9b154) the family's own
  call as SafeSage's adapter makes it, plus the output reshape ComfyUI's own path does (labelled). The
  guarded call: ComfyUI's function (wrap_attn) with ``SafeAttention(Policy(kernel="sage"), kernels=[that
  family])`` as ``optimized_attention_override``; node defaults otherwise (verify first: the check runs in
  the warm-up; quality balanced inside a started forward with no step known, bench/cost/host_path.py's steady
  state "no block moved"). Where ComfyUI's call is timed, the family's own function alone is timed beside it
  (``family_fn``: what sageattn's dispatch adds). Target 1.05 where the kernel's own host time is >= 100 us;
  everywhere the guard's us / that kernel's GPU time at ``--gpu-tokens`` (38,000, H3's call as ComfyUI makes
  it, CUDA events, median of 3) is given beside it (``guard_us_over_kernel_gpu``).
* ``passthrough`` -> ``passthrough_over_comfy_host``: a call SafeSage hands on / ComfyUI's own function alone,
  ComfyUI's real ``attention_pytorch`` (SDPA): under ``kernel=sdpa`` (handed on unread) and a masked call
  under the node defaults (no guarded kernel takes a mask); the headline is the larger.
* ``legacy_hop`` (GPU only): ``safe_ops.attention.streams.legacy_hop(device)`` per call as installed -- on
  the legacy stream (no hop: sage 2.x's every call) and on a side stream (a hop made) -- with
  ``torch.cuda.current_stream`` and ``torch._C._cuda_getCurrentStream`` alone beside it, all interleaved
  (``--hop-calls`` per block, no device time). bench/cost/host_cost.py keeps the rows under the run's ``--tag``
  and compares a before run with an after run (``legacy_hop_change``).
"""
from __future__ import annotations

import hashlib
import os
import time

import torch

from bench.common.benchutil import time_ms
from bench.quality.gpu_quality import DIM, HEADS
from bench.cost.host_cost_timing import Timeline, host_arms, ratio_of

OVERRIDE_KEY = "optimized_attention_override"
#: the target ``guarded_over_kernel_host`` is held to, where the kernel's own host time is at least the floor
TARGETS = {"guarded_over_kernel_host": 1.05, "kernel_host_us_floor": 100.0}


def h3_views(S: int, dev, dt, heads: int = HEADS, dim: int = DIM):
    """q/k/v [1, heads, S, dim]: HND views into one [1, S, 3*heads*dim] buffer, as MiniMax H3 hands them."""
    qkv = torch.randn(1, S, 3 * heads * dim, device=dev, dtype=dt, generator=torch.Generator(device=dev).manual_seed(0))
    return [t.view(1, S, heads, dim).transpose(1, 2) for t in qkv.split(heads * dim, -1)]


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
            att.quality.forward_start({})          # a started forward, no step known (bench/cost/host_path.py)
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
                ms = time_ms({"kernel": big_alone}, 3)["kernel"]   # CUDA events, median of 3
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
