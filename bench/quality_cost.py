"""The quality guard's step-1 cost on the real ComfyUI path, from bench.repro results (issue #37 point 4).

    python3 -m bench.quality_cost RESULT.json [RESULT.json ...] --path NAME [--path NAME ...] \\
        --out bench/results/quality_guard_cost_<tokens>_<gpu>.json [--before JSON]

Each RESULT is one ``python -m bench.repro all`` run (one sage path, one machine) with rows of the arms
``safesage_faults`` (quality "faults only": no probe), ``safesage`` (the node's defaults: quality
``balanced``, the probe with its candidates) and optionally ``safesage_refonly`` (faults only with
``quality_probe_step`` 1: the probe's reference alone). Per path::

    fraction = (step 1 of the arm - step 1 of faults only) / (30 x median step from step 2 on)

for every prompt the rows share (``--prompts N``): the first prompt of a server carries one-time
costs (module loads, a kernel's first launch; on an H100 emulating an RTX card also the JIT of sage
2.2's sm_89 PTX), a later prompt is what every further run pays. ``probe_overhead_fraction`` is the
last prompt's (the first's where only one ran); ``reference_share`` / ``candidates_share`` split it
where the reference-only arm ran. The reference's memory: each arm's torch peak allocated.
"""
from __future__ import annotations

import argparse
import json
import statistics

from bench.cmdline import command

RUN_STEPS = 30
TARGET = 0.005


def arm_steps(run: dict) -> list[list[float]]:
    """Per prompt, the row's seconds per step (the first prompt's, then each later completed one)."""
    w = run.get("worker") or {}
    out = [w.get("s_per_step") or []]
    out += [p["s_per_step"] for p in w.get("later_prompts") or [] if p.get("outcome") == "completed"
            and p.get("s_per_step")]
    return [s for s in out if s]


def path_cost(doc: dict) -> dict:
    """The cost figures of one bench.repro result (see the module docstring)."""
    rows = {r["arm"]: r for r in doc.get("runs", []) if r.get("rc") == 0}
    if "safesage_faults" not in rows or "safesage" not in rows:
        raise SystemExit("need completed rows of the arms safesage_faults and safesage "
                         f"(have: {', '.join(sorted(rows)) or 'none'})")
    steps = {arm: arm_steps(r) for arm, r in rows.items()}
    later = [s for arm in ("safesage_faults", "safesage") for p in steps[arm] for s in p[1:]]
    median = statistics.median(later)
    prompts = min(len(steps[a]) for a in steps if a.startswith("safesage"))
    per_prompt = []
    for i in range(prompts):
        base = steps["safesage_faults"][i][0]
        entry = {"prompt": i + 1, "step1_s": {a: steps[a][i][0] for a in steps if len(steps[a]) > i}}
        for arm, key in (("safesage", "probe_overhead_fraction"), ("safesage_refonly", "reference_fraction")):
            if arm in steps and len(steps[arm]) > i:
                entry[key] = round((steps[arm][i][0] - base) / (RUN_STEPS * median), 5)
        per_prompt.append(entry)
    w = rows["safesage"].get("worker") or {}
    blocks = w.get("blocks")
    last = per_prompt[-1]
    out = {"command": doc.get("command"), "repo_rev": doc.get("repo_rev"), "gpu": (w.get("versions") or {}).get("gpu"),
           "tokens": w.get("packed_tokens"), "blocks": blocks, "emulated_arch": w.get("emulated_arch"),
           "real_arch": w.get("real_arch"), "versions": w.get("versions"), "prompts": prompts,
           "median_step_from_step2_s": round(median, 4), "per_prompt": per_prompt,
           "probe_overhead_fraction": last["probe_overhead_fraction"],
           "probe_overhead_fraction_first_prompt": per_prompt[0]["probe_overhead_fraction"],
           "probe_ms_per_block": round(last["probe_overhead_fraction"] * RUN_STEPS * median * 1000 / blocks, 1)
           if blocks else None,
           "s_per_step": {a: steps[a] for a in steps},
           "torch_peak_allocated_gib": {a: ((r.get("worker") or {}).get("memory") or {}).get("torch_peak_allocated_gib")
                                        for a, r in rows.items()},
           "quality_stats": {a: ((r.get("worker") or {}).get("safesage_report") or {}).get("quality")
                             for a, r in rows.items() if a.startswith("safesage")}}
    if "reference_fraction" in last:
        out["reference_share"] = round(last["reference_fraction"] / last["probe_overhead_fraction"], 3)
        out["candidates_share"] = round(1 - out["reference_share"], 3)
    if "sage" in steps:
        sage_med = statistics.median(s for p in steps["sage"] for s in p[1:])
        out["safesage_over_unguarded"] = round(median / sage_med, 4)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="+", help="bench.repro all JSONs, one per sage path")
    ap.add_argument("--path", action="append", required=True, help="each result's sage path name, in order")
    ap.add_argument("--out", required=True)
    ap.add_argument("--note", action="append", default=[], help="a line for the JSON's notes (repeatable)")
    ap.add_argument("--before", default=None, help="a JSON holding the figure before (its probe_overhead_fraction)")
    a = ap.parse_args(argv)
    if len(a.path) != len(a.results):
        ap.error("one --path per result")
    paths = {}
    for name, path in zip(a.path, a.results):
        with open(path) as f:
            paths[name] = {"source": path, **path_cost(json.load(f))}
    first = next(iter(paths.values()))
    worst = max(p["probe_overhead_fraction"] for p in paths.values())
    doc = {"harness": "bench.repro", "command": command("quality_cost"), "tokens": first["tokens"],
           "gpu": first["gpu"], "repo_rev": sorted({p["repo_rev"] for p in paths.values()}),
           "formula": f"(step 1 of the arm - step 1 of faults only) / ({RUN_STEPS} x median step from step 2 on), "
                      "per prompt of one server; probe_overhead_fraction: the last prompt's, the worst path",
           "probe_overhead_fraction": worst, "target": f"<= {TARGET}", "target_met": worst <= TARGET,
           "notes": a.note, "paths": paths}
    if a.before:
        with open(a.before) as f:
            before = json.load(f)
        doc["probe_overhead_fraction_before"] = before.get("probe_overhead_fraction")
        doc["probe_overhead_fraction_before_source"] = a.before
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    for name, p in paths.items():
        print(f"{name}: {p['probe_overhead_fraction']} (first prompt {p['probe_overhead_fraction_first_prompt']}), "
              f"{p['probe_ms_per_block']} ms/block, candidates' share {p.get('candidates_share')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
