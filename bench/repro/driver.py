"""The driver: runs the plan's rows one after another, each in a fresh ComfyUI server (worker.py),
under a per-row timeout and a deadline for the whole run, optionally next to a ballast process that
holds GPU memory (so the card has the reporter's ~32 GB free), and writes the JSON after every row:
outcome, exit signal, log lines, s/step, peak memory, rel. L2 vs the PyTorch arm of the same size
and vs the row's own unguarded arm. It never touches the GPU itself (torch only for the latents)."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time

from ..common import synth_h3
from . import arms, logs, worker


def rel_l2(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def flat(lat):
    """A saved latent's video and audio as one vector (what rel_l2 compares)."""
    import torch
    return torch.cat([lat["video"].flatten(), lat["audio"].flatten()])


class Ballast:
    """A separate process that holds GPU memory so that about `free_gib` stays free."""

    def __init__(self, free_gib, log):
        code = (
            "import torch,sys,time\n"
            "free,total=torch.cuda.mem_get_info()\n"
            f"n=max(0,free-int({free_gib}*2**30))\n"
            "x=torch.empty(n,dtype=torch.uint8,device='cuda') if n else None\n"
            "torch.cuda.synchronize()\n"
            "print('BALLAST',n,total,flush=True)\n"
            "time.sleep(1e6)\n")
        self.log = open(log, "w")
        self.p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.p.stdout.readline().split()
        if not line or line[0] != "BALLAST":
            raise RuntimeError("ballast process failed: see " + log)
        self.bytes, self.total = int(line[1]), int(line[2])

    def stop(self):
        self.p.terminate()
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            self.p.kill()


def keep_store(path: str, key: dict) -> None:
    """A folder of kept latents (``*.pt``) made for the settings ``key``: emptied, and ``key`` written
    to its store.json, when it was made for other settings (or none)."""
    meta = os.path.join(path, "store.json")
    old = None
    if os.path.exists(meta):
        with open(meta) as f:
            old = json.load(f)
    if old != key:
        for n in os.listdir(path):
            if n.endswith(".pt"):
                os.remove(os.path.join(path, n))
        with open(meta, "w") as f:
            json.dump(key, f)


def _latent_store(a, doc) -> dict:
    """--keep-latents DIR: the sampled latents of earlier driver runs with the same checkpoint, steps, seed
    and emulated arch, {(size, arm): path}, so arms split over several device calls are still compared
    with the PyTorch arm and with their own unguarded arm. A store made for other settings is emptied."""
    if not a.keep_latents:
        return {}
    os.makedirs(a.keep_latents, exist_ok=True)
    st = os.stat(a.ckpt)
    key = {"ckpt": os.path.abspath(a.ckpt), "ckpt_bytes": st.st_size, "ckpt_mtime": int(st.st_mtime),
           "ckpt_settings": synth_h3.read_settings(a.ckpt),       # a synthetic checkpoint's seed, drift, ...
           "steps": a.steps, "seed": a.seed, "emulate_arch": a.emulate_arch, "cpu": a.cpu}
    keep_store(a.keep_latents, key)
    found = {}
    for n in sorted(os.listdir(a.keep_latents)):
        size, _, rest = n[:-3].partition("_")
        arm, _, prompt = rest.partition(".p")
        if n.endswith(".pt") and arms.is_size(size) and arm in arms.ARMS and (not prompt or prompt.isdigit()):
            found[(size, arm, int(prompt or 1))] = os.path.join(a.keep_latents, n)
    doc["earlier_latents"] = sorted(f"{s}:{r}" + (f":p{p}" if p > 1 else "") for s, r, p in found)
    return found


def kept_name(size: str, arm: str, prompt: int = 1) -> str:
    """A kept latent's file name (:func:`_latent_store` reads it back)."""
    return f"{size}_{arm}" + (f".p{prompt}" if prompt > 1 else "") + ".pt"


def compare(runs, size, latents, refs) -> None:
    """Fill rel. L2 on the rows of ``size``: every completed row against the PyTorch arm, each guarded
    row against its own unguarded configuration, whichever of the two ran first."""
    ref = refs.get(size)
    for r in runs:
        cur = latents.get((size, r["arm"]))
        if r["size"] != size or cur is None:
            continue
        if ref is not None and "rel_l2_vs_pytorch" not in r:
            r["rel_l2_vs_pytorch"] = rel_l2(flat(cur), flat(ref))
            r["rel_l2_video"] = rel_l2(cur["video"], ref["video"])
            r["rel_l2_audio"] = rel_l2(cur["audio"], ref["audio"])
        u = arms.UNGUARDED.get(r["arm"])
        if u is not None and (size, u) in latents:
            r["unguarded_arm"] = u
            r["rel_l2_vs_unguarded"] = rel_l2(flat(cur), flat(latents[(size, u)]))


def compare_later(runs, size, later) -> None:
    """Fill rel. L2 on each later prompt of the rows of ``size`` (``later``: {(size, arm, prompt):
    latent}): against the same prompt of the PyTorch arm and of the row's own unguarded arm, which ran
    the same seeds."""
    for r in runs:
        if r["size"] != size:
            continue
        for p in (r.get("worker") or {}).get("later_prompts") or []:
            cur = later.get((size, r["arm"], p["prompt"]))
            if cur is None:
                continue
            ref = later.get((size, "pytorch", p["prompt"]))
            if ref is not None and "rel_l2_vs_pytorch" not in p:
                p["rel_l2_vs_pytorch"] = rel_l2(flat(cur), flat(ref))
            u = arms.UNGUARDED.get(r["arm"])
            if u is not None and (size, u, p["prompt"]) in later and "rel_l2_vs_unguarded" not in p:
                p["unguarded_arm"] = u
                p["rel_l2_vs_unguarded"] = rel_l2(flat(cur), flat(later[(size, u, p["prompt"])]))


def driver(a, argv=()) -> dict:
    import torch  # only for the latents; the driver never touches the GPU
    work = os.path.abspath(a.work)
    os.makedirs(work, exist_ok=True)
    out_path = os.path.abspath(a.out)
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    t_begin = time.time()
    plan = [tuple(x.split(":")) for x in a.plan] if a.plan else [(s, r) for s in a.sizes for r in a.arms]
    run_arms = list(dict.fromkeys(r for _, r in plan))
    doc = {"command": "python -m bench.repro " + " ".join(shlex.quote(x) for x in argv),
           "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
           "ckpt": a.ckpt, "steps": a.steps, "seed": a.seed, "ballast_free_gib": a.ballast_free_gib,
           "sizes": {s: arms.size_dict(s) for s in dict.fromkeys(s for s, _ in plan)},
           "arms": {k: {"label": arms.ARM_LABEL[k], "comfy_flags": arms.ARMS[k]["flags"], "env": arms.ARMS[k]["env"],
                        "safesage_node_inputs": arms.ARMS[k]["safesage"]} for k in run_arms},
           "harness": "one ComfyUI server (main.py) per row, graph queued over HTTP (bench/repro)",
           "repo_rev": a.repo_rev, "plan": [f"{s}:{r}" for s, r in plan], "runs": []}
    if a.synth_info and os.path.exists(a.synth_info):
        with open(a.synth_info) as f:
            doc["checkpoint"] = json.loads(f.read().strip().splitlines()[-1])
    # what a bench.common.synth_h3 checkpoint records of itself (its seed, dims, the synthetic drift): None otherwise
    doc["checkpoint_settings"] = synth_h3.read_settings(a.ckpt)

    def save():
        doc["elapsed_s"] = round(time.time() - t_begin, 1)
        with open(out_path + ".tmp", "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(out_path + ".tmp", out_path)
        if a.copy_to:
            import shutil
            shutil.copy(out_path, a.copy_to)

    ballast = None
    if a.ballast_free_gib:
        ballast = Ballast(a.ballast_free_gib, os.path.join(work, "ballast.log"))
        doc["ballast"] = {"held_gib": round(ballast.bytes / 2 ** 30, 2), "total_gib": round(ballast.total / 2 ** 30, 2)}
    save()
    refs, latents, later = {}, {}, {}   # (size, arm) -> sampled latent; later prompts: (size, arm, prompt)
    for (size, arm, prompt), path in _latent_store(a, doc).items():
        if prompt > 1:
            later[(size, arm, prompt)] = torch.load(path)
            continue
        latents[(size, arm)] = torch.load(path)
        if arm == "pytorch":
            refs[size] = latents[(size, arm)]
    try:
        for size, arm in plan:
            left = a.deadline - (time.time() - t_begin)
            run = {"size": size, "arm": arm}
            if left < a.min_left:
                run.update(outcome="skipped (time budget)")
                doc["runs"].append(run)
                save()
                continue
            got = worker.run_row(comfy=a.comfy, ckpt=a.ckpt, arm=arm, size=size, work=work, steps=a.steps,
                                 seed=a.seed, cpu=a.cpu, debug=a.debug, emulate_arch=a.emulate_arch,
                                 timeout=min(a.arm_timeout, max(10, left - 5)), extra_flags=a.comfy_flag,
                                 prompts=getattr(a, "prompts", 1))
            lat, log = got.pop("latent"), got.pop("log")
            if got["error"] is None:
                got.pop("error")
            run.update(got)
            run["log_tail"] = logs.tail(log, 25)
            run.update(logs.log_excerpt(log))
            run["aimdo_evict_lines"] = logs.grep_count(log, ("evict",))
            run["cuda_error_lines"] = logs.grep_count(log, ("illegal memory access", "cuda error", "device-side assert"))
            if lat:
                latents[(size, arm)] = torch.load(lat)
                if a.keep_latents:
                    os.replace(lat, os.path.join(a.keep_latents, kept_name(size, arm)))
                else:
                    os.remove(lat)
                if arm == "pytorch":
                    refs[size] = latents[(size, arm)]
            for p in run["worker"].get("later_prompts") or []:
                path = p.pop("latent", None)
                if path and os.path.exists(path):
                    later[(size, arm, p["prompt"])] = torch.load(path)
                    if a.keep_latents:
                        os.replace(path, os.path.join(a.keep_latents, kept_name(size, arm, p["prompt"])))
                    else:
                        os.remove(path)
            doc["runs"].append(run)
            compare(doc["runs"], size, latents, refs)
            compare_later(doc["runs"], size, later)
            save()
            if len(doc["runs"]) == 1 and run["outcome"] != "completed" and a.fail_fast:
                doc["aborted"] = "first arm did not complete: setup problem, nothing else run"
                print("[repro] first arm failed; stopping (--fail-fast)", flush=True)
                return doc
            w = run["worker"]
            if "replans_per_run" in w:         # a guarded row: its run's re-plans (replans.py)
                doc.setdefault("replans", {})[f"{size}:{arm}"] = {k: w[k] for k in ("replans_per_run", "replan_stall_ms")}
                save()
            print(f"[repro] {size:>5} {arm:<14} {run['outcome']}  wall {run['wall_s']}s  "
                  f"S={w.get('packed_tokens')} steps={w.get('s_per_step')} rel={run.get('rel_l2_vs_pytorch')}"
                  f" replans={w.get('replans_per_run')} stall_ms={w.get('replan_stall_ms')}", flush=True)
    finally:
        if ballast is not None:
            ballast.stop()
        save()
    return doc
