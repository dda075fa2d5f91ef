"""The quality guard's decision, taken again on committed measurements (CPU, no GPU).

The guard's step-1 measurement of a run -- each block's error on its planned family and on every
candidate family, on the same sampled rows -- is committed per block in the GPU benches' JSONs
(``bench.quality.gpu_quality`` on the H200 at 38k tokens, ``bench.quality.gpu_quality_profiles`` on the H100 at 8k).
This module feeds those numbers to today's ``safe_ops.quality.targets.decide`` and counts what
would move: benign blocks (no injected drift) and drifting ones, per profile and sage path. It is
how a change to the target is checked on profiles it was not fitted to without a device call;
what the moved blocks do to the stack's final error still needs the GPU bench.

    python3 -m bench.quality.quality_decisions [--out bench/results/quality_decisions_offline.json]
"""
from __future__ import annotations

import argparse
import json
import os

from bench.common.cmdline import write_json
from safe_ops.families import registry
from safe_ops.quality import outcome, report, targets

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
#: profiles whose drift the gradual layout spreads over every block: a block counts as drifting
#: from this factor on (its error first stands out of the benign blocks' range there)
GRADUAL_DRIFT_FROM = 8.0


def ceiling_of(family: str) -> float:
    """The ceiling the guard hands decide() for a block planned on ``family`` (targets.family_ceiling)."""
    fam = registry.families().get(family)
    return targets.DEFAULT_CEILING if fam is None else targets.family_ceiling(fam.tolerance, fam.benign_error)


def _decide(blocks: list[dict], order: list[str], quality: str = "balanced") -> list:
    measured = [targets.BlockErrors(b["block"], "k", b["planned"], b["planned_error"], dict(b["candidates"]))
                for b in blocks]
    planned = {b["planned"] for b in blocks}
    return targets.decide(measured, quality, list(order), {f: ceiling_of(f) for f in planned})


def _count(blocks: list[dict], choices: list, drifting) -> dict:
    by = {c.block: c for c in choices}
    benign = [b["block"] for b in blocks if not drifting(b)]
    drift = [b["block"] for b in blocks if drifting(b)]
    return {"benign_moved": sorted(b for b in benign if by[b].moved),
            "drifting_moved": sorted(b for b in drift if by[b].moved),
            "drifting_kept": sorted(b for b in drift if not by[b].moved),
            "moved_to": sorted({by[b].family for b in by if by[b].moved}),
            "lines": outcome.lines([report.entry(c) for c in choices])}


def profiles(path: str) -> dict:
    """bench.quality.gpu_quality_profiles' JSON: {profile: {sage path: counts}} under today's decide()."""
    with open(path) as f:
        doc = json.load(f)
    out = {}
    for name, paths in doc["profiles"].items():
        for sage_path, r in paths.items():
            blocks = r["guard"]["blocks"]
            order = [blocks[0]["planned"]] + list(r["move_order"])
            cut = GRADUAL_DRIFT_FROM if name == "gradual" else 1.0
            res = _count(blocks, _decide(blocks, order), lambda b: b["factor"] > cut)
            res["committed_run"] = {"benign_moved": r["guard"].get("benign_moved"),
                                    "blocks_moved": r["guard"].get("blocks_moved")}
            out.setdefault(name, {})[sage_path] = res
    return out


def h200_runs(path: str) -> dict:
    """bench.quality.gpu_quality's JSON (3 seeds x sage family, 38k tokens): {seed:family: counts}."""
    with open(path) as f:
        doc = json.load(f)
    out = {}
    for r in doc["runs"]:
        blocks = [{"block": b["index"], "planned": b["sage_family"], "planned_error": b["sage_error"],
                   "candidates": b["candidates"], "factor": b["outlier_factor"]} for b in r["blocks"]]
        order = [r["sage_family"]] + [f for f in blocks[0]["candidates"]]
        out[f"seed{r['seed']}:{r['sage_family']}"] = _count(blocks, _decide(blocks, order),
                                                             lambda b: b["factor"] > 1)
    return out


SOURCES = {"profiles_h100_8k": ("quality_guard_profiles_before_h100.json", profiles),
           "bench_h200_38k_sage106": ("quality_guard_sage106_h200.json", h200_runs),
           "bench_h200_38k_sage22": ("quality_guard_sage22_h200.json", h200_runs)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python3 -m bench.quality.quality_decisions", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the JSON here (default: print it)")
    a = ap.parse_args(argv)
    doc = {"what": "today's targets.decide() on committed per-block measurements (no GPU)",
           "balanced_factor": targets.BALANCED_FACTOR, "kernel_excess": targets.KERNEL_EXCESS,
           "gradual_drift_from_factor": GRADUAL_DRIFT_FROM}
    for key, (name, fn) in SOURCES.items():
        doc[key] = {"source": f"bench/results/{name}", "decisions": fn(os.path.join(RESULTS, name))}
    write_json(doc, a.out)
    return doc


if __name__ == "__main__":
    main()
