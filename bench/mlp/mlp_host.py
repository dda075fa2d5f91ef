#!/usr/bin/env python3
"""Host microseconds SafeSage's chunked H3 MLP adds per call, on the CPU (issue 29 point 3).

A tiny MiniMax H3 ``MLP`` built from ComfyUI's own classes (``comfy.ldm.minimax.model.MLP`` with
``comfy.ops.manual_cast`` bf16 Linears, hidden 64, ffn 96) behind SafeSage's object patch
(``mlp_patch.H3ChunkedMLPForward``, the cast memo installed in ``comfy.ops``): the device work is
a few microseconds of CPU matmul, so what is timed is mostly host work. Two cases:

  chunked      S = 64 tokens, 16 tokens per chunk (4 chunks): the patched call against ComfyUI's
               own forward run on the same 4 chunks by a plain loop (``per_chunk_loop``).
  auto         S = 64 tokens, mlp chunking "auto" (one chunk fits: ComfyUI's forward runs): the
               patched call against ComfyUI's forward alone. "auto" reads free memory; here the
               reading is ComfyUI's own ``get_free_memory`` for the call's device (psutil on the
               CPU; ``torch.cuda.memory_stats`` on a GPU, >= 100 us), installed as
               ``safe_ops.facts.budget.free_device_bytes`` so that the CPU device takes the path a
               CUDA device takes. ``free_memory_reads`` counts its calls over the timed calls.

``host_us_per_call`` = patched call - baseline, each its fastest round (same process, interleaved).
``--label before|after`` names the code measured (``--merge`` adds it to an existing JSON), so one
file holds the numbers of the code before a change (run from a checkout of it with this file copied
in, ``--code-rev`` naming it) and after it.

    (cd <checkout of the old commit> && PYTHONPATH=<ComfyUI 0dd9b154> python3 -m bench.mlp.mlp_host --label before \\
        --code-rev <commit> --merge --out <repo>/bench/results/mlp_host_cpu.json)
    PYTHONPATH=<ComfyUI 0dd9b154> python3 -m bench.mlp.mlp_host --label after --merge \\
        --out bench/results/mlp_host_cpu.json

ComfyUI comes from ``PYTHONPATH`` (this file edits no ``sys.path``); a COMFYUI_PATH that is set must name
that same tree. Run from the repository root (``-m``: the repository is on the path from there).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

from bench.common.cmdline import command, write_json

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HIDDEN, FFN, S, CHUNK = 64, 96, 64, 16


def _comfy_tree() -> str:
    """The ComfyUI tree that PYTHONPATH imports; exits saying what to set when there is none with H3."""
    from tools.harness.comfy_attention_fn import imported_comfy
    tree = imported_comfy()
    if tree is None:
        sys.exit("bench.mlp.mlp_host: ComfyUI is not importable: put a ComfyUI tree with MiniMax H3 (e.g. 0dd9b154) on "
                 "PYTHONPATH: PYTHONPATH=<ComfyUI tree> python3 -m bench.mlp.mlp_host ...")
    named = os.environ.get("COMFYUI_PATH")
    if named and os.path.realpath(named) != os.path.realpath(tree):
        sys.exit(f"bench.mlp.mlp_host: COMFYUI_PATH names {named}, but PYTHONPATH imports ComfyUI from {tree}")
    if not os.path.isfile(os.path.join(tree, "comfy", "ldm", "minimax", "model.py")):
        sys.exit(f"bench.mlp.mlp_host: the ComfyUI on PYTHONPATH ({tree}) has no MiniMax H3 "
                 "(comfy/ldm/minimax/model.py): use 0dd9b154 or later")
    return tree


def _comfy():
    _comfy_tree()
    import comfy.cli_args
    comfy.cli_args.args.cpu = True          # before comfy.model_management is imported
    import comfy.model_management as mm
    import comfy.ldm.minimax.model as h3
    import comfy.ops
    return mm, h3, comfy.ops


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _rev() -> str | None:
    try:
        rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return rev + ("+dirty" if dirty else "") if rev else None
    except OSError:
        return None


def _per_call_us(fns: dict, calls: int, rounds: int) -> dict:
    """The fastest of ``rounds`` rounds of (CPU seconds of this thread for ``calls`` calls) / calls,
    in microseconds; the fns interleaved within a round. Thread CPU time and the fastest round:
    on a machine shared with other processes their load only ever adds time."""
    for fn in fns.values():
        for _ in range(20):
            fn()
    out = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.thread_time()
            for _ in range(calls):
                fn()
            out[name].append((time.thread_time() - t0) / calls * 1e6)
    return {k: min(v) for k, v in out.items()}


def measure(calls: int, rounds: int) -> dict:
    import torch
    mm, h3, ops = _comfy()
    from safe_ops.facts import budget
    from safe_ops.models.h3 import cast_memo, mlp_patch
    torch.set_num_threads(1)

    torch.manual_seed(0)
    m = h3.MLP(HIDDEN, FFN, dtype=torch.bfloat16, device="cpu", operations=ops.manual_cast)
    for lin in (m.fc1, m.fc2):
        lin.weight = torch.nn.Parameter((torch.randn(lin.out_features, lin.in_features) * 0.1).to(torch.bfloat16),
                                        requires_grad=False)
    assert cast_memo.install()
    x = torch.randn(S, HIDDEN).to(torch.bfloat16)

    reads = [0]

    def comfy_free(device):          # ComfyUI's own reading, for the CPU device too
        reads[0] += 1
        return int(mm.get_free_memory(device))
    budget.free_device_bytes = comfy_free

    chunked = mlp_patch.H3ChunkedMLPForward(m, "blocks.0.mlp", CHUNK)
    auto = mlp_patch.H3ChunkedMLPForward(m, "blocks.0.mlp", "auto")
    fwd = type(m).forward

    def per_chunk_loop():
        out = torch.empty(S, HIDDEN, dtype=x.dtype)
        for a in range(0, S, CHUNK):
            out[a:a + CHUNK].copy_(fwd(m, x[a:a + CHUNK]))
        return out

    with torch.no_grad():
        # the patched forwards give ComfyUI's numbers (same code on the same chunks)
        assert torch.equal(chunked(x), per_chunk_loop()) and torch.equal(auto(x), fwd(m, x))
        t = _per_call_us({"patched": lambda: chunked(x), "per_chunk_loop": per_chunk_loop}, calls, rounds)
        reads[0] = 0
        ta = _per_call_us({"patched": lambda: auto(x), "comfy_forward": lambda: fwd(m, x)}, calls, rounds)
        n_auto = (calls * rounds + 20)          # timed calls of the auto patch, warm-up included
        auto_reads = reads[0]
        t0 = time.thread_time()
        for _ in range(1000):
            mm.get_free_memory(torch.device("cpu"))
        free_read_us = (time.thread_time() - t0) / 1000 * 1e6
    return {
        "chunked": {"tokens": S, "chunk_tokens": CHUNK, "chunks": S // CHUNK, "us": t,
                    "host_us_per_call": round(t["patched"] - t["per_chunk_loop"], 2)},
        "auto": {"tokens": S, "us": ta, "host_us_per_call": round(ta["patched"] - ta["comfy_forward"], 2),
                 "patched_calls": n_auto, "free_memory_reads": auto_reads,
                 "free_memory_reads_per_call": round(auto_reads / n_auto, 4)},
        "comfy_get_free_memory_us_cpu": round(free_read_us, 2),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000, help="calls per timed round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--label", default="after", help="which code this measures (before / after a change)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--merge", action="store_true", help="add this label to --out's existing JSON")
    ap.add_argument("--code-rev", default=None, help="the measured code's commit, where it is not a git checkout")
    a = ap.parse_args(argv)
    import torch
    res = measure(a.calls, a.rounds)
    row = {"command": command("mlp.mlp_host"), "code_rev": a.code_rev or _rev(), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                                     time.gmtime()),
           **res}
    doc = {}
    if a.out and a.merge and os.path.exists(a.out):
        with open(a.out) as f:
            doc = json.load(f)
    doc.setdefault("bench", "bench/mlp/mlp_host.py: host microseconds per patched H3 MLP call (CPU)")
    doc["machine"] = {"node": platform.node(), "cpu": _cpu_name(), "cores": os.cpu_count(),
                      "torch": torch.__version__, "python": sys.version.split()[0], "torch_threads": 1,
                      "comfyui": os.path.basename(_comfy_tree().rstrip("/"))}
    doc.setdefault("runs", {})[a.label] = row
    runs = doc["runs"]
    if "before" in runs and "after" in runs:
        doc["host_us_per_mlp_call_before"] = {k: runs["before"][k]["host_us_per_call"] for k in ("chunked", "auto")}
        doc["host_us_per_mlp_call"] = {k: runs["after"][k]["host_us_per_call"] for k in ("chunked", "auto")}
        doc["free_memory_reads_per_call_before"] = runs["before"]["auto"]["free_memory_reads_per_call"]
        doc["free_memory_reads_per_call"] = runs["after"]["auto"]["free_memory_reads_per_call"]
    write_json(doc, a.out, echo=False)
    print(json.dumps(row, indent=1))
    return doc


if __name__ == "__main__":
    main()
