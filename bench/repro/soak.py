"""Soak: one ComfyUI server, many prompts in a row, then an interrupted prompt, then every model
unloaded (POST /free) and loaded again by one more prompt -- GPU memory as the server sees it
(the probe pack's GET /safesage_repro/memory) after each. Issue 20's soak: memory back to the
same level after every prompt, with SafeSage as without it.

  python -m bench.repro soak --comfy COMFY --ckpt CKPT --arm safesage --size 38k --prompts 20 \\
      [--emulate-arch sm120] --out bench/results/soak_<arm>_h200.json

What is compared (``verdict``): torch's allocated bytes after prompt i vs after prompt 1 (the model
is loaded by then and stays loaded), after the interrupted prompt, and after the reload prompt; all
equal is ``memory_back_after_each_prompt``. The same run without SafeSage (``--arm sage`` or
``pytorch``) is the control: a difference there is ComfyUI's, not SafeSage's.
"""
from __future__ import annotations

import json
import platform
import shlex
import sys
import time

from ..common import synth_h3
from . import arms, replans, workflow
from .worker import make_server

MEMORY = "/safesage_repro/memory"


def _wait_steps(server, probe_path, steps_done, timeout):
    """Until the probe has timed ``steps_done`` steps of the prompt now sampling. Its JSON file
    still holds the previous prompt's steps until the new one starts: that prompt ended in phase
    "done", the running one is in phase "step k/n done"."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with open(probe_path) as f:
                rec = json.load(f)
            if str(rec.get("phase", "")).startswith("step ") and len(rec.get("step_end_times") or []) >= steps_done:
                return True
        except (OSError, ValueError):
            pass
        if server.ended() is not None:
            return False
        time.sleep(0.05)
    return False


def _sample(server, what: str, t0: float, **extra) -> dict:
    m = server.get_json(MEMORY)
    row = {"what": what, "t_s": round(time.time() - t0, 1), **m, **extra}
    try:
        st = server.get_json("/safesage/stats")
        row["safesage"] = {k: st.get(k) for k in ("attention_calls", "fallbacks", "kernel_errors", "probes",
                                                  "probe_failures", "oom_fallbacks", "call_fallbacks",
                                                  "replans", "replan_us")}
        row["safesage"]["plans"] = len(st.get("plans") or {})
    except Exception:       # noqa: BLE001 - an arm without SafeSage has no such route
        pass
    return row


def run_soak(*, comfy, ckpt, arm, size, work, prompts=20, steps=2, seed=77, cpu=False, emulate_arch=None,
             interrupt_steps=30, timeout=900.0, python=None, extra_flags=()) -> dict:
    width, height, length, text_len = arms.parse_size(size)
    server, files, av_stub = make_server(comfy=comfy, ckpt=ckpt, arm=arm, tag=f"soak_{size}_{arm}", work=work,
                                         cpu=cpu, emulate_arch=emulate_arch, python=python,
                                         extra_flags=extra_flags)
    unet = files["base"] / "models" / "diffusion_models"
    unet = next(p.name for p in unet.iterdir())
    doc = {"arm": arm, "arm_label": arms.ARM_LABEL[arm], "size": size, "prompts": prompts, "steps": steps,
           "emulate_arch": emulate_arch, "av_stub": av_stub, "samples": [], "errors": []}
    t0 = time.time()
    try:
        server.start(attempts=1)
        doc["command_server"] = " ".join(shlex.quote(x) for x in server.cmdline)
        inputs = None
        if arms.ARMS[arm]["safesage"] is not None:
            info = server.object_info(workflow.SAFESAGE_NODE)[workflow.SAFESAGE_NODE]
            inputs = {**workflow.node_defaults(info), **arms.ARMS[arm]["safesage"]}

        def graph(i, n_steps):
            # a new noise seed per prompt: ComfyUI re-runs the sampler, the loader stays cached
            return workflow.row_graph(unet, width, height, length, text_len, n_steps, seed + i, "", inputs)

        doc["samples"].append(_sample(server, "server up", t0))
        for i in range(prompts):
            entry = server.queue_and_wait(graph(i, steps), timeout)
            doc["samples"].append(_sample(server, f"after prompt {i + 1}", t0,
                                          status=entry["status"]["status_str"]))
        # an interrupted prompt: queued with many steps, interrupted once two have run
        pid = server.post_prompt(graph(prompts, interrupt_steps))
        reached = _wait_steps(server, files["probe"], 2, timeout)
        server.post_json("/interrupt")
        entry = server.wait_history(pid, timeout)
        kinds = [m[0] for m in entry["status"].get("messages", [])]
        doc["samples"].append(_sample(server, "after interrupted prompt", t0, status=entry["status"]["status_str"],
                                      interrupted="execution_interrupted" in kinds, reached_step_2=reached))
        # every model unloaded and ComfyUI's caches dropped, then loaded again by the next prompt
        server.free()
        doc["samples"].append(_sample(server, "after /free (models unloaded)", t0))
        entry = server.queue_and_wait(graph(prompts + 1, steps), timeout)
        doc["samples"].append(_sample(server, "after reload prompt", t0, status=entry["status"]["status_str"]))
    except Exception as e:          # noqa: BLE001 - recorded; the JSON says how far it got
        doc["errors"].append(f"{type(e).__name__}: {e}")
        doc["log_tail"] = server.log_tail(40) if hasattr(server, "log_tail") else None
    finally:
        server.stop()
    doc["wall_s"] = round(time.time() - t0, 1)
    doc["replans_per_prompt"] = replans.per_prompt([x for x in doc["samples"] if x["what"] != "server up"])
    doc["verdict"] = verdict(doc)
    return doc


def verdict(doc: dict) -> dict:
    """Allocated bytes after every prompt (the plain ones, the interrupted one, the reload) against
    the level after the first prompt."""
    s = doc["samples"]
    after = [x for x in s if x["what"].startswith("after prompt") or x["what"] in
             ("after interrupted prompt", "after reload prompt")]
    if not after or "allocated" not in after[0]:
        return {"memory_measured": False, "completed": not doc["errors"]}
    base = after[0]["allocated"]
    dev = [x["allocated"] - base for x in after]
    unload = next((x for x in s if x["what"].startswith("after /free")), None)
    return {"memory_measured": True, "completed": not doc["errors"],
            "allocated_after_first_prompt": base,
            "max_abs_deviation_bytes": max(abs(d) for d in dev),
            "memory_back_after_each_prompt": all(d == 0 for d in dev),
            "deviations_bytes": dev,
            "allocated_after_unload": unload.get("allocated") if unload else None,
            "interrupted": any(x.get("interrupted") for x in s)}


def main(a, argv) -> dict:
    doc = run_soak(comfy=a.comfy, ckpt=a.ckpt, arm=a.arm, size=a.size, work=a.work, prompts=a.prompts,
                   steps=a.steps, seed=a.seed, cpu=a.cpu, emulate_arch=a.emulate_arch,
                   interrupt_steps=a.interrupt_steps, timeout=a.arm_timeout, extra_flags=a.comfy_flag)
    doc = {"command": "python -m bench.repro " + " ".join(shlex.quote(x) for x in argv),
           "machine": platform.node(), "python": sys.version.split()[0], **doc}
    if a.synth_info:
        with open(a.synth_info) as f:
            doc["synth"] = json.loads(f.read().strip().splitlines()[-1])
    doc["checkpoint_settings"] = synth_h3.read_settings(a.ckpt)     # a synthetic checkpoint's seed, drift, ...
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1, default=str)
    return doc
