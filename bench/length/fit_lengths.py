"""Fit the length model's constants (safe_ops/ui/length_model.py) from the committed GPU runs and check its
longest lengths against the measured ones (issue #47 item 3). CPU only; writes safe_ops/facts/length_model.json.

  python3 -m bench.length.fit_lengths [--out safe_ops/facts/length_model.json]

Sources (all committed):
* bench/results/max_length_h100.json -- per arm, at 24 GiB free, each probe's frames, tokens, outcome and
  ``peak`` {torch_alloc_gib, nvml_process_gib} (``at_oom`` for an out-of-memory probe), and the
  ``references``: the ``pytorch`` arm at the same lengths without the hold (torch_alloc is the same with
  and without it: 18.92 GiB at 498 frames both ways, so the references are ComfyUI's own attention's
  torch peak at two more lengths);
* bench/results/repro_sage22_sm120_run2_h200.json -- the same 8-block checkpoint (4,118,715,592 bytes),
  ComfyUI 0dd9b154, sage 2.2.0's sm_120 path emulated, no hold that binds: unguarded sage's torch peak at
  two lengths the max-length search never ran (sage has one completed length there);
* bench/results/logs/maxlen_logs_24_h100.tar.xz -- each SafeSage probe's server log, whose "SafeSage plan
  for" line names the attention plan that probe ran.

What is fitted where (FIT): the per-token term on two completed lengths per arm that are not the arm's
measured longest where the data allow it (SafeSage: 651 and 719 frames; sage: the repro's 38k and 100k
sizes; ComfyUI's own: the references at 515 and 753 frames); the overhead (nvml_process - torch_alloc) at
a completed probe under the hold (SafeSage: the smaller of its two fit lengths'; sage and ComfyUI's own:
their only completed probe under the hold -- for sage its longest, so sage's check is not held out).
"""
from __future__ import annotations

import argparse
import io
import json
import lzma
import re
import tarfile
from pathlib import Path

from safe_ops.models.h3 import mlp_plan
from safe_ops.models.h3.dims import H3_FFN, H3_HIDDEN, h3_tokens
from safe_ops.policy import Policy
from safe_ops.ui import length_model as lm

ROOT = Path(__file__).resolve().parents[2]
GiB = 2 ** 30
MAX_LENGTH = "bench/results/max_length_h100.json"
REPRO = "bench/results/repro_sage22_sm120_run2_h200.json"
PLAN_LOGS = "bench/results/logs/maxlen_logs_24_h100.tar.xz"
OUT = "safe_ops/facts/length_model.json"
BUDGET = "24"                       # the measured budget the constants come from
UNMEASURED = ("32",)                # budgets predicted, never measured
#: per arm: the lengths (frames, or repro sizes) its per-token term and its overhead are fitted on
FIT = {
    "safesage": {"per_token": [("probe", 651), ("probe", 719)], "overhead": [("probe", 651), ("probe", 719)]},
    "sage": {"per_token": [("repro", "38k"), ("repro", "100k")], "overhead": [("probe", 515)]},
    "pytorch": {"per_token": [("reference", 515), ("reference", 753)], "overhead": [("probe", 498)]},
}
#: the arm's name in the repro file
REPRO_ARM = {"sage": "sage", "pytorch": "pytorch", "safesage": "safesage"}
SETUP = {"tree": "0dd9b154", "arch": [12, 0], "arch_name": "sm_120", "sage": "2.2.0", "weights": "fp8"}


def load(root: Path = ROOT) -> tuple[dict, dict, dict]:
    """(max_length JSON, repro JSON, {frames: logged plan line} of the SafeSage probes)."""
    ml = json.loads((root / MAX_LENGTH).read_text())
    repro = json.loads((root / REPRO).read_text())
    return ml, repro, logged_plans(root / PLAN_LOGS)


def logged_plans(path: Path) -> dict:
    """{frames: the plan SafeSage logged for its first attention call} from the SafeSage probes' logs."""
    out = {}
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(path.read_bytes()))) as tar:
        for m in tar.getmembers():
            hit = re.search(r"x(\d+)_safesage\.log$", m.name)
            if not hit:
                continue
            text = tar.extractfile(m).read().decode("utf-8", "replace")
            line = re.search(r"SafeSage plan for [^:]*: (.*)", text)
            if line:
                out[int(hit.group(1))] = line.group(1).split("; because")[0].strip()
    return out


def _probe(ml: dict, arm: str, frames: int) -> dict:
    return next(p for p in ml["budgets"][BUDGET]["arms"][arm]["probes"] if p["frames"] == frames)


def _point(ml: dict, repro: dict, arm: str, where: tuple) -> dict:
    """One measured completed length: {source, field, frames, tokens, torch_alloc_gib[, nvml_process_gib]}."""
    kind, key = where
    if kind == "probe":
        p = _probe(ml, arm, key)
        assert p["outcome"] == "completed", (arm, key)
        return {"source": MAX_LENGTH, "field": f"budgets.{BUDGET}.arms.{arm}.probes[frames={key}].peak",
                "frames": key, "tokens": p["tokens"], "torch_alloc_gib": p["peak"]["torch_alloc_gib"],
                "nvml_process_gib": p["peak"]["nvml_process_gib"]}
    if kind == "reference":
        r = ml["budgets"][BUDGET]["references"][str(key)]
        assert r["outcome"] == "completed", key
        tokens = h3_tokens(ml["width"], ml["height"], key, text_tokens=ml["text_tokens"]).total
        return {"source": MAX_LENGTH, "field": f"budgets.{BUDGET}.references.{key}.peak (pytorch arm, no hold)",
                "frames": key, "tokens": tokens, "torch_alloc_gib": r["peak"]["torch_alloc_gib"]}
    row = next(r for r in repro["runs"] if r["arm"] == REPRO_ARM[arm] and r["size"] == key)
    assert row["outcome"] == "completed", (arm, key)
    size = repro["sizes"][key]
    return {"source": REPRO, "field": f"runs[arm={row['arm']}, size={key}].worker.memory.torch_peak_allocated_gib",
            "size": f"{size['width']}x{size['height']}x{size['length']}", "tokens": row["worker"]["packed_tokens"],
            "torch_alloc_gib": row["worker"]["memory"]["torch_peak_allocated_gib"]}


def plan_budget_for(S: int, logged: str, scenario, policy) -> int:
    """The plan budget under which SafeSage's planner makes the plan a probe logged (the planner prices
    what the run ran); ValueError when none does."""
    from safe_ops.facts.budget import budget_bucket
    b = budget_bucket(64 * GiB)
    while b > 2 ** 20:
        plan = lm._plan_cached(S, b, tuple(scenario.arch), scenario.family, scenario.gpu, scenario.sage_version,
                               policy)
        if plan.describe(reasons=False) == logged:
            return b
        b = budget_bucket(b - 1)
    raise ValueError(f"no plan budget makes the logged plan at {S} tokens: {logged}")


def outside_pool(ml: dict) -> dict:
    """What the process held outside torch's pool when memory ran out (CUDA context, resident weights):
    F - torch_reserved - CUDA free at each out-of-memory probe, and their mean."""
    b = ml["budgets"][BUDGET]
    probes = []
    for arm, a in b["arms"].items():
        for p in a["probes"]:
            o = p.get("at_oom")
            if o:
                probes.append({"arm": arm, "frames": p["frames"],
                               "gib": round(b["free_gib"] - o["torch_reserved_gib"] - o["cuda_free_mib"] / 1024, 3),
                               "weights_resident_mib": o["weights_resident_mib"]})
    mean = sum(p["gib"] for p in probes) / len(probes)
    return {"bytes": round(mean * GiB), "gib": round(mean, 3), "probes": probes,
            "from": f"{MAX_LENGTH}: free_gib - at_oom.torch_reserved_gib - at_oom.cuda_free_mib, mean over the "
                    "out-of-memory probes (budgets.24.arms.*.probes[].at_oom)"}


def _line(points: list) -> tuple[float, float]:
    """(constant, per token) bytes of the least-squares line through (tokens, torch_alloc) points."""
    xs = [p["tokens"] for p in points]
    ys = [p["torch_alloc_gib"] * GiB for p in points]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def fit(ml: dict, repro: dict, plans: dict) -> dict:
    """The facts file's content: the constants, where each came from, and the check of the prediction."""
    policy = Policy()
    f: dict = {
        "about": "The length model's fitted constants (safe_ops/ui/length_model.py: one sampling step's peak per arm "
                 "= overhead + constant + per_token x tokens + SafeSage's own tensors), and its longest lengths "
                 "against the measured ones (issue #47 item 3). Made by python -m bench.length.fit_lengths; "
                 "tests/unit/test_length_model.py holds it equal to a fit from the committed sources.",
        "command": "python3 -m bench.length.fit_lengths",
        "sources": {"max_length": MAX_LENGTH, "repro": REPRO, "plans": PLAN_LOGS},
        "setup": dict(SETUP, gpu=ml["gpu"], width=ml["width"], height=ml["height"], blocks=ml["blocks"],
                      steps=ml["steps"], text_tokens=ml["text_tokens"], repo_rev=ml["repo_rev"],
                      emulate_arch=ml["emulate_arch"], ckpt_bytes=ml["ckpt_bytes"]),
        "outside_pool": outside_pool(ml),
        "arms": {},
    }
    scenario = None
    # the unguarded arms: a line through their torch peaks (ComfyUI's unchunked MLP is their peak)
    for arm in ("pytorch", "sage"):
        pts = [_point(ml, repro, arm, w) for w in FIT[arm]["per_token"]]
        c, b = _line(pts)
        f["arms"][arm] = {"phase": "mlp", "constant_bytes": round(c), "per_token_bytes": round(b, 1),
                          "per_token_on": pts}
    # SafeSage: its attention call's activations, through the origin, after its own tensors there (the
    # logged plan, as its planner prices it); the overhead needs the scenario the plans were made in
    f["mlp_phase"] = {"constant_bytes": f["arms"]["pytorch"]["constant_bytes"],
                      "per_token_bytes": round(f["arms"]["pytorch"]["per_token_bytes"]
                                               - mlp_plan.per_token_bytes(H3_HIDDEN, H3_FFN, 2), 1),
                      "from": "the pytorch arm's line less the unchunked H3 MLP's own intermediates "
                              "(mlp_plan.per_token_bytes, 116,480 bytes a token): ComfyUI's activations "
                              "outside the MLP while it runs, for SafeSage's chunked MLP phase"}
    scenario = lm.measured_scenario(f)
    pts = []
    for w in FIT["safesage"]["per_token"]:
        p = _point(ml, repro, "safesage", w)
        budget = plan_budget_for(p["tokens"], plans[p["frames"]], scenario, policy)
        plan = lm._plan_cached(p["tokens"], budget, tuple(scenario.arch), scenario.family, scenario.gpu,
                               scenario.sage_version, policy)
        p.update(plan=plans[p["frames"]], plan_budget_bytes=budget,
                 own_gib=round(lm.own_attention_bytes(p["tokens"], plan) / GiB, 3))
        pts.append(p)
    num = sum((p["torch_alloc_gib"] * GiB - lm.own_attention_bytes(p["tokens"], lm._plan_cached(
        p["tokens"], p["plan_budget_bytes"], tuple(scenario.arch), scenario.family, scenario.gpu,
        scenario.sage_version, policy))) * p["tokens"] for p in pts)
    b = num / sum(p["tokens"] ** 2 for p in pts)
    f["arms"]["safesage"] = {"phase": "attention", "constant_bytes": 0, "per_token_bytes": round(b, 1),
                             "per_token_on": pts,
                             "constant_why": "through the origin: the unguarded arms' fitted constants are "
                                             "0.03-0.04 GiB, and two lengths 10 % apart with a plan each "
                                             "would fit the plans' rounding instead"}
    # the overhead of each arm: nvml_process - torch_alloc at its completed probe(s) under the hold
    pool = f["outside_pool"]["bytes"]
    for arm, a in f["arms"].items():
        ov = [_point(ml, repro, arm, w) for w in FIT[arm]["overhead"]]
        over = min((p["nvml_process_gib"] - p["torch_alloc_gib"]) * GiB for p in ov)
        a["overhead_bytes"] = round(over)
        a["allocator_slack_bytes"] = round(over - pool)
        a["overhead_on"] = [{k: p[k] for k in ("source", "field", "frames", "tokens", "torch_alloc_gib",
                                                "nvml_process_gib")} for p in ov]
        a["overhead_from"] = ("nvml_process_gib - torch_alloc_gib at a completed probe under the hold"
                              + (", the smaller of the two" if len(ov) > 1 else "")
                              + "; of it, outside_pool is the CUDA context and the resident weights, the rest "
                                "the allocator's slack (and weights dynamic VRAM had not evicted)")
    f["arms"] = {arm: f["arms"][arm] for arm in lm.ARMS}
    f["points"] = reproduce(f, ml, repro, plans)
    f["budgets"] = check(f, ml)
    return f


def reproduce(f: dict, ml: dict, repro: dict, plans: dict) -> dict:
    """Per arm, every completed length measured: the model's torch-side peak (activations + own, with the
    plan SafeSage's budget rule makes) next to the measured torch_alloc, and whether the length was fitted
    on; for SafeSage also the plan the model makes next to the one each probe logged (the failed ones too)."""
    out = {}
    fitted = {arm: {w for w in FIT[arm]["per_token"]} for arm in lm.ARMS}
    b = ml["budgets"][BUDGET]
    free = int(b["free_gib"] * GiB)
    for arm in lm.ARMS:
        where = [("probe", p["frames"]) for p in b["arms"][arm]["probes"] if p["outcome"] == "completed"]
        if arm == "pytorch":
            where += [("reference", int(n)) for n, r in b["references"].items() if r["outcome"] == "completed"]
        where += [w for w in FIT[arm]["per_token"] if w not in where]
        rows = []
        for w in sorted(where, key=lambda w: _point(ml, repro, arm, w)["tokens"]):
            p = _point(ml, repro, arm, w)
            pk = lm.step_peak(arm, p["tokens"], free, f=f)
            own = lm.own_attention_bytes(p["tokens"], pk.planned) if arm == "safesage" else pk.own
            row = {"where": f"{w[0]} {w[1]}", "tokens": p["tokens"], "measured_torch_alloc_gib": p["torch_alloc_gib"],
                   "model_torch_alloc_gib": round((pk.activations + own) / GiB, 3), "fitted_on": w in fitted[arm]}
            if arm == "safesage":
                row.update(plan_logged=plans.get(w[1]), plan_model=pk.planned.describe(reasons=False))
            rows.append(row)
        if arm == "safesage":
            for p in b["arms"][arm]["probes"]:
                if p["outcome"] != "completed" and p["frames"] in plans:
                    pk = lm.step_peak(arm, p["tokens"], free, f=f)
                    rows.append({"where": f"probe {p['frames']} ({p['outcome']})", "tokens": p["tokens"],
                                 "plan_logged": plans[p["frames"]], "plan_model": pk.planned.describe(reasons=False)})
        out[arm] = rows
    return out


def check(f: dict, ml: dict) -> dict:
    """Per budget (the measured one, and UNMEASURED ones: predicted, unverified), per arm: the predicted
    longest length, and against the measured one: ``preflight_over_measured`` (tokens), whether the
    measured failing length is predicted to fail, and whether the measured longest was a fit length."""
    out = {}
    w, h, t = ml["width"], ml["height"], ml["text_tokens"]
    for key in [BUDGET] + list(UNMEASURED):
        free = int(float(key) * GiB)
        arms = {}
        for arm in lm.ARMS:
            lg = lm.longest(arm, free, w, h, text_tokens=t, f=f)
            row = {"predicted_frames": lg.frames, "predicted_tokens": lg.tokens,
                   "predicted_peak_gib": round(lg.peak.total / GiB, 3) if lg.peak else None,
                   "next_frames": lg.next_frames,
                   "next_peak_gib": round(lg.next_peak.total / GiB, 3) if lg.next_peak else None}
            m = (ml["budgets"].get(key) or {}).get("arms", {}).get(arm)
            if m is not None:
                fail = m["fail_above_tokens"]
                fitted = {x[1] for x in FIT[arm]["per_token"] + FIT[arm]["overhead"]}
                row.update(measured_max_frames=m["max_frames"], measured_max_tokens=m["max_tokens"],
                           measured_fail_frames=m["fail_above_frames"], measured_fail_tokens=fail,
                           preflight_over_measured=round(lg.tokens / m["max_tokens"], 3),
                           within_15pct=abs(lg.tokens / m["max_tokens"] - 1) <= 0.15,
                           fail_predicted=not lm.step_peak(arm, fail, free, f=f).fits,
                           measured_longest_fitted_on=m["max_frames"] in fitted)
            arms[arm] = row
        out[key] = {"free_gib": float(key), "measured": key in ml["budgets"], "arms": arms}
        if key in UNMEASURED:
            out[key]["note"] = (f"never measured: predicted with the {BUDGET} GiB constants (the same overhead "
                                "and per-token terms), unverified")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / OUT))
    a = ap.parse_args(argv)
    f = fit(*load())
    Path(a.out).write_text(json.dumps(f, indent=1) + "\n")
    for key, b in f["budgets"].items():
        print(key, "GiB", {arm: (r["predicted_frames"], r.get("preflight_over_measured")) for arm, r in b["arms"].items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
