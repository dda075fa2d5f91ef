"""What SafeSage costs, as ratios measured in one process on one host (issue #39 point 2).

Sections (``--sections``, default all; each writes its part of the JSON as soon as it is done), each with its
method in the docstring of the module that runs it:

* ``e2e`` -> ``e2e_small_over_plain``: sampling runs of a 50-block H3-shaped model in a real ModelPatcher,
  the SafeSageAttention node's patcher / the same patcher without it (bench/cost/host_cost_e2e.py).
* ``guarded`` -> ``guarded_over_kernel_host`` per family, ``passthrough`` -> ``passthrough_over_comfy_host``
  and ``legacy_hop`` (``--legacy-hop`` runs only it; GPU only): the host time of single calls
  (bench/cost/host_cost_calls.py), timed as bench/cost/host_cost_timing.py says.

This module: the command line, the set-up, the JSON and the ratios' summary. ComfyUI is set up as
``--use-sage-attention`` makes it (its function is ``attention_sage`` when sageattention imports;
``attention_pytorch`` otherwise, said in the JSON). With ``--emulate-arch`` (default sm89 on a GPU) sage
2.2's own dispatch and SafeSage's runtime read that arch (bench/common/benchutil.py), so every arm runs what an
RTX card of that arch runs. ``legacy_hop``'s rows are kept under ``legacy_hop[<--tag>]`` (before / after);
other tags already in ``--out`` are kept, so a before run and an after run land in one file:
``legacy_hop_change`` is after / before per row, and the same divided by the ``torch.cuda.current_stream``
row's (two processes: the host's drift between them is in the plain ratio). Every section of an existing
``--out`` that this run does not run is kept; ``runs`` lists the processes that wrote the file.

Budget: each host measurement runs rounds for ``--host-s`` seconds (less where the run is behind: see
bench/cost/host_cost_timing.py); the e2e runs stop where those, and RESERVE_S, still fit in ``--budget-s`` (the
whole process, default 110 s), at least ``--e2e-min-runs`` per arm. On a fresh machine the node's warm-up
step pays the JIT of the 8.9+PTX sage build's kernels on an sm_90 card and the Triton quantisers' compile
(67-97 s on three fresh H100 starts, 2026-12-06): then the run can pass its budget. A timeline is printed
and kept in the JSON (``runs[i].timeline``, per process).

    python3 -m bench.cost.host_cost --out bench/results/host_cost_h100.json                      (GPU: every section)
    python3 -m bench.cost.host_cost --legacy-hop --tag before --out bench/results/host_cost_h100.json
    python3 -m bench.cost.host_cost --cpu --tiny --out /tmp/host_cost_cpu.json                    (plumbing smoke)

ComfyUI comes from PYTHONPATH (``export PYTHONPATH=$PYTHONPATH:$SS_COMFY`` after bench/device_setup.sh).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time

import torch

from bench.common.benchutil import emulate_dispatch, emulated_runtime, env_info
from bench.cost.host_cost_calls import TARGETS as CALL_TARGETS
from bench.cost.host_cost_calls import guarded_section, legacy_hop_section, passthrough_section
from bench.cost.host_cost_e2e import E2E_METHOD, e2e_section
from bench.cost.host_cost_e2e import TARGET as E2E_TARGET
from bench.cost.host_cost_timing import HOST_TIME_METHOD, RESERVE_S, HostBudget, Timeline

SECTIONS = ("e2e", "guarded", "passthrough", "legacy_hop")
TARGETS = {"e2e_small_over_plain": E2E_TARGET, **CALL_TARGETS}


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


# ----------------------------------------------------------------------------- the ratios' summary
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
        real_arch = emulate_dispatch(arch)
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
    result.update({**env_info("cost.host_cost"), "machine": platform.node(), "cores": os.cpu_count(),
                   "device": str(dev), "dtype": str(dt), "repo_rev": a.repo_rev, "emulated_arch": arch,
                   "sage_real_arch": real_arch, "runtime": rt.summary(), "comfy_attention": comfy["label"],
                   "comfy_tree": comfy["tree"], "budget_s": a.budget_s, "tiny": a.tiny, "sections_run": wanted,
                   "method": {"host_time": HOST_TIME_METHOD, "e2e": E2E_METHOD},
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
