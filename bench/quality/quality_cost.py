"""The quality guard's step-1 cost as a share of the sampling time, in the graph's own steps (issue 46
goal 7; first issue #37 point 4), from bench.repro results.

    python3 -m bench.quality.quality_cost RESULT.json [RESULT.json ...] --path NAME [--path NAME ...] \\
        --out bench/results/quality_guard_cost_<tokens>_<gpu>.json [--before JSON] \\
        [--includes PATH:PROMPT=TEXT ...] [--note TEXT ...]
    python3 -m bench.quality.quality_cost --annotate bench/results/quality_guard_cost_<...>.json \\
        [--includes ROW=TEXT ...] [--note TEXT ...]

Each RESULT is one ``python -m bench.repro all`` run (one sage path, one machine) with rows of the arms
``safesage_faults`` (quality "faults only": no probe), ``safesage`` (the node's defaults: the probe with
its candidates) and optionally ``safesage_refonly`` (faults only with ``quality_probe_step`` 1: the
probe's reference alone). Per path and per prompt of one server (``--prompts N``)::

    share of the sampling time = (step 1 of the arm - step 1 of faults only) / (N x median step from step 2 on)

for N = the graph's own step count (the rows' steps), 20 (the reporter's full run: seed-bug-report.md,
"a full 20-step run, 25.4 min") and 2 (the reporter's repro; the H3 templates sampled 2 steps until
issue 48, when they took the full run's 20). The median
step is over the faults-only and node-default rows' steps from step 2 on, every prompt.

Cases, each named in the JSON where it is missing or carries a one-time cost: a server's **first
prompt** (module loads, the kernels' first launches, and whatever a row's ``--includes`` names, e.g.
the H100's one-time PTX JIT of sage 2.2's 8.9+PTX build on sm_90, which a native RTX build does not
pay: kept, labelled), a **later prompt** (prompt 2 on that ran the probe: what every further run of
today's guard pays; "not measured" where a server ran one prompt), and a **remembered prompt** (a later
prompt in which the guard ran no probe -- its errors remembered from an earlier prompt -- told by the
guard's cumulative probe count that bench.repro reads between prompts; "not measured" where none did).
Targets (issue 46): a later prompt <= 0.5 % of a 20-step prompt and <= 1 % of a 2-step one; a
remembered prompt ~0.

The figure before issue 46 divided by 30 steps, a schedule nobody here runs: kept only under keys
ending ``_30_steps_before``. ``probe_ms_per_block`` and the reference / candidates shares do not depend
on the steps. The reference's memory: each arm's torch peak allocated.

``--annotate`` adds the same shares to an older, hand-assembled JSON in place (its ``raw`` bench.repro
result: one prompt per server, arms repeated in its ``plan``): every node-default row against every
faults-only row, each row a server's first prompt; its 30-step keys are renamed the same way.
"""
from __future__ import annotations

import argparse
import json
import statistics

from bench.common.cmdline import command

#: step counts every share is also given for, and why
SCHEDULES = {20: "the reporter's full run (seed-bug-report.md: a full 20-step run, 25.4 min)",
             2: "the reporter's repro (2 steps)"}
#: a later prompt's share, per schedule (issue 46 goal 7)
TARGETS = {20: 0.005, 2: 0.01}
#: the schedule the figures divided by before issue 46 (nobody runs it): only under *_30_steps_before keys
OLD_RUN_STEPS = 30
FIRST_PROMPT = "a server's first prompt: its one-time module loads and the kernels' first launches"
FIRST_ROW = ("the plan's first row on its machine: what the machine compiles once (Triton / PTX JIT caches) "
             "can fall in its step 1")
NOT_MEASURED_LATER = "not measured: one prompt per server"
NOT_MEASURED_REMEMBERED = ("not measured: no later prompt of these rows ran without a probe (errors remembered "
                           "from an earlier prompt)")
GUARDED, FAULTS, REFONLY = "safesage", "safesage_faults", "safesage_refonly"


def shares(extra_s: float, graph_steps: int, median: float) -> dict:
    """``extra_s`` as a share of the sampling time (N x median step) for the graph's own N, 20 and 2."""
    out = {"graph_steps": graph_steps, "graph": round(extra_s / (graph_steps * median), 5)}
    out.update({f"{n}_steps": round(extra_s / (n * median), 5) for n in SCHEDULES})
    return out


def arm_prompts(run: dict) -> list[tuple[list[float], int | None]]:
    """Per prompt of a row (the first, then each later completed one): its seconds per step and the
    guard's cumulative probe count after it (/safesage/stats' quality "probes", which bench.repro reads
    between prompts; None where not recorded)."""
    w = run.get("worker") or {}

    def probes(q):
        return ((q or {}).get("quality") or {}).get("probes")
    out = [(w.get("s_per_step") or [], probes(w.get("safesage_quality_first_prompt")))]
    out += [(p["s_per_step"], probes(p.get("safesage_quality"))) for p in w.get("later_prompts") or []
            if p.get("outcome") == "completed" and p.get("s_per_step")]
    return [(s, n) for s, n in out if s]


def arm_steps(run: dict) -> list[list[float]]:
    """Per prompt, the row's seconds per step (the first prompt's, then each later completed one)."""
    return [s for s, _ in arm_prompts(run)]


def probes_run(run: dict) -> list[int | None]:
    """Per prompt, how many block probes the guard ran in it (None: not recorded): a later prompt that
    ran none measured nothing -- its errors were remembered from an earlier prompt."""
    cum = [n for _, n in arm_prompts(run)]
    return cum[:1] + [b - a if a is not None and b is not None else None for a, b in zip(cum, cum[1:])]


def graph_steps_of(steps: list[list[float]], declared=None) -> int:
    """The graph's own step count: every prompt's rows must have run the same number (the result's
    ``steps`` where it records one)."""
    counts = {len(p) for p in steps}
    if len(counts) != 1 or (declared is not None and counts != {declared}):
        raise SystemExit(f"rows ran different step counts {sorted(counts)} (the result says {declared}): "
                         "no one schedule to divide by")
    return counts.pop()


def _median_step(rows: dict) -> float:
    return statistics.median(s for arm in (FAULTS, GUARDED) for p in rows[arm] for s in p[1:])


def _timed_on(w: dict) -> str | None:
    """Where the timings are not an RTX card's own: another GPU dispatching as the emulated arch."""
    emulated, real = w.get("emulated_arch"), w.get("real_arch") or []
    if emulated and real and emulated not in real:
        gpu = (w.get("versions") or {}).get("gpu") or "this GPU"
        return (f"{gpu} ({', '.join(real)}) speeds with {emulated} dispatch emulated (--emulate-arch): "
                "not an RTX card's timings")
    return None


def path_cost(doc: dict, includes: dict | None = None) -> dict:
    """The cost figures of one bench.repro result (see the module docstring). ``includes``: {prompt
    number: [what that prompt's step 1 carries besides the probe]}, added to the automatic labels."""
    includes = includes or {}
    rows = {r["arm"]: r for r in doc.get("runs", []) if r.get("rc") == 0}
    if FAULTS not in rows or GUARDED not in rows:
        raise SystemExit(f"need completed rows of the arms {FAULTS} and {GUARDED} "
                         f"(have: {', '.join(sorted(rows)) or 'none'})")
    steps = {arm: arm_steps(r) for arm, r in rows.items()}
    n = graph_steps_of([p for a in steps for p in steps[a]], doc.get("steps"))
    median = _median_step(steps)
    prompts = min(len(steps[a]) for a in steps if a.startswith(GUARDED))
    unknown = sorted(set(includes) - set(range(1, prompts + 1)))
    if unknown:
        raise SystemExit(f"--includes names prompt(s) {unknown}; these rows have prompts 1-{prompts}")
    probed = probes_run(rows[GUARDED])
    per_prompt = []
    for i in range(prompts):
        base = steps[FAULTS][i][0]
        kind = "first" if i == 0 else "remembered" if probed[i] == 0 else "later"
        e = {"prompt": i + 1, "server_prompt": kind,
             "step1_s": {a: steps[a][i][0] for a in steps if len(steps[a]) > i},
             "includes": ([FIRST_PROMPT] if i == 0 else []) + list(includes.get(i + 1, []))}
        if probed[i] is not None:
            e["guard_probes"] = probed[i]
        for arm, key in ((GUARDED, "probe"), (REFONLY, "reference")):
            if arm in steps and len(steps[arm]) > i:
                extra = steps[arm][i][0] - base
                e[f"{key}_extra_s"] = round(extra, 3)
                e[f"{key}_share"] = shares(extra, n, median)
                old = "probe_overhead_fraction" if key == "probe" else "reference_fraction"
                e[f"{old}_{OLD_RUN_STEPS}_steps_before"] = round(extra / (OLD_RUN_STEPS * median), 5)
        per_prompt.append(e)
    w = rows[GUARDED].get("worker") or {}
    blocks = w.get("blocks")
    first = per_prompt[0]
    case = {kind: next(({"prompt": e["prompt"], "probe_share": e["probe_share"], "includes": e["includes"]}
                        for e in reversed(per_prompt) if e["server_prompt"] == kind), None)
            for kind in ("later", "remembered")}
    later = case["later"] or (NOT_MEASURED_LATER if prompts == 1 else "not measured: every later prompt remembered")
    last = per_prompt[later["prompt"] - 1] if isinstance(later, dict) else first     # the last prompt that probed
    out = {"command": doc.get("command"), "repo_rev": doc.get("repo_rev"), "gpu": (w.get("versions") or {}).get("gpu"),
           "tokens": w.get("packed_tokens"), "blocks": blocks, "emulated_arch": w.get("emulated_arch"),
           "real_arch": w.get("real_arch"), "timed_on": _timed_on(w), "versions": w.get("versions"),
           "prompts": prompts, "graph_steps": n, "median_step_from_step2_s": round(median, 4),
           "first_prompt": {"probe_share": first["probe_share"], "includes": first["includes"]},
           "later_prompt": later, "remembered_prompt": case["remembered"] or NOT_MEASURED_REMEMBERED,
           "target_met": _targets_met([later]),
           "per_prompt": per_prompt,
           "probe_ms_per_block": round(last["probe_extra_s"] * 1000 / blocks, 1) if blocks else None,
           f"probe_overhead_fraction_{OLD_RUN_STEPS}_steps_before": last[f"probe_overhead_fraction_{OLD_RUN_STEPS}_steps_before"],
           f"probe_overhead_fraction_first_prompt_{OLD_RUN_STEPS}_steps_before":
               first[f"probe_overhead_fraction_{OLD_RUN_STEPS}_steps_before"],
           "s_per_step": {a: steps[a] for a in steps},
           "torch_peak_allocated_gib": {a: ((r.get("worker") or {}).get("memory") or {}).get("torch_peak_allocated_gib")
                                        for a, r in rows.items()},
           "quality_stats": {a: ((r.get("worker") or {}).get("safesage_report") or {}).get("quality")
                             for a, r in rows.items() if a.startswith(GUARDED)}}
    if "reference_extra_s" in last:
        out["reference_share"] = round(last["reference_extra_s"] / last["probe_extra_s"], 3)
        out["candidates_share"] = round(1 - out["reference_share"], 3)
    if "sage" in steps:
        sage_med = statistics.median(s for p in steps["sage"] for s in p[1:])
        out["safesage_over_unguarded"] = round(median / sage_med, 4)
    return out


def _targets_met(laters: list) -> dict:
    """Whether every measured later prompt meets each schedule's target (None: none measured)."""
    got = [x["probe_share"] for x in laters if isinstance(x, dict)]
    return {f"later_prompt_{n}_steps": (all(s[f"{n}_steps"] <= t for s in got) if got else None)
            for n, t in TARGETS.items()}


def targets(remembered_measured: bool = False) -> dict:
    return {**{f"later_prompt_{n}_steps": f"<= {t}" for n, t in TARGETS.items()},
            "remembered_prompt": "~0" + ("" if remembered_measured else " (not measured)")}


def exclusions(paths: dict) -> list[str]:
    """Every case the JSON does not hold, and every labelled one-time cost a figure carries."""
    out = []
    for name, p in paths.items():
        if not isinstance(p["later_prompt"], dict):
            out.append(f"{name}: later prompt {p['later_prompt']}")
        if not isinstance(p["remembered_prompt"], dict):
            out.append(f"{name}: remembered prompt {p['remembered_prompt']}")
        for e in p["per_prompt"]:
            for label in e["includes"]:
                if label != FIRST_PROMPT:
                    out.append(f"{name}: prompt {e['prompt']} includes {label}")
        if p.get("timed_on"):
            out.append(f"{name}: {p['timed_on']}")
    return out


def _parse_includes(items) -> dict:
    """``KEY=TEXT`` items -> {KEY: [TEXT, ...]}."""
    out: dict = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key or not text:
            raise SystemExit(f"--includes {item!r}: KEY=TEXT")
        out.setdefault(key.strip(), []).append(text.strip())
    return out


def _earlier(path: str) -> dict:
    """What an earlier run's JSON (``--before``) said: its 30-step figure, and its shares if it has them."""
    with open(path) as f:
        before = json.load(f)
    key = f"probe_overhead_fraction_{OLD_RUN_STEPS}_steps_before"
    out = {"source": path, key: before.get(key, before.get("probe_overhead_fraction"))}
    if "summary" in before:
        out["summary"] = before["summary"]
    return out


def build(results: list[str], names: list[str], includes: dict, notes: list[str], before: str | None) -> dict:
    per_path: dict = {}
    for key, texts in includes.items():
        name, _, prompt = key.rpartition(":")
        if name not in names or not prompt.isdigit():
            raise SystemExit(f"--includes {key}: PATH:PROMPT with PATH one of {', '.join(names)}")
        per_path.setdefault(name, {}).setdefault(int(prompt), []).extend(texts)
    paths = {}
    for name, path in zip(names, results):
        with open(path) as f:
            paths[name] = {"source": path, **path_cost(json.load(f), per_path.get(name))}
    first = next(iter(paths.values()))
    old = f"probe_overhead_fraction_{OLD_RUN_STEPS}_steps_before"
    doc = {"harness": "bench.repro", "command": command("quality.quality_cost"), "tokens": first["tokens"],
           "gpu": first["gpu"], "repo_rev": sorted({p["repo_rev"] for p in paths.values()}),
           "formula": "share of the sampling time = (step 1 of the arm - step 1 of faults only) / (N x median step "
                      "from step 2 on), per prompt of one server, for N = the graph's own steps, 20 and 2",
           "schedules": {f"{n}_steps": why for n, why in SCHEDULES.items()},
           "summary": {name: {"first_prompt": p["first_prompt"], "later_prompt": p["later_prompt"],
                              "remembered_prompt": p["remembered_prompt"]} for name, p in paths.items()},
           "targets": targets(any(isinstance(p["remembered_prompt"], dict) for p in paths.values())),
           "target_met": _targets_met([p["later_prompt"] for p in paths.values()]),
           "exclusions": exclusions(paths), "notes": notes,
           f"formula_{OLD_RUN_STEPS}_steps_before": f"(step 1 of the arm - step 1 of faults only) / ({OLD_RUN_STEPS} "
                                                    "x median step from step 2 on); the last prompt's, the worst path",
           old: max(p[old] for p in paths.values()),
           "paths": paths}
    if before:
        doc["earlier_run"] = _earlier(before)
    return doc


# ------------------------------------------------------------------------------ older JSONs
def _renamed(d: dict, renames: dict, before: dict | None = None) -> dict:
    """``d`` with keys renamed where they stand; ``before``: {an earlier run's 30-step key: the key of
    the {"source", "probe_overhead_fraction_30_steps_before"} that replaces it and its ``_source``}."""
    before = before or {}
    out = {}
    for k, v in d.items():
        if k in before:
            out[before[k]] = {"source": d.get(k + "_source"),
                              f"probe_overhead_fraction_{OLD_RUN_STEPS}_steps_before": v}
        elif not any(k == b + "_source" for b in before):
            out[renames.get(k, k)] = v
    return out


#: the keys :func:`annotate` writes
ANNOTATED = ("annotated_by", "formula", "schedules", "graph_steps", "median_step_from_step2_s", "pairs", "summary",
             "targets", "target_met", "annotate_notes")


def annotate(doc: dict, includes: dict, notes: list[str]) -> dict:
    """Add the shares to an older hand-assembled JSON (see the module docstring); returns it."""
    raw = doc.get("raw") or {}
    runs = raw.get("runs") or []
    labels = [f"{i}:{r['arm']}" for i, r in enumerate(runs)]
    unknown = sorted(set(includes) - set(labels))
    if unknown:
        raise SystemExit(f"--includes names rows {unknown}; the raw rows are {', '.join(labels)}")
    ok = {lab: arm_steps(r)[0] for lab, r in zip(labels, runs) if r.get("rc") == 0 and arm_steps(r)}
    by_arm = {a: [lab for lab in ok if lab.split(":", 1)[1] == a] for a in (GUARDED, FAULTS)}
    if not by_arm[GUARDED] or not by_arm[FAULTS]:
        raise SystemExit(f"need completed raw rows of {GUARDED} and {FAULTS} (have: {', '.join(ok) or 'none'})")
    n = graph_steps_of([ok[lab] for a in by_arm.values() for lab in a], raw.get("steps"))
    median = statistics.median(s for a in by_arm.values() for lab in a for s in ok[lab][1:])
    pairs = []
    for g in by_arm[GUARDED]:
        for f in by_arm[FAULTS]:
            extra = ok[g][0] - ok[f][0]
            inc = [FIRST_PROMPT] + [FIRST_ROW for lab in (g, f) if lab == labels[0]]
            inc += [t for lab in (g, f) for t in includes.get(lab, [])]
            pairs.append({"guarded_row": g, "faults_row": f, "probe_extra_s": round(extra, 3),
                          "probe_share": shares(extra, n, median), "includes": inc})
    old = f"_{OLD_RUN_STEPS}_steps_before"
    if "annotated_by" in doc:           # annotated before: its keys are made again, nothing left to rename
        doc = {k: v for k, v in doc.items() if k not in ANNOTATED}
    renames = {k: k + old for k in ("probe_overhead_fraction", "probe_overhead_fraction_runs", "formula", "target",
                                    "target_met")}
    doc = _renamed(doc, renames, before={"probe_overhead_fraction_before": "earlier_run"})
    for key, sub in list(doc.items()):   # a nested figure of another bench (bench.quality.gpu_quality: 30 x the step)
        if isinstance(sub, dict) and "probe_overhead_fraction" in sub and key != "raw":
            doc[key] = _renamed(sub, {"probe_overhead_fraction": "probe_overhead_fraction" + old})
    rng = {k: [min(p["probe_share"][k] for p in pairs), max(p["probe_share"][k] for p in pairs)]
           for k in ["graph"] + [f"{s}_steps" for s in SCHEDULES]}
    doc.update({
        "annotated_by": command("quality.quality_cost"),
        "formula": "share of the sampling time = (step 1 of the node's defaults - step 1 of faults only) / (N x "
                   "median step from step 2 on) for N = the graph's own steps, 20 and 2; every node-default row "
                   "against every faults-only row of 'raw' (each a server's first prompt)",
        "schedules": {f"{s}_steps": why for s, why in SCHEDULES.items()},
        "graph_steps": n, "median_step_from_step2_s": round(median, 4), "pairs": pairs,
        "summary": {"first_prompt": {"probe_share_range": rng, "graph_steps": n,
                                     "includes_any_pair": sorted({t for p in pairs for t in p["includes"]})},
                    "later_prompt": NOT_MEASURED_LATER, "remembered_prompt": NOT_MEASURED_REMEMBERED},
        "targets": targets(), "target_met": _targets_met([NOT_MEASURED_LATER]),
        "annotate_notes": notes})
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="*", help="bench.repro all JSONs, one per sage path")
    ap.add_argument("--path", action="append", default=[], help="each result's sage path name, in order")
    ap.add_argument("--out", default=None)
    ap.add_argument("--annotate", default=None, metavar="JSON",
                    help="add the shares to this older hand-assembled JSON in place (its 'raw' rows)")
    ap.add_argument("--includes", action="append", default=[], metavar="CASE=TEXT",
                    help="what a case's step 1 carries besides the probe, named in the JSON (repeatable): "
                         "CASE is PATH:PROMPT (e.g. sage22_sm120:1), with --annotate a raw row (e.g. 2:safesage)")
    ap.add_argument("--note", action="append", default=[], help="a line for the JSON's notes (repeatable)")
    ap.add_argument("--before", default=None, help="an earlier run's JSON (its 30-step figure, its shares)")
    a = ap.parse_args(argv)
    includes = _parse_includes(a.includes)
    if a.annotate:
        if a.results or a.out or a.path:
            ap.error("--annotate takes no results, --path or --out")
        with open(a.annotate) as f:
            doc = annotate(json.load(f), includes, a.note)
        out = a.annotate
    else:
        if not a.results or not a.out:
            ap.error("give the results and --out (or --annotate JSON)")
        if len(a.path) != len(a.results):
            ap.error("one --path per result")
        doc = build(a.results, a.path, includes, a.note, a.before)
        out = a.out
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    for name, s in (doc["summary"].items() if "paths" in doc else [(out, doc["summary"])]):
        print(f"{name}: {json.dumps(s)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
