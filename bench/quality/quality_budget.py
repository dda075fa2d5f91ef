"""The quality guard's speed budget per drift layout and sage path (issue 46 goal 8; device, or a CPU
smoke run with the tests' fake families).

bench/quality/gpu_quality_profiles.py's H3-shaped stack (56 heads x 128, bf16, 50 blocks, 8,192 tokens), its
drift laid out as ``default``, ``heads``, ``keys``, ``gradual`` or ``majority_informative`` (that
module's docstring; the last one's factor is the first of ``--informative-factors`` whose SDPA-only
final error is under :data:`INFORMATIVE_BOUND`, each tried factor recorded). Arms, one process per sage
path (sage 1 and 2 are one package name), ComfyUI's attention_sage the function handed to the override
(ComfyUI started with --use-sage-attention):

* ``guard_first``: SafeSage at the node's defaults (kernel=auto, quality=balanced), a model's first
  prompt -- step 1 runs the plan the speed budget picked and measures, step 2 runs the choices;
* ``guard_remembered``: the same node and model key (``guard.run_started`` with a stand-in patcher:
  base model and patches_uuid), prompts 2 and 3 -- no probe, the choices from step 1 (quality/memory.py);
* ``sage_only``, ``kitchen_only``, ``sage2_sm80_only``: that kernel for every block (kernel=sage with
  it alone, quality "faults only"); ``sdpa_only``: ComfyUI's own attention for every block.

Per arm: ``final_error`` (the run's last step: the stack's output, rel. L2 against the same stack with
float32 attention), the family each block ran, the blocks moved and to what (``rule`` budget /
target), ``predicted_attention_cost`` and, beside it, ``step_ratio_measured`` (the arm's median step
over sage_only's on this GPU). The predicted cost is the mean over blocks of each block's family's
predicted attention time for the stack's call relative to the sage family's, priced as the guard
prices plans (attention/speed_budget.price: the speed table's TFLOP/s and the family's plan for the
call), with every input's provenance and the blocks' range, labelled :data:`LABEL`; None where a block's
family has no known speed on the emulated arch.

Targets (issue 46): where single kernels' costs are known (the sm_120 path), the remembered guard's
final error <= :data:`ERROR_FACTOR` x the best single kernel whose cost is within the budget, at a
predicted cost within the budget; ``sage2_sm80_only`` beside it. Elsewhere ``budget_went`` says where
the budget went. ``misses`` lists every target missed and every layout outside its definition.

    PYTHONPATH=$PYTHONPATH:$SS_COMFY python3 -m bench.quality.quality_budget --emulate-arch sm120 --path sage22_sm120 --out A.json
    python3 -m bench.quality.quality_budget --merge A.json B.json C.json --repo-rev REV --out bench/results/quality_budget_h100.json
    SAFESAGE_EXTRA_FAMILIES=tests.unit.fake_quality_families python3 -m bench.quality.quality_budget --cpu --tiny --out /tmp/qb.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import types

import torch

from bench.common.benchutil import emulate_dispatch, emulated_runtime, env_info
from bench.quality.gpu_quality import DIM, HEADS, rel, timed
from bench.quality.gpu_quality_profiles import ProfileStack, profile_blocks

LAYOUTS = ("default", "heads", "keys", "gradual", "majority_informative")
SINGLE = {"sage_only": "sage", "kitchen_only": "ck", "sage2_sm80_only": "sage2_sm80", "sdpa_only": "sdpa"}
GUARD = ("guard_first", "guard_remembered")
ARMS = GUARD + tuple(SINGLE)
#: ``majority_informative``: SDPA-only's final error stays under this (issue 46: "informative")
INFORMATIVE_BOUND = 0.1
#: the remembered guard's final error may be at most this many times the best single kernel's (issue 46)
ERROR_FACTOR = 1.2
LABEL = "predicted, not timed on an RTX card"
TINY = {"tokens": 64, "blocks": 10, "heads": 4, "dim": 32}


def attention_sage(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                   **kw):
    """The CPU run's stand-in for ComfyUI's attention_sage (its name says sage: what --use-sage-attention
    hands the override), HND in and out as the stack calls it; PyTorch's SDPA."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=kw.get("scale"))


# ------------------------------------------------------------------------------ prices
def stack_prices(q, k, v, kernels: dict, sage: str, rt) -> dict:
    """family -> {"ratio": predicted attention time of its plan for the stack's call relative to
    ``sage``'s (None: no known speed here, or no plan), "speed": the number's provenance, "plan"}, for
    every kernel in ``kernels`` and ComfyUI's own (sdpa), as attention/speed_budget.price prices them."""
    from safe_ops.attention.call_forms import describe_tensor
    from safe_ops.attention.planner import estimated_us, plan_for
    from safe_ops.attention.speed_budget import price
    from safe_ops.facts.speed_table import speeds
    from safe_ops.families.envelope import AttnCall
    from safe_ops.families.registry import table_aliases
    from safe_ops.families.sdpa import SDPA

    call = AttnCall(describe_tensor(q), describe_tensor(k), describe_tensor(v), str(q.dtype).replace("torch.", ""),
                    "HND", False, q.device.type, rt.arch_name, q.element_size())
    planned = plan_for(call, kernels[sage].envelope)
    if planned is None:
        return {}
    costs = price(call, planned, kernels, rt.arch_name, rt.device_name, None)
    table = speeds(rt.arch_name, rt.device_name, table_aliases())
    base = estimated_us(call, planned, table[sage].tflops) if sage in table else None
    sdpa_plan = plan_for(call, SDPA)
    ratio = (estimated_us(call, sdpa_plan, table["sdpa"].tflops) / base
             if base and sdpa_plan is not None and "sdpa" in table else None)
    out = {"sdpa": {"ratio": None if ratio is None else round(ratio, 4),
                    "speed": table["sdpa"].provenance() if "sdpa" in table else None, "plan": "ComfyUI's own"}}
    for name, c in costs.items():
        out[name] = {"ratio": None if c.ratio is None else round(c.ratio, 4),
                     "speed": c.speed.provenance() if c.speed is not None else None,
                     "plan": c.plan.describe(False) if c.plan is not None else None}
    return out


def predicted(families: list, prices: dict) -> dict:
    """The predicted attention cost of blocks running ``families`` (one per block; None: unknown):
    the mean of their ratios, their range, how many are unknown, and the inputs' provenance."""
    ratios = [(prices.get(f) or {}).get("ratio") for f in families]
    known = [r for r in ratios if r is not None]
    unknown = len(ratios) - len(known)
    return {"value": round(sum(known) / len(known), 4) if known and not unknown else None,
            "range": [min(known), max(known)] if known else None, "unknown_blocks": unknown,
            "inputs": sorted({prices[f]["speed"] for f in set(families) if (prices.get(f) or {}).get("speed")}),
            "label": LABEL}


def tally(families: list) -> dict:
    out: dict = {}
    for f in families:
        out[str(f)] = out.get(str(f), 0) + 1
    return out


def moves(blocks: list[dict]) -> dict:
    """The blocks a guard run moved, by rule, and to what."""
    moved = [b for b in blocks if b.get("moved")]
    return {"blocks_moved": len(moved), "by_rule": tally([b.get("rule") or "?" for b in moved]),
            "moved_to": tally([b["family"] for b in moved]),
            "planned": tally([b["planned"] for b in blocks])}


# ------------------------------------------------------------------------------ records
def single_record(out_err: float | None, ms: list, family: str, nblocks: int, prices: dict, stats: dict) -> dict:
    return {"final_error": out_err, "step_ms": round(statistics.median(ms), 1) if ms else None,
            "families": {family: nblocks}, "predicted_attention_cost": predicted([family] * nblocks, prices),
            "ran": {k: stats.get(k) for k in ("plans", "fallbacks", "fallback_reasons", "failed_checks",
                                               "disabled_families")}}


def guard_record(prompts: list[dict], nblocks: int, prices: dict, factors: list) -> dict:
    """One guard arm from its prompts (each: final_error, step1_error, ms [step 1, step 2], probes,
    recalled, choices -- the run's quality_last_run["choices"]): the first prompt's fields, the step
    times of all, the families per block from the choices (``runs_now``; step 1 of a first prompt ran
    the plans, ``planned``)."""
    first = prompts[0]
    ch = first.get("choices") or {}
    blocks = {b["block"]: b for b in ch.get("blocks", [])}
    runs = [(blocks.get(i) or {}).get("runs_now") for i in range(nblocks)]
    step1 = [(blocks.get(i) or {}).get("planned") for i in range(nblocks)]
    remembered = ch.get("source") == "remembered"
    ms = [m for p in prompts for m in (p["ms"] if remembered else p["ms"][1:])]
    return {"final_error": first["final_error"], "step1_final_error": first["step1_error"],
            "later_final_errors": [p["final_error"] for p in prompts[1:]],
            "step_ms": round(statistics.median(ms), 1) if ms else None, "step1_ms": round(first["ms"][0], 1),
            "source": ch.get("source"), "budget": ch.get("budget"), "probes": [p["probes"] for p in prompts],
            "recalled_blocks": [p["recalled"] for p in prompts],
            "families": tally(runs), "predicted_attention_cost": predicted(runs, prices),
            "step1_families": tally(runs if remembered else step1),
            "step1_predicted_attention_cost": predicted(runs if remembered else step1, prices),
            "guard_report_cost": ch.get("cost"), "lines": ch.get("lines"), **moves(list(blocks.values())),
            "blocks": [{"block": b["block"], "factor": factors[b["block"]], "planned": b["planned"],
                        "planned_error": b["planned_error"], "family": b["family"], "runs_now": b.get("runs_now"),
                        "error": b["error"], "target": b["target"], "rule": b.get("rule"), "cost": b.get("cost"),
                        "candidates": b.get("candidates")} for b in blocks.values()]}


def target(arms: dict, budget: float) -> dict:
    """Issue 46's target for one layout and path (module docstring)."""
    within = {a: arms[a]["final_error"] for a in SINGLE if a in arms and arms[a].get("final_error") is not None
              and (c := arms[a]["predicted_attention_cost"]["value"]) is not None and c <= budget + 1e-9}
    g = arms.get("guard_remembered") or {}
    if not within or g.get("final_error") is None:
        return {"applies": False, "why": "no single kernel's cost is known and within the budget here"
                if not within else "no remembered guard run"}
    best = min(within, key=within.get)
    cost = g["predicted_attention_cost"]["value"]
    err_ok = g["final_error"] <= ERROR_FACTOR * within[best] + 1e-12
    cost_ok = cost is not None and cost <= budget + 1e-9
    return {"applies": True, "rule": f"guard_remembered final_error <= {ERROR_FACTOR} x the best single kernel "
                                     f"whose cost is known and within {budget}, at predicted_attention_cost <= {budget}",
            "best_single": best, "best_single_error": within[best], "bound": round(ERROR_FACTOR * within[best], 5),
            "guard_remembered_error": g["final_error"], "guard_remembered_cost": cost, "budget": budget,
            "error_met": err_ok, "cost_met": cost_ok, "met": err_ok and cost_ok,
            "sage2_sm80_only_error": (arms.get("sage2_sm80_only") or {}).get("final_error")}


def budget_went(arms: dict, line: str) -> str:
    """Where the budget went on a path: the status line, and what the guard's moves were."""
    g = arms.get("guard_first") or {}
    rules = g.get("by_rule") or {}
    return (f"{line}. First prompt: {g.get('blocks_moved', 0)} block(s) moved (budget {rules.get('budget', 0)}, "
            f"target {rules.get('target', 0)}) to {g.get('moved_to') or {}}; blocks ran {g.get('families')}")


def misses(doc: dict) -> list[str]:
    out = []
    for lname, lay in doc["layouts"].items():
        for path, res in lay["paths"].items():
            t = res.get("target") or {}
            if t.get("applies") and not t.get("met"):
                out.append(f"{lname} / {path}: remembered guard {t['guard_remembered_error']} "
                           f"(bound {t['bound']} = {ERROR_FACTOR} x {t['best_single']}) at predicted cost "
                           f"{t['guard_remembered_cost']} (budget {t['budget']})")
            sd = (res["arms"].get("sdpa_only") or {}).get("final_error")
            if lname == "majority_informative" and (sd is None or sd >= INFORMATIVE_BOUND):
                out.append(f"{lname} / {path}: sdpa_only final error {sd}, not under {INFORMATIVE_BOUND}")
    return out


def merge(docs: list[dict], repo_rev: str | None = None, note: str | None = None) -> dict:
    """Per-path results (one process's each) as one: ``layouts[name]["paths"][path]``."""
    out = {"harness": "bench.quality.quality_budget", "label": LABEL, "repo_rev": repo_rev, "note": note, "paths": {},
           "layouts": {}}
    for d in docs:
        for path, p in d["paths"].items():
            out["paths"][path] = p
        for lname, lay in d["layouts"].items():
            dst = out["layouts"].setdefault(lname, {k: v for k, v in lay.items() if k != "paths"})
            if dst.get("factors") != lay.get("factors"):     # majority_informative calibrated apart per path
                dst.setdefault("factors_per_path", {}).update({p: lay.get("factors") for p in lay["paths"]})
            dst.setdefault("paths", {}).update(lay["paths"])
    first = next(iter(out["paths"].values()), {})
    for key in ("gpu", "tokens", "blocks", "heads", "seed", "budget", "policy"):
        out[key] = first.get(key)
    out["target_rule"] = (f"where single kernels' costs are known: guard_remembered final_error <= {ERROR_FACTOR} x "
                          "the best single kernel whose predicted cost is within the budget, at a predicted cost "
                          "within the budget; sdpa_only under 0.1 on majority_informative")
    out["misses"] = misses(out)
    return out


# ------------------------------------------------------------------------------ the run
def reference(stack, x0, dev, cache: str | None):
    """The stack's output with float32 attention (cached per stack and input under ``cache``)."""
    key = hashlib.sha1(json.dumps([stack.spec, list(x0.shape), stack.heads, stack.dim, str(x0.dtype)]).encode())
    path = os.path.join(cache, f"qb_{key.hexdigest()[:16]}.pt") if cache else None
    if path and os.path.exists(path):
        return torch.load(path).to(dev), None
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def fp32(i, q, k, v):
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION if dev.type == "cuda" else SDPBackend.MATH):
            return torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    ref, ms = timed(lambda: stack.run(x0, fp32))
    if path:
        os.makedirs(cache, exist_ok=True)
        torch.save(ref.cpu(), path)
    return ref, ms


class _Model:
    """Stands for the base model the guard remembers errors of (weakly referenced)."""


def run_path(a) -> dict:
    from safe_ops.attention.override import SafeAttention
    from safe_ops.attention.speed_budget import budget_line, speed_budget
    from safe_ops.facts.devices import runtime
    from safe_ops.families.registry import family_kind, installed_kernels, kernel_of
    from safe_ops.policy import Policy
    from safe_ops.quality import guard as qguard
    from safe_ops.quality import memory
    from safe_ops.ui import run_stats

    dims = dict(TINY) if a.tiny else {"tokens": a.tokens, "blocks": a.blocks, "heads": HEADS, "dim": DIM}
    dev = torch.device("cpu" if a.cpu else "cuda")
    dt = torch.float32 if a.cpu else torch.bfloat16
    real_arch = None
    if a.cpu:
        rt, func = runtime(), attention_sage
    else:
        real_arch = emulate_dispatch(a.emulate_arch)
        rt = emulated_runtime(a.emulate_arch)
        import comfy.ldm.modules.attention as comfy_att
        func = getattr(comfy_att.attention_sage, "__wrapped__", comfy_att.attention_sage)
    installed = installed_kernels(rt)

    def first_of(kind):
        return next((k for k in installed if family_kind(k.family) == kind and not getattr(k, "move_only", False)), None)
    kern = {"sage": kernel_of(rt.sage_family) or first_of("sage"), "ck": kernel_of(rt.ck_family) or first_of("ck"),
            "sage2_sm80": kernel_of("sage2_sm80")}
    budget = speed_budget("balanced")
    path = {**env_info("quality.quality_budget"), "emulated_arch": None if a.cpu else a.emulate_arch, "real_arch": real_arch,
            **dims, "seed": a.seed, "budget": budget, "reps": a.reps,
            "policy": {"kernel": "auto", "quality": "balanced", "comfy_function": func.__name__,
                       "comfy_flag": "--use-sage-attention"},
            "families": {k: (v.family if v is not None else None) for k, v in kern.items()},
            "installed": [k.family for k in installed], "runtime": rt.summary()}
    path["budget_line"] = budget_line("balanced", "auto", rt.arch_name, rt.device_name, path["installed"],
                                      path["families"]["sage"])
    doc = {"paths": {a.path: path}, "layouts": {}}
    sched = torch.tensor([1.0, 0.5, 0.0], device=dev)
    H = dims["heads"]
    x0 = torch.randn(1, dims["tokens"], H * dims["dim"], generator=torch.Generator().manual_seed(100 + a.seed)).to(dev, dt)

    def step(att, stack, i):
        att.quality.forward_start({"sigmas": sched[i:i + 1], "sample_sigmas": sched}, att.kernel_sites())
        return timed(lambda: stack.run(x0, lambda b, q, k, v: att(
            func, q, k, v, H, skip_reshape=True, skip_output_reshape=True, transformer_options={"block_index": b})))

    def save():
        with open(a.out, "w") as fh:
            json.dump(merge([doc], a.repo_rev), fh, indent=1)

    for lname in a.layouts.split(","):
        tried = [None] if lname != "majority_informative" else [float(f) for f in a.informative_factors.split(",")]
        calibration = []
        for factor in tried:           # majority_informative: the first factor whose SDPA-only error is under the bound
            spec = profile_blocks(lname, dims["blocks"], heads=H, factor=factor)
            stack = ProfileStack(a.seed, spec, dev, dt, heads=H, dim=dims["dim"])
            ref, ref_ms = reference(stack, x0, dev, a.ref_cache)
            if factor is None:
                break
            sd = SafeAttention(Policy(kernel="sdpa", quality="faults only"), rt=rt)
            calibration.append({"factor": factor, "sdpa_only_error": round(rel(step(sd, stack, 0)[0], ref), 5)})
            qguard.run_ended()
            if calibration[-1]["sdpa_only_error"] < INFORMATIVE_BOUND:
                break
        lay = doc["layouts"][lname] = {"factors": [s["factor"] for s in spec], "drift_heads": spec[-1]["heads"],
                                       "keys_only": spec[-1]["keys_only"],
                                       "drifting_blocks": sum(s["factor"] != 1 for s in spec), "paths": {}}
        nb = dims["blocks"]
        q, k, v = stack.qkv(0, x0)
        guard_att = SafeAttention(Policy(kernel="auto", quality="balanced"), rt=rt)
        prices = stack_prices(q, k, v, {**guard_att.kernels, **{n: x for n, x in kern.items() if x is not None}},
                              kern["sage"].family, rt) if kern["sage"] is not None else {}
        arms: dict = {}
        res = lay["paths"][a.path] = {"fp32_ms": None if ref_ms is None else round(ref_ms, 1), "prices": prices,
                                      "move_order": guard_att.quality_order(func), "arms": arms}
        if calibration:
            res["informative_calibration"] = calibration
        for arm, which in SINGLE.items():
            kk = kern.get(which)
            if which != "sdpa" and kk is None:
                arms[arm] = {"final_error": None, "skipped": f"{which}: not installed here"}
                continue
            att = (SafeAttention(Policy(kernel="sdpa", quality="faults only"), rt=rt) if which == "sdpa" else
                   SafeAttention(Policy(kernel="sage", quality="faults only"), kernels=[kk], rt=rt))
            step(att, stack, 0)                              # warm-up (first-call checks, JIT)
            qguard.run_ended()
            run_stats.reset()
            ms, out = [], None
            for _ in range(a.reps):
                out, t = step(att, stack, 0)
                ms.append(t)
                qguard.run_ended()
            arms[arm] = single_record(round(rel(out, ref), 5), ms, kk.family if kk else "sdpa", nb, prices,
                                      run_stats.snapshot())
        # the guard: a warm-up run that remembers nothing, then prompts 1-3 of one model
        qguard.run_started(None)
        step(guard_att, stack, 0)
        step(guard_att, stack, 1)
        qguard.run_ended()
        memory.forget()
        model = _Model()
        patcher = types.SimpleNamespace(model=model, patches_uuid=f"quality_budget:{lname}")
        prompts = []
        for _ in range(3):
            before = run_stats.snapshot().get("quality") or {}
            qguard.run_started(patcher)
            o1, m1 = step(guard_att, stack, 0)
            o2, m2 = step(guard_att, stack, 1)
            qguard.run_ended()
            snap = run_stats.snapshot()
            qs = snap.get("quality") or {}
            prompts.append({"final_error": round(rel(o2, ref), 5), "step1_error": round(rel(o1, ref), 5),
                            "ms": [m1, m2], "probes": qs.get("probes", 0) - before.get("probes", 0),
                            "recalled": qs.get("recalled_blocks", 0) - before.get("recalled_blocks", 0),
                            "choices": (snap.get("quality_last_run") or {}).get("choices")})
        arms["guard_first"] = guard_record(prompts[:1], nb, prices, lay["factors"])
        arms["guard_remembered"] = guard_record(prompts[1:], nb, prices, lay["factors"])
        sage_ms = (arms.get("sage_only") or {}).get("step_ms")
        for rec in arms.values():
            rec["step_ratio_measured"] = (round(rec["step_ms"] / sage_ms, 4)
                                          if sage_ms and rec.get("step_ms") else None)
        res["target"] = target(arms, budget)
        res["budget_went"] = budget_went(arms, path["budget_line"])
        print(lname, a.path, json.dumps({n: (r.get("final_error"), r.get("predicted_attention_cost", {}).get("value"),
                                              r.get("step_ratio_measured")) for n, r in arms.items()}),
              json.dumps({k: res["target"].get(k) for k in ("applies", "met", "best_single")}), flush=True)
        save()
        del guard_att, model
        memory.forget()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    save()
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="join per-path results (no GPU)")
    ap.add_argument("--repo-rev", default=None)
    ap.add_argument("--note", default=None, help="with --merge: a note for the result")
    ap.add_argument("--path", default=None, help="this run's path name, e.g. sage22_sm120")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--informative-factors", default="8,6,4",
                    help="majority_informative: factors tried in order until SDPA-only's final error is under 0.1")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--blocks", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=3, help="timed steps per single-kernel arm")
    ap.add_argument("--emulate-arch", default="sm120", help="the user's GPU arch SafeSage and sage dispatch for")
    ap.add_argument("--ref-cache", default=None, help="folder for the float32 reference outputs (shared by paths)")
    ap.add_argument("--cpu", action="store_true", help="on the CPU (with SAFESAGE_EXTRA_FAMILIES' fake families)")
    ap.add_argument("--tiny", action="store_true", help=f"a tiny stack: {TINY}")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.merge:
        docs = []
        for name in a.merge:
            with open(name) as f:
                docs.append(json.load(f))
        doc = merge(docs, a.repo_rev, a.note)
        with open(a.out, "w") as fh:
            json.dump(doc, fh, indent=1)
        print("wrote", a.out, "misses:", json.dumps(doc["misses"], indent=1))
        return 0
    a.path = a.path or ("cpu" if a.cpu else a.emulate_arch)
    run_path(a)
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
