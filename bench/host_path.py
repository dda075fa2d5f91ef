"""SafeSage's own host time per attention call (issue #29, point 1), on the CPU with null kernels.

* ``host_us_per_guarded_call``: a call SafeSage gives to a guarded kernel whose kernel returns a
  preallocated tensor (no work), minus that null kernel called alone -- the same-stream path (no hop).
* ``host_us_per_passthrough_call``: a call SafeSage hands to ComfyUI's function (policy ``sdpa``), that
  function being a null one, minus the null function alone.
* ``host_us_per_hop_call``: needs a GPU (the legacy-stream hop); None here.

Median over ``--rounds`` rounds of ``--calls`` calls each, ``time.perf_counter_ns``; a 3-d call
[1, S, H*D] as most ComfyUI models make it, and H3's 4-d HND views (``skip_reshape``). Timings on a
shared CPU vary; the JSON records the machine.

    python3 -m bench.host_path --out bench/results/host_path_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from bench.benchutil import env_info


def per_call_us(fn, calls: int, rounds: int) -> float:
    for _ in range(min(calls, 200)):
        fn()
    best = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        best.append((time.perf_counter_ns() - t0) / calls / 1e3)
    return statistics.median(best)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--label", default="before", help="before: the code before the fast path")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)

    from safe_ops.attention.override import SafeAttention
    from safe_ops.facts.devices import Runtime
    from safe_ops.families.envelope import Envelope
    from safe_ops.families.family import Kernel
    from safe_ops.policy import Policy

    rt = Runtime("host-bench", None, None, None, None, None, "host-bench", None, None, None)
    B, S, H, D = 1, 64, 4, 32
    out_hnd = torch.zeros(B, H, S, D)
    env = Envelope(family="null_kernel", source="bench/host_path.py", head_dims=(D,), dtypes=("float32",),
                   supports_mask=False, terms=(), devices=("cpu",), temp_bytes=lambda call: 0)

    def null_kernel(q, k, v, layout, scale):
        return out_hnd if layout == "HND" else out_hnd.transpose(1, 2)

    def null_comfy(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                   **kw):
        return q

    x3 = torch.randn(B, S, 3 * H * D)
    q3, k3, v3 = x3.split(H * D, dim=-1)
    q4, k4, v4 = (t.view(B, S, H, D).transpose(1, 2) for t in (q3, k3, v3))
    result = {**env_info("host_path"), "machine": platform.node(), "cpu": platform.processor() or platform.machine(),
              "cores": os.cpu_count(), "label": a.label, "calls": a.calls, "rounds": a.rounds, "shape": [B, S, H, D]}
    rows = {}
    for quality in ("faults only", "balanced"):
        guarded = SafeAttention(Policy(kernel="sage", verify="off", quality=quality), kernels=[Kernel(env, null_kernel)],
                                rt=rt)
        passthrough = SafeAttention(Policy(kernel="sdpa", quality=quality), rt=rt)
        for form, args, kw in (("3d", (q3, k3, v3, H), {}),
                               ("4d_hnd_views", (q4, k4, v4, H), {"skip_reshape": True, "skip_output_reshape": True})):
            kernel_alone = per_call_us(lambda: null_kernel(q4, k4, v4, "NHD" if form == "3d" else "HND", None)
                                       .transpose(1, 2).reshape(B, S, H * D) if form == "3d"
                                       else null_kernel(q4, k4, v4, "HND", None), a.calls, a.rounds)
            g = per_call_us(lambda: guarded(null_comfy, *args, **kw), a.calls, a.rounds)
            comfy_alone = per_call_us(lambda: null_comfy(*args, **kw), a.calls, a.rounds)
            p = per_call_us(lambda: passthrough(null_comfy, *args, **kw), a.calls, a.rounds)
            rows[f"{quality}:{form}"] = {"guarded_us": round(g, 2), "null_kernel_alone_us": round(kernel_alone, 2),
                                         "passthrough_us": round(p, 2), "comfy_function_alone_us": round(comfy_alone, 2),
                                         "host_us_per_guarded_call": round(g - kernel_alone, 2),
                                         "host_us_per_passthrough_call": round(p - comfy_alone, 2)}
    result["rows"] = rows
    sfx = "" if a.label == "final" else "_" + a.label
    main_row = rows["balanced:3d"]
    result["host_us_per_guarded_call" + sfx] = main_row["host_us_per_guarded_call"]
    result["host_us_per_passthrough_call" + sfx] = main_row["host_us_per_passthrough_call"]
    result["host_us_per_hop_call" + sfx] = None
    result["host_us_per_hop_call_why"] = "no GPU on this machine: the hop is the legacy-stream hop"
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
