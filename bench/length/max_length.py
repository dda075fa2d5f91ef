"""The longest MiniMax H3 video that completes with correct output, per arm, on a card with a given
free memory (issue #40): real ComfyUI through the reporter's graph (bench.repro: one fresh server per
probe, dynamic VRAM), H3-shaped blocks (bench/common/synth_h3.py), 1 step, at one width x height.

  python3 -m bench.length.max_length --comfy COMFY --ckpt CKPT --budget-gib 24 [--arms safesage sage pytorch]
      --emulate-arch sm120 --out bench/results/max_length_h100.json [...]

Per budget: Preflight's prediction per arm (safe_ops.ui.length_model.longest: the longest length whose
predicted step peak fits the budget, with the constants of safe_ops/facts/length_model.json); then a memory hold (bench.repro.driver.Ballast, one process kept
for the whole budget) so that only the budget stays free, and per arm a search over H3's frame grid
(17k+5, ``max_length_search.search``): the first probe at the arm's predicted length (or ``--start-frames``),
geometric steps up or down, then bisection, at most ``--probe-limit`` probes. After the hold: each
arm's longest completed length is checked against ComfyUI's own attention (the ``pytorch`` arm) at
the same length run WITHOUT the hold, by bench/repro/verdict.py's rule (wrong above WRONG_FACTOR x
the in-limit error: unguarded sage vs pytorch at ``--in-limit-size`` (38k), the same checkpoint,
steps, seed and arch; measured first in the call unless given or already in the JSON). A reference
that cannot run leaves the length "unverified". References are kept in ``--ref-dir`` for later calls.

The JSON (``--out``) is rewritten after every probe and merged into an earlier call's (``--merge``,
default ``--out``), so a 32 GiB call adds to a 24 GiB one. Arms: safesage (SafeSageAttention node
defaults, --use-sage-attention), sage (unguarded; with --emulate-arch sm120, sage 2.2.0's sm_120 path),
pytorch (ComfyUI's own SDPA), sage1 (the sage arm with ``--sage1-pythonpath``, e.g. sage 1.0.6).
comfy-kitchen's int8_attention has no arm: ``--use-ck-attention`` exists only in ComfyUI after
0dd9b154 (783545f6 and later), not in the tree this harness runs.
No GPU work in this process: the servers and the hold do it (torch only loads latents on the CPU).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

from bench.common.benchutil import arch_capability
from bench.length.max_length_search import (COMPLETED, UNFINISHED, arm_summary, budget_key, classify, fmt_gib, judge,
                                     merge, preflight_vs_measured, ratios, search)
from bench.repro import arms as rarms
from bench.repro import driver, logs, verdict, worker
from safe_ops.facts.devices import Runtime, sage_family_for
from safe_ops.models.h3.dims import h3_tokens
from safe_ops.ui import length_model
from safe_ops.ui.preflight import MAX_LENGTH, grid_lengths, scenarios_for

GiB = 2 ** 30
ARMS = {"safesage": "safesage", "sage": "sage", "pytorch": "pytorch", "sage1": "sage"}   # -> bench.repro arm
PREFLIGHT_MODEL = ("Preflight's length model (safe_ops/ui/length_model.py): a step's peak per arm = the overhead "
                   "outside the live tensors + ComfyUI's activations per token + SafeSage's own tensors (its "
                   "attention plan within the memory left, the result and its copy), constants fitted on earlier "
                   "GPU runs (safe_ops/facts/length_model.json)")
#: the length model's arm for each arm here (sage 1.0.6 unguarded: as sage, ComfyUI's unchunked MLP is the peak)
MODEL_ARM = {"safesage": "safesage", "sage": "sage", "pytorch": "pytorch", "sage1": "sage"}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python3 -m bench.length.max_length", description=__doc__.split("\n\n")[0])
    ap.add_argument("--comfy", required=True, help="ComfyUI 0dd9b154 tree (its main.py is run)")
    ap.add_argument("--ckpt", required=True, help="checkpoint from bench/common/synth_h3.py")
    ap.add_argument("--synth-info", default=None, help="synth_h3.py's JSON line (recorded; blocks, bytes)")
    ap.add_argument("--budget-gib", type=float, nargs="+", required=True, help="free memory held, GiB (one run each)")
    ap.add_argument("--arms", nargs="+", default=["safesage", "sage", "pytorch"], choices=list(ARMS))
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--height", type=int, default=720)
    ap.add_argument("--text-tokens", type=int, default=rarms.DEFAULT_TEXT_LEN)
    ap.add_argument("--max-frames", type=int, default=MAX_LENGTH, help="top of the frame grid (node maximum 3600)")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--seed", type=int, default=77)
    ap.add_argument("--emulate-arch", default=None, metavar="smNNN", help="as bench.repro (sm120: sage 2.2's sm_120 path)")
    ap.add_argument("--preflight-sage", default="2.2.0", help="sageattention version Preflight assumes")
    ap.add_argument("--cpu", action="store_true", help="CPU smoke: no hold (the budget only sets Preflight's length)")
    ap.add_argument("--preflight-only", type=float, default=None, metavar="GIB",
                    help="internal: print Preflight's prediction for this budget as JSON and exit (the driver "
                         "runs it in a child that sees no GPU)")
    ap.add_argument("--gpu-label", default="cpu", help="internal: the GPU name --preflight-only puts in its scenario")
    ap.add_argument("--start-frames", nargs="+", default=[], metavar="[ARM=]N",
                    help="first probe instead of Preflight's length (all arms, or ARM=N)")
    ap.add_argument("--start-note", default=None, help="where --start-frames came from (recorded)")
    ap.add_argument("--probe-limit", nargs="+", default=["4"], metavar="[ARM=]N", help="probes per arm (all, or ARM=N)")
    ap.add_argument("--grow", type=float, default=1.25, help="x frames per step up while everything completes")
    ap.add_argument("--shrink", type=float, default=1.25, help="/ frames per step down while nothing completes")
    ap.add_argument("--probe-timeout", type=float, default=150.0, help="seconds per server (start-up included)")
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds for the whole call")
    ap.add_argument("--reserve", type=float, default=0.0, help="seconds of the deadline kept for the references")
    ap.add_argument("--min-left", type=float, default=40.0, help="start no probe with fewer seconds than this left")
    ap.add_argument("--in-limit-error", type=float, default=None, help="the in-limit error, not measured")
    ap.add_argument("--in-limit-json", default=None, help="a bench.repro JSON holding it (verdict.in_limit_error)")
    ap.add_argument("--in-limit-size", type=rarms.size_arg, default="38k")
    ap.add_argument("--sage1-pythonpath", default=None, help="PYTHONPATH of the sage1 arm's servers")
    ap.add_argument("--work", default="/tmp/maxlen")
    ap.add_argument("--ref-dir", default=None, help="reference latents kept across calls (default WORK/refs)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--merge", default=None, help="earlier JSON to add to (default: --out if it exists)")
    ap.add_argument("--repo-rev", default=None)
    return ap


def _per_arm(values, arms, cast=int) -> dict:
    out = {}
    for v in values:
        k, _, n = v.rpartition("=")
        for arm in ([k] if k else arms):
            out[arm] = cast(n)
    return out


def gpu_name() -> str | None:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=20)
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def preflight_fit(a, gib: float, gpu: str) -> dict:
    """Preflight's longest length per arm (safe_ops.ui.length_model.longest) for budget ``gib`` on the
    emulated arch (default sm120): ``{"arms": {arm: {max_frames, max_tokens, ...}}, scenario, ...}``."""
    cap = arch_capability(a.emulate_arch or "sm120")
    rt = Runtime("", None, gpu if gpu != "cpu" else "unknown GPU", cap, a.preflight_sage,
                 sage_family_for(a.preflight_sage, cap), None, "cudaMallocAsync", True, None)
    free = int(gib * GiB)
    sc = scenarios_for(rt, free)[0]
    arms = {}
    for arm in ARMS:
        lg = length_model.longest(MODEL_ARM[arm], free, a.width, a.height, text_tokens=a.text_tokens,
                                  scenario=sc, count=h3_tokens, max_length=a.max_frames)
        arms[arm] = {"max_frames": lg.frames, "max_tokens": lg.tokens,
                     "predicted_peak_gib": fmt_gib(lg.peak.total if lg.peak else None),
                     "next_frames": lg.next_frames, "next_tokens": lg.next_tokens,
                     "next_predicted_peak_gib": fmt_gib(lg.next_peak.total if lg.next_peak else None),
                     "capped_by_max_frames": lg.capped, "model_arm": MODEL_ARM[arm]}
    return {"arms": arms, "scenario": sc.label, "family": sc.family, "model": PREFLIGHT_MODEL,
            "function": "safe_ops.ui.length_model.longest", "constants": "safe_ops/facts/length_model.json"}


class Call:
    """One invocation: its document, clock, reference store and servers."""

    def __init__(self, a, argv):
        self.a, self.t0, self.argv = a, time.time(), list(argv)
        self.work = os.path.abspath(a.work)
        self.refs = os.path.abspath(a.ref_dir or os.path.join(self.work, "refs"))
        os.makedirs(self.refs, exist_ok=True)
        self.grid = grid_lengths(a.max_frames)
        self.starts = _per_arm(a.start_frames, a.arms)
        self.limits = _per_arm(a.probe_limit, a.arms)
        synth = {}
        if a.synth_info and os.path.exists(a.synth_info):
            with open(a.synth_info) as f:
                synth = json.loads(f.read().strip().splitlines()[-1])
        st = os.stat(a.ckpt)
        self.gpu = "cpu" if a.cpu else gpu_name()
        self.doc = {"what": "issue #40: the longest H3 length that completes with correct output, per arm and budget",
                    "width": a.width, "height": a.height, "text_tokens": a.text_tokens, "steps": a.steps,
                    "seed": a.seed, "blocks": synth.get("blocks"), "ckpt_bytes": st.st_size,
                    "emulate_arch": a.emulate_arch, "cpu": a.cpu, "checkpoint": synth or {"path": a.ckpt},
                    "command": "python3 -m bench.length.max_length " + shlex.join(argv), "gpu": self.gpu,
                    "repo_rev": a.repo_rev, "frame_grid": "17k+5 (EmptyMiniMaxH3LatentAV's temporal_shape)",
                    "harness": "one ComfyUI server (main.py) per probe, graph queued over HTTP (bench/repro)",
                    "budgets": {}}
        self.doc["calls"] = [{k: self.doc[k] for k in ("command", "gpu", "repo_rev")} |
                             {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                              "budgets_gib": a.budget_gib}]
        old_path = a.merge or (a.out if os.path.exists(a.out) else None)
        self.old = None
        if old_path and os.path.exists(old_path):
            with open(old_path) as f:
                self.old = json.load(f)
        merge(self.old, self.doc)          # refuses another setup before anything runs
        self._ref_store_key(st)

    # ---------------------------------------------------------------- bookkeeping
    def left(self) -> float:
        return self.a.deadline - (time.time() - self.t0)

    def save(self):
        self.doc["calls"][-1]["elapsed_s"] = round(time.time() - self.t0, 1)
        out = merge(self.old, self.doc)
        os.makedirs(os.path.dirname(os.path.abspath(self.a.out)), exist_ok=True)
        with open(self.a.out + ".tmp", "w") as f:
            json.dump(out, f, indent=1, default=str)
        os.replace(self.a.out + ".tmp", self.a.out)
        return out

    def say(self, msg):
        print(f"[maxlen t={time.time() - self.t0:5.0f}s] {msg}", flush=True)

    def tokens(self, frames: int) -> int:
        return h3_tokens(self.a.width, self.a.height, frames, 0, self.a.text_tokens).total

    def _ref_store_key(self, st):
        key = {"ckpt": os.path.abspath(self.a.ckpt), "bytes": st.st_size, "mtime": int(st.st_mtime),
               "steps": self.a.steps, "seed": self.a.seed, "cpu": self.a.cpu, "width": self.a.width,
               "height": self.a.height, "text_tokens": self.a.text_tokens}
        driver.keep_store(self.refs, key)

    # ---------------------------------------------------------------- one server
    def row(self, arm: str, size: str, timeout: float) -> tuple[dict, str | None]:
        """One bench.repro worker row; returns (probe fields, latent path or None)."""
        a = self.a
        saved = os.environ.get("PYTHONPATH")
        if arm == "sage1":         # the worker hands this process's PYTHONPATH to the server
            if not a.sage1_pythonpath:
                raise SystemExit("the sage1 arm needs --sage1-pythonpath")
            os.environ["PYTHONPATH"] = a.sage1_pythonpath
        try:
            r = worker.run_row(comfy=a.comfy, ckpt=a.ckpt, arm=ARMS[arm], size=size, work=self.work,
                               steps=a.steps, seed=a.seed, cpu=a.cpu, emulate_arch=a.emulate_arch, timeout=timeout)
        finally:
            if saved is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = saved
        r.update(logs.log_excerpt(r["log"]))
        outcome, detail = classify(r, timeout_cut=timeout < a.probe_timeout)
        w = r.get("worker") or {}
        mem, oom = w.get("memory") or {}, w.get("memory_at_oom") or {}
        peak = {"torch_alloc_gib": mem.get("torch_peak_allocated_gib"), "nvml_process_gib": mem.get("nvml_peak_process_gib")}
        p = {"outcome": outcome, "detail": detail, "wall_s": r.get("wall_s"), "packed_tokens": w.get("packed_tokens"),
             "s_per_step": w.get("s_per_step"), "peak": peak if any(v is not None for v in peak.values()) else None}
        if oom:
            p["at_oom"] = {k: oom.get(k) for k in ("cuda_free_mib", "torch_allocated_gib", "torch_reserved_gib",
                                                   "weights_resident_mib") if k in oom}
        if w.get("safesage_summary"):
            p["safesage_summary"] = w["safesage_summary"][:600]
        if "replans_per_run" in w:
            p["replans_per_run"] = w["replans_per_run"]
        if outcome != COMPLETED:
            p["log_tail"] = logs.tail(r["log"], 8)
        p["versions"] = w.get("versions")
        return p, r.get("latent") if outcome == COMPLETED else None

    def timeout(self) -> float:
        return max(10.0, min(self.a.probe_timeout, self.left() - 5))

    # ---------------------------------------------------------------- the in-limit error
    def in_limit(self) -> dict:
        a = self.a
        if a.in_limit_error is not None:
            return {"value": a.in_limit_error, "source": "--in-limit-error"}
        if a.in_limit_json:
            with open(a.in_limit_json) as f:
                other = json.load(f)
            me = {"checkpoint": self.doc["checkpoint"] | {"bytes": self.doc["ckpt_bytes"]}, "steps": a.steps,
                  "seed": a.seed, "command": f"--emulate-arch {a.emulate_arch}" if a.emulate_arch else ""}
            v = verdict.in_limit_error([other], me)
            if v is not None:
                return {"value": v, "source": a.in_limit_json}
            self.say(f"{a.in_limit_json}: no 38k sage row of this checkpoint, steps, seed and arch; measuring it")
        if self.old and self.old.get("in_limit", {}).get("value") is not None:
            return dict(self.old["in_limit"], reused_from_an_earlier_call=True)
        lat, rows = {}, {}
        for arm in ("sage", "pytorch"):
            p, path = self.row(arm, a.in_limit_size, self.timeout())
            rows[arm] = {k: p.get(k) for k in ("outcome", "detail", "wall_s", "packed_tokens", "s_per_step", "peak")}
            self.say(f"in-limit {a.in_limit_size} {arm}: {p['outcome']} {p['wall_s']} s")
            if path:
                lat[arm] = _load(path)
                os.remove(path)
        v = driver.rel_l2(driver.flat(lat["sage"]), driver.flat(lat["pytorch"])) if len(lat) == 2 else None
        return {"value": v, "source": f"measured in this call: {a.in_limit_size} sage vs pytorch, no hold",
                "size": a.in_limit_size, "rows": rows, "elapsed_s": round(time.time() - self.t0, 1)}

    # ---------------------------------------------------------------- one budget
    def preflight(self, gib: float) -> dict:
        """Preflight's prediction for this budget. On a GPU it is asked in a child process that sees
        no GPU (CUDA_VISIBLE_DEVICES empty): the node's code it runs (SafeAttention) opens a CUDA
        context where one is available, which this driver must not hold (``driver_cuda_initialized``)."""
        if self.a.cpu:
            return preflight_fit(self.a, gib, self.gpu)
        cmd = [sys.executable, "-m", "bench.length.max_length", "--preflight-only", str(gib),
               "--gpu-label", str(self.gpu or "cpu"), *self.argv]
        r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
                           timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"Preflight's prediction failed: {r.stderr.strip()[-400:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])

    def budget(self, gib: float, il: dict):
        a, key = self.a, budget_key(gib)
        b = self.doc["budgets"][key] = {"free_gib": gib, "command": self.doc["command"], "gpu": self.gpu,
                                        "repo_rev": a.repo_rev, "started_s": round(time.time() - self.t0, 1),
                                        "in_limit_error": il.get("value"), "wrong_factor": verdict.WRONG_FACTOR,
                                        "arms": {}, "references": {}}
        if a.start_frames:
            b["start_frames"] = {"given": a.start_frames, "note": a.start_note}
        b["preflight"] = self.preflight(gib)
        import torch
        b["driver_cuda_initialized"] = bool(torch.cuda.is_initialized())   # must stay False (the hold's count)
        self.say(f"{key} GiB: Preflight's longest predicted lengths " + ", ".join(
            f"{arm} {b['preflight']['arms'][arm]['max_frames']} frames" for arm in a.arms))
        self.save()
        lat_dir = os.path.join(self.work, f"lat_{key}")
        os.makedirs(lat_dir, exist_ok=True)
        hold = None
        if not a.cpu:
            hold = driver.Ballast(gib, os.path.join(self.work, f"ballast_{key}.log"))
            b["ballast"] = {"held_gib": round(hold.bytes / GiB, 2), "total_gib": round(hold.total / GiB, 2)}
        else:
            b["ballast"] = None
            b["note"] = "CPU smoke: no memory hold; the budget only sets Preflight's length"
        try:
            for arm in a.arms:
                self._search(b, arm, key, lat_dir)
        finally:
            if hold is not None:
                hold.stop()
        for arm in a.arms:             # the output check, without the hold
            res = b["arms"][arm]
            judge(res["probes"], lambda n, arm=arm: self._rel(b, arm, n, lat_dir), il.get("value"), verdict.WRONG_FACTOR)
            b["arms"][arm] = arm_summary(res, self.grid, self.tokens)
            self.save()
        for n in os.listdir(lat_dir):  # latents of shorter lengths nobody needed to check
            os.remove(os.path.join(lat_dir, n))
        b.update(ratios(b["arms"]))
        b["preflight"].update(preflight_vs_measured(b["preflight"], b["arms"]))
        b["elapsed_s"] = round(time.time() - self.t0 - b["started_s"], 1)
        self.save()
        for arm, r in b["arms"].items():
            self.say(f"{key} GiB {arm}: max {r['max_frames']} frames ({r['max_tokens']} tokens), verified "
                     f"{r['verified']}, first failure above {r['fail_above_frames']}, stop: {r['stop']}")

    def _search(self, b, arm, key, lat_dir):
        a = self.a
        start = self.starts.get(arm) or b["preflight"]["arms"][arm]["max_frames"] or self.grid[0]
        b["arms"][arm] = live = {"repro_arm": ARMS[arm], "label": rarms.ARM_LABEL[ARMS[arm]], "probes": [],
                                 "start_source": "--start-frames" if arm in self.starts else "Preflight"}

        def probe(n):
            t = time.time() - self.t0
            p, path = self.row(arm, rarms.size_name(a.width, a.height, n, a.text_tokens), self.timeout())
            p = {"frames": n, "tokens": self.tokens(n), "t_start_s": round(t, 1), **p}
            if p["packed_tokens"] not in (None, p["tokens"]):     # the server's own count (ComfyUI's PackedLayout)
                p["tokens_differ_from_comfyui"] = True
            if path:
                os.replace(path, os.path.join(lat_dir, f"{arm}_{n}.pt"))
            live["probes"].append(p)
            live.setdefault("versions", p.get("versions"))
            self.save()
            pk = p.get("peak") or {}
            self.say(f"{key} GiB {arm} {n} frames ({p['tokens']:,} tokens): {p['outcome']} in {p['wall_s']} s"
                     + (f", peak {pk.get('nvml_process_gib')} GiB (NVML)" if pk else "")
                     + (f" -- {p['detail'][:120]}" if p["outcome"] != COMPLETED else ""))
            return p

        res = search(probe, self.grid, start, limit=self.limits.get(arm, 4), grow=a.grow, shrink=a.shrink,
                     may_probe=lambda: self.left() - a.reserve >= a.min_left)
        live.update(res)
        for p in live["probes"]:
            p.pop("versions", None)

    def _rel(self, b, arm, n, lat_dir):
        """rel. L2 of the arm's latent at n frames vs the pytorch arm at n frames without the hold."""
        ref_path = os.path.join(self.refs, f"pytorch_{n}.pt")
        refs = b["references"]
        if not os.path.exists(ref_path):
            if str(n) in refs:
                return None, refs[str(n)]["why"]
            if self.left() < self.a.min_left:
                refs[str(n)] = {"outcome": UNFINISHED, "why": "no time left for the reference"}
                return None, refs[str(n)]["why"]
            p, path = self.row("pytorch", rarms.size_name(self.a.width, self.a.height, n, self.a.text_tokens),
                               self.timeout())
            refs[str(n)] = {k: p.get(k) for k in ("outcome", "detail", "wall_s", "peak")}
            self.say(f"reference {n} frames (pytorch, no hold): {p['outcome']} in {p['wall_s']} s")
            if path is None:
                refs[str(n)]["why"] = f"the reference (pytorch, no hold) did not complete: {p['outcome']}: {p['detail'][:200]}"
                self.save()
                return None, refs[str(n)]["why"]
            os.replace(path, ref_path)
        else:
            refs.setdefault(str(n), {"outcome": COMPLETED, "cached": True})
        mine = os.path.join(lat_dir, f"{arm}_{n}.pt")
        rel = driver.rel_l2(driver.flat(_load(mine)), driver.flat(_load(ref_path)))
        os.remove(mine)
        self.save()
        return rel, None


def _load(path):
    import torch
    return torch.load(path)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parser().parse_args(argv)
    if a.preflight_only is not None:          # the child Call.preflight starts (no GPU visible)
        print(json.dumps(preflight_fit(a, a.preflight_only, a.gpu_label)))
        return None
    c = Call(a, argv)
    il = c.in_limit()
    c.doc["in_limit"] = il
    c.say(f"in-limit error {il.get('value')} ({il['source']})")
    c.save()
    for gib in a.budget_gib:
        c.budget(gib, il)
    return c.save()


if __name__ == "__main__":
    main()
