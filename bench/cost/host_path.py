"""SafeSage's own host time per attention call (issue #29, point 1), with null kernels.

* ``host_us_per_guarded_call``: a call SafeSage gives to a guarded kernel whose kernel returns a
  preallocated tensor (no work), minus the *kernel alone* -- that null kernel called the way
  ComfyUI's own sage path calls it for this call form (3-d ``[B,S,H*D]``: ``view`` to NHD three
  times, the kernel, one ``reshape`` back; H3's 4-d HND views: the kernel on them). Same stream
  (no hop). The headline is the larger of the two forms.
* ``host_us_per_passthrough_call``: a call SafeSage hands to ComfyUI's function, that function
  being a null one, minus the null function alone. Two kinds of such calls: policy ``sdpa`` (no
  guarded kernel can take any call: the call is not read) and a call no guarded kernel takes
  under a guarding policy (a mask: read, planned once, then handed on). The headline is the
  larger.
* ``host_us_per_hop_call`` (GPU only): a guarded call whose kernel launches on the legacy stream
  while the caller runs on a side stream (sage 2.x's CUDA kernels), so the call hops there and
  back with events (streams.py), minus the null kernel alone. No target (the issue: reported
  beside the same-stream number).

Median over ``--rounds`` rounds of ``--calls`` calls each (``time.perf_counter_ns``; on a GPU the
null kernels launch nothing, so the host is all that is timed). The guarded SafeAttention is the
pack's real one (``kernel=sage``, a null kernel family); the runtime is a stand-in, so on a GPU its
calls take the same-device path of any arch. The JSON records the machine; shared CPUs vary.

    python3 -m bench.cost.host_path --label final --out bench/results/host_path_cpu.json          (CPU)
    python3 -m bench.cost.host_path --device cuda --label final --out bench/results/host_path_h200.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from bench.common.benchutil import env_info


def per_call_us(fn, calls: int, rounds: int) -> float:
    for _ in range(min(calls, 200)):
        fn()
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        per.append((time.perf_counter_ns() - t0) / calls / 1e3)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return statistics.median(per)


def null_setup(device: str = "cpu", family: str = "null_kernel") -> dict:
    """The bench's pieces on ``device``: a stand-in runtime, a null kernel family (its kernel returns a
    preallocated tensor), a null ComfyUI function, and the two call forms with each one's "kernel alone"
    (host_frames.py builds its override from these too)."""
    from safe_ops.facts.devices import Runtime
    from safe_ops.families.envelope import Envelope
    from safe_ops.families.family import Kernel

    dev = torch.device(device)
    rt = Runtime("host-bench", None, None, None, None, None, "host-bench", None, None, None)
    B, S, H, D = 1, 64, 4, 32
    dt = torch.float32 if dev.type == "cpu" else torch.bfloat16
    out_hnd = torch.zeros(B, H, S, D, device=dev, dtype=dt)
    out_nhd = torch.zeros(B, S, H, D, device=dev, dtype=dt)
    env = Envelope(family=family, source="bench/cost/host_path.py", head_dims=(D,), dtypes=(str(dt)[6:],),
                   supports_mask=False, terms=(), devices=(dev.type,), temp_bytes=lambda call: 0)

    def null_kernel(q, k, v, layout, scale):
        return out_hnd if layout == "HND" else out_nhd

    def null_comfy(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                   **kw):
        return q

    x3 = torch.randn(B, S, 3 * H * D, device=dev, dtype=dt)
    q3, k3, v3 = x3.split(H * D, dim=-1)
    q4, k4, v4 = (t.view(B, S, H, D).transpose(1, 2) for t in (q3, k3, v3))
    forms = {"3d": ((q3, k3, v3, H), {}, lambda: null_kernel(q3.view(B, -1, H, D), k3.view(B, -1, H, D),
                                                             v3.view(B, -1, H, D), "NHD", None).reshape(B, -1, H * D)),
             "4d_hnd_views": ((q4, k4, v4, H), {"skip_reshape": True, "skip_output_reshape": True},
                              lambda: null_kernel(q4, k4, v4, "HND", None))}
    return {"dev": dev, "dt": dt, "shape": [B, S, H, D], "rt": rt, "env": env, "kernel": Kernel(env, null_kernel),
            "null_kernel": null_kernel, "null_comfy": null_comfy, "forms": forms,
            "mask": torch.zeros(S, S, device=dev, dtype=dt)}


def measure(device: str = "cpu", calls: int = 2000, rounds: int = 7) -> dict:
    """The rows and headline numbers (see the module docstring) on ``device``."""
    import dataclasses

    from safe_ops.attention.override import SafeAttention
    from safe_ops.families.family import Kernel
    from safe_ops.policy import Policy

    su = null_setup(device)
    dev, dt, rt, env, null_kernel = su["dev"], su["dt"], su["rt"], su["env"], su["null_kernel"]
    null_comfy, forms, mask = su["null_comfy"], su["forms"], su["mask"]
    B, S, H, D = su["shape"]
    rows = {}
    from safe_ops.quality import guard as quality_guard
    for quality in ("faults only", "balanced", "balanced, blocks moved"):
        guarded = SafeAttention(Policy(kernel="sage", verify="off", quality=quality.split(",")[0]),
                                kernels=[Kernel(env, null_kernel)], rt=rt)
        if guarded.quality.active:
            # a forward of a sampling run has started (the APPLY_MODEL wrapper's call), as in a
            # real run; no step is known here, so nothing is measured: the forward runs its plans
            # as they are (no block moved). "blocks moved": steps 2.. after the guard moved some
            # block (not these calls'): each call is told its block and looks its choice up.
            guarded.quality.forward_start({})
            if quality.endswith("moved"):
                st = guarded.quality.state()
                st.mode, st.choices = quality_guard.CHOSEN, {(10**6, ()): "sdpa"}
        passthrough = SafeAttention(Policy(kernel="sdpa", quality=quality.split(",")[0]), rt=rt)
        for form, (args, kw, alone) in forms.items():
            kernel_alone = per_call_us(alone, calls, rounds)
            g = per_call_us(lambda: guarded(null_comfy, *args, **kw), calls, rounds)
            comfy_alone = per_call_us(lambda: null_comfy(*args, **kw), calls, rounds)
            p = per_call_us(lambda: passthrough(null_comfy, *args, **kw), calls, rounds)
            comfy_masked = per_call_us(lambda: null_comfy(*args, mask=mask, **kw), calls, rounds)
            pm = per_call_us(lambda: guarded(null_comfy, *args, mask=mask, **kw), calls, rounds)
            rows[f"{quality}:{form}"] = {
                "guarded_us": round(g, 2), "kernel_alone_us": round(kernel_alone, 2),
                "host_us_per_guarded_call": round(g - kernel_alone, 2),
                "passthrough_sdpa_policy_us": round(p, 2), "comfy_function_alone_us": round(comfy_alone, 2),
                "host_us_per_passthrough_call_sdpa_policy": round(p - comfy_alone, 2),
                "passthrough_masked_us": round(pm, 2), "comfy_function_masked_alone_us": round(comfy_masked, 2),
                "host_us_per_passthrough_call_masked": round(pm - comfy_masked, 2)}
    hop = None
    if dev.type == "cuda":
        legacy_env = dataclasses.replace(env, launches_on_legacy_stream=True)
        hopper = SafeAttention(Policy(kernel="sage", verify="off"), kernels=[Kernel(legacy_env, null_kernel)], rt=rt)
        side = torch.cuda.Stream()
        args, kw, alone = forms["4d_hnd_views"]
        with torch.cuda.stream(side):
            kernel_alone = per_call_us(alone, calls, rounds)
            h = per_call_us(lambda: hopper(null_comfy, *args, **kw), calls, rounds)
        from safe_ops.ui import run_stats
        hop = {"hopped_us": round(h, 2), "kernel_alone_us": round(kernel_alone, 2),
               "host_us_per_hop_call": round(h - kernel_alone, 2),
               "stream_hops_counted": run_stats.value("stream_hops")}
    from safe_ops.ui import run_stats
    snap = run_stats.snapshot()
    # what ran: the guarded rows' calls are counted as plans, the masked ones as fallbacks (a guarded row
    # whose calls fell back would be timing ComfyUI's function, not SafeSage's path)
    ran = {k: snap.get(k) for k in ("plan:direct", "fallbacks", "stream_hops")}
    ran["fallback_reasons"] = snap.get("fallback_reasons")
    guarded_max = max(r["host_us_per_guarded_call"] for r in rows.values())
    passthrough_max = max(max(r["host_us_per_passthrough_call_sdpa_policy"], r["host_us_per_passthrough_call_masked"])
                          for r in rows.values())
    return {"device": str(dev), "dtype": str(dt), "shape_bshd": [B, S, H, D], "rows": rows, "hop": hop, "ran": ran,
            "host_us_per_guarded_call": guarded_max, "host_us_per_passthrough_call": passthrough_max,
            "host_us_per_hop_call": None if hop is None else hop["host_us_per_hop_call"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--label", default="final", help="final: the fields carry the issue's names; any other "
                    "label (an earlier code state) suffixes them with _<label>")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    m = measure(a.device, a.calls, a.rounds)
    sfx = "" if a.label == "final" else "_" + a.label
    result = {**env_info("cost.host_path"), "machine": platform.node(), "cpu": platform.processor() or platform.machine(),
              "cores": os.cpu_count(), "label": a.label, "calls": a.calls, "rounds": a.rounds,
              "device": m["device"], "dtype": m["dtype"], "shape_bshd": m["shape_bshd"], "rows": m["rows"],
              "hop": m["hop"]}
    for k in ("host_us_per_guarded_call", "host_us_per_passthrough_call", "host_us_per_hop_call"):
        result[k + sfx] = m[k]
    if m["hop"] is None:
        result["host_us_per_hop_call_why"] = "no GPU here: the hop is the legacy-stream hop (--device cuda)"
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k.startswith("host_us")}, indent=1))
    print(json.dumps(m["rows"], indent=1))


if __name__ == "__main__":
    main()
