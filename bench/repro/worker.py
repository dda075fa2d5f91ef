"""One row (size x arm): a fresh ComfyUI server -- its own main.py start-up with the arm's flags and
environment -- that runs the row's graph (workflow.py) queued over HTTP, and what it left.

The server is started by tools/harness/comfy_process.py (the launcher the headless tests use) in a
temporary --base-directory holding the checkpoint (a link in models/diffusion_models), the probe pack
(bench/repro/probe_pack) and, for the SafeSage arms only, this repository as ComfyUI-SafeSage. Its
PYTHONPATH is passed on (the GPU box's wheels live there), with bench/repro/av_stub in front when its
Python has no PyAV (recorded as ``av_stub``) and this repository last (the probe pack imports
``bench.common.benchutil`` and ``bench.repro.memory`` from it), and it runs in a process group of its own.

Where each finding comes from:
  outcome     /history (success, or ComfyUI's execution_error: exception type and message) or the
              process's own end (a native abort: the signal; a timeout: killed)
  timings, packed sequence, weight residency, torch peak memory, OOM attribution
              the probe pack, inside the server (its JSON file survives an abort)
  NVML peak   this process (memory.NvmlPeak), from before the server starts to its end
  SafeSage    the SafeSageAttention node's UI text in /history, and /safesage/stats (with
              ``replans_per_run`` / ``replan_stall_ms`` read from it: replans.py)
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tools.harness import comfy_process as _launcher

from . import arms, logs, memory, workflow
from .replans import replan_fields

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PACK_DIR_NAME = "ComfyUI-SafeSage"
PROBE_DIR_NAME = "safesage_repro_probe"


def comfy_process():
    """The launcher the headless tests use (tools/harness/comfy_process.py)."""
    return _launcher


def _imports(python: str, module: str) -> bool:
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0


def _error_text(err: dict | None) -> str | None:
    """ComfyUI's execution_error as one line: `type: first line of the message`."""
    if not err:
        return None
    msg = (err.get("exception_message") or "").strip().splitlines()
    return f"{err.get('exception_type')}: {msg[0] if msg else ''}".strip()


def _node_text(entry: dict, node_id: str) -> str | None:
    text = (entry.get("outputs", {}).get(node_id) or {}).get("text")
    return text[0] if isinstance(text, list) and text else text


def make_server(*, comfy, ckpt, arm, tag, work, cpu=False, debug=False, emulate_arch=None, python=None,
                extra_flags=()):
    """The (not yet started) server of one arm: a fresh --base-directory ``work/tag`` with the
    checkpoint linked in, the probe pack, and SafeSage for the guarded arms. Returns (server, files,
    av_stub); files: the probe's JSON, the latent, the server log and the base directory."""
    cp = comfy_process()
    work = Path(work).resolve()
    base = work / tag
    shutil.rmtree(base, ignore_errors=True)
    files = {"probe": work / f"{tag}.probe.json", "latent": work / f"{tag}.pt", "log": work / f"{tag}.log",
             "base": base}
    for key in ("probe", "latent", "log"):
        if files[key].exists():
            files[key].unlink()
    flags = arms.comfy_flags(arm, cpu, extra_flags) + (["--verbose", "DEBUG"] if debug else [])
    env = dict(arms.ARMS[arm]["env"], SAFESAGE_REPRO_PROBE_OUT=str(files["probe"]))
    if emulate_arch:            # an arm's own emulated arch (sage_sm80) wins over the run's
        env.setdefault("SAFESAGE_REPRO_EMULATE_ARCH", emulate_arch)
    python = python or sys.executable
    av_stub = not _imports(python, "av")   # the GPU box: ComfyUI's node API imports av at start-up
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE / "av_stub") if av_stub else None,
                                                      os.environ.get("PYTHONPATH"), str(REPO)]))
    nodes = {PROBE_DIR_NAME: HERE / "probe_pack"}
    if arms.ARMS[arm]["safesage"] is not None:
        nodes[PACK_DIR_NAME] = REPO
    server = cp.ComfyProcess(base, nodes, root=Path(comfy).resolve(), python=python,
                             flags=flags, env=env, name=tag, keep_pythonpath=True, own_group=True)
    server.log_path = files["log"]
    os.symlink(os.path.abspath(ckpt), server.models_dir / os.path.basename(ckpt))
    return server, files, av_stub


def _read_json(path: Path) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def later_prompts(server, graph_of, n: int, probe_out: Path, timeout: float, latent_of=None,
                  quality=None) -> list[dict]:
    """Prompts 2..n of a row, in the same server after the first completed: each with its own noise
    and conditioning seeds (so ComfyUI's cache re-runs the sampler; every arm runs the same seeds, so
    prompt i of one arm compares with prompt i of another). ``graph_of(i, latent_path)``: prompt i+1's
    graph; ``latent_of(i)``: where it saves its latent (None: not saved); ``quality()``: the SafeSage
    quality guard's state after a prompt (guarded rows). Per prompt: its outcome, the probe's step
    times -- a later prompt's first step carries a new run's quality measurement (or none, where the
    guard remembers an earlier one) without the server's one-time costs (module loads, kernels' first
    launch and JIT), which the first prompt's carries -- its latent's path and the guard's state."""
    out = []
    for i in range(1, n):
        t0 = time.time()
        latent = latent_of(i) if latent_of is not None else None
        if latent is not None and latent.exists():
            latent.unlink()
        try:
            entry = server.queue_and_wait(graph_of(i, str(latent) if latent is not None else ""), timeout)
        except Exception as e:  # noqa: BLE001 - recorded; the row's own outcome is the first prompt's
            out.append({"prompt": i + 1, "outcome": f"{type(e).__name__}: {e}"[:200]})
            break
        rec = _read_json(probe_out)
        ok = entry["status"]["status_str"] == "success"
        p = {"prompt": i + 1, "outcome": "completed" if ok else "error", "wall_s": round(time.time() - t0, 1),
             "s_per_step": rec.get("s_per_step")}
        if ok and latent is not None and latent.exists():
            p["latent"] = str(latent)
        if quality is not None:
            p["safesage_quality"] = quality()
        out.append(p)
        if not ok:
            break
    return out


def prompt_latent(latent: Path, prompt: int) -> Path:
    """Where prompt ``prompt`` (2 on) of a row saves its latent, beside the first prompt's."""
    return latent.with_name(f"{latent.stem}.p{prompt}{latent.suffix}")


def missing_flags(comfy, flags) -> list[str]:
    """The ``--`` flags this ComfyUI tree's comfy/cli_args.py does not define (e.g. --use-ck-attention
    before 783545f6); none when the file cannot be read (ComfyUI itself then says)."""
    try:
        text = (Path(comfy) / "comfy" / "cli_args.py").read_text(errors="replace")
    except OSError:
        return []
    return [f for f in flags if f.startswith("--") and f'"{f}"' not in text]


def run_row(*, comfy, ckpt, arm, size, work, steps=2, seed=77, cpu=False, debug=False, emulate_arch=None,
            timeout=150.0, python=None, extra_flags=(), prompts=1) -> dict:
    """Run one row in a fresh server; returns the row's fields as the driver's JSON keeps them:
    command, rc, wall_s, worker (the findings), outcome, error (a Python error's line), latent (the
    saved latent's path when it completed) and log (the server's log). ``prompts`` > 1: after the
    first prompt completes, the same graph runs again that many times in all (:func:`later_prompts`,
    ``worker["later_prompts"]``); everything else in the row is the first prompt's.

    rc: 0 completed; "execution_error" (ComfyUI reported the error and lived on); "timeout";
    "unsupported" (this ComfyUI tree has no flag the arm needs, e.g. --use-ck-attention: not started); else
    the server's exit status (negative: the signal that ended it)."""
    cp = comfy_process()
    width, height, length, text_len = arms.parse_size(size)
    guarded = arms.ARMS[arm]["safesage"] is not None
    tag = f"{size}_{arm}"
    missing = missing_flags(comfy, arms.comfy_flags(arm, cpu, extra_flags))
    if missing:
        return {"rc": "unsupported", "wall_s": 0.0, "command": "", "latent": None,
                "log": str(Path(work).resolve() / f"{tag}.log"),
                "worker": {"phase": "not started", "arm": arm, "size": size},
                "error": f"this ComfyUI tree ({comfy}) has no {', '.join(missing)} (its comfy/cli_args.py)",
                "outcome": f"skipped: this ComfyUI has no {', '.join(missing)}"}
    server, files, av_stub = make_server(comfy=comfy, ckpt=ckpt, arm=arm, tag=tag, work=work, cpu=cpu, debug=debug,
                                         emulate_arch=emulate_arch, python=python, extra_flags=extra_flags)
    probe_out, latent, log, base = files["probe"], files["latent"], files["log"], files["base"]
    unet = os.path.basename(ckpt)
    w = {"phase": "start", "av_stub": av_stub, "comfy_argv": server.flags, "arm": arm, "size": size,
         "width": width, "height": height, "length": length, "text_len": text_len}
    row = {"rc": None, "error": None}
    nv = memory.NvmlPeak()
    t0 = time.time()
    entry = None
    try:
        server.start(attempts=1)
        w["phase"] = "server up"
        inputs = None
        if guarded:
            info = server.object_info(workflow.SAFESAGE_NODE)[workflow.SAFESAGE_NODE]
            inputs = {**workflow.node_defaults(info), **arms.ARMS[arm]["safesage"]}
        graph = workflow.row_graph(unet, width, height, length, text_len, steps, seed, str(latent), inputs)
        w["graph"] = graph
        pid = server.post_prompt(graph)
        if not isinstance(pid, str):
            row.update(rc="rejected", error="prompt rejected: " + json.dumps(pid)[:300])
        else:
            w["phase"] = "queued"
            entry = server.wait_history(pid, max(1.0, timeout - (time.time() - t0)))
    except cp.ServerDied as e:
        row["rc"] = e.returncode
    except TimeoutError:
        row["rc"] = "timeout"
    except RuntimeError:       # did not start: its exit status, or still starting at the deadline
        row["rc"] = server.ended() if server.ended() is not None else "timeout"
    except Exception as e:     # noqa: BLE001 - an HTTP call failed: a dying server, or the harness
        w["harness_error"] = repr(e)
        row["rc"] = server.ended() if server.ended() is not None else "harness_error"
    first = None
    if entry is not None and prompts > 1 and entry["status"]["status_str"] == "success":
        first = _read_json(probe_out)           # the probe's record of prompt 1, before later ones rewrite it
        quality = (lambda: _quality(server)) if guarded else None
        if quality is not None:
            w["safesage_quality_first_prompt"] = quality()
        w["later_prompts"] = later_prompts(
            server, lambda i, path: workflow.row_graph(unet, width, height, length, text_len, steps, seed + 1000 * i,
                                                       path, inputs),
            prompts, probe_out, max(1.0, timeout - (time.time() - t0)),
            latent_of=lambda i: prompt_latent(latent, i + 1), quality=quality)
    if entry is not None:
        err = cp.execution_error(entry)
        row["rc"] = 0 if entry["status"]["status_str"] == "success" else "execution_error"
        row["error"] = _error_text(err)
        if guarded:
            w["safesage_summary"] = _node_text(entry, "10")
        try:
            if guarded:
                w["safesage_report"] = server.get_json("/safesage/stats")
                w.update(replan_fields(w["safesage_report"]))     # one prompt per server: per run
            w["system_stats_after"] = server.get_json("/system_stats").get("devices")
        except Exception as e:  # noqa: BLE001 - evidence only
            w["stats_error"] = repr(e)
    server.stop(kill=row["rc"] == "timeout")
    nv.stop()
    row["wall_s"] = round(time.time() - t0, 1)
    probe = first if first is not None else {}
    if first is None and probe_out.exists():
        with open(probe_out) as f:
            probe = json.load(f)
    if probe.get("phase") in (None, "server started"):
        probe.pop("phase", None)       # the worker's own phase is further on (or as far)
    w.update(probe)
    if w.get("completed"):
        w["memory"] = {**w.get("memory", {}), **nv.info()}
    if "memory_at_oom" in w:
        w["memory_at_oom"].update(nv.info())
    row["worker"] = w
    row["command"] = "".join(f"{k}={v} " for k, v in arms.ARMS[arm]["env"].items()) + \
        " ".join(shlex.quote(x) for x in server.cmdline)
    row["outcome"] = outcome(row["rc"], w, timeout)
    if row["error"] is None and row["outcome"].startswith("Python error"):
        row["error"] = logs.error_line(logs.tail(log, 60))
    row["latent"] = str(latent) if row["outcome"] == "completed" and latent.exists() else None
    row["log"] = str(log)
    if not os.environ.get("SAFESAGE_REPRO_KEEP_BASE"):
        shutil.rmtree(base, ignore_errors=True)
    return row


def _quality(server) -> dict:
    """The quality guard's counters and last run from /safesage/stats now (one prompt's, between prompts)."""
    try:
        rep = server.get_json("/safesage/stats")
    except Exception as e:  # noqa: BLE001 - evidence only
        return {"stats_error": repr(e)}
    return {k: rep.get(k) for k in ("quality", "quality_last_run")}


def outcome(rc, w: dict, timeout: float) -> str:
    phase = w.get("phase")
    if rc == 0 and w.get("completed"):
        return "completed"
    if rc == "timeout":
        return f"timeout after {timeout:.0f} s (phase: {phase})"
    if rc == "execution_error":
        return f"Python error in the prompt, server alive (phase: {phase})"
    if rc == "rejected":
        return "prompt rejected"
    if rc == "harness_error":
        return f"harness error, server alive (phase: {phase})"
    if isinstance(rc, int) and rc < 0:
        return f"process abort: {logs.sig_name(rc)} (phase: {phase})"
    return f"Python error, exit {rc} (phase: {phase})"
