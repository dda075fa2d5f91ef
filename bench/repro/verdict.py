"""The verdict on a driver run's rows, as docs/REPRODUCTION.md's tables print it: outcome (with the
error, the OOM attribution or the abort's `what():` line and Python frame), rel. L2 vs the PyTorch
arm and vs the row's own unguarded arm, s/step, peak memory, weight residency; a completed row is
called silently wrong when its rel. L2 passes WRONG_FACTOR x the in-limit error of the same
checkpoint. Reads the committed bench/results/repro_*.json as the driver writes them."""
from __future__ import annotations

import json
import re

from .arms import ARM_LABEL, ARMS, SIZES


def _fmt(x, nd=3):
    if x is None:
        return "–"
    if isinstance(x, float):
        if x == 0:
            return "0"
        if abs(x) < 1e-3 or abs(x) >= 1e4:
            return f"{x:.2e}"
        return f"{x:.{nd}f}"
    return str(x)


WRONG_FACTOR = 2.0   # a completed row is "silently wrong" above this many times the in-limit error


def _run_identity(doc) -> tuple:
    """What makes two driver runs' latents comparable: the checkpoint (a synthetic drift included: the
    same bytes either way), steps, seed and emulated arch."""
    ck = doc.get("checkpoint") or {}
    cmd = doc.get("command", "").split()
    arch = cmd[cmd.index("--emulate-arch") + 1] if "--emulate-arch" in cmd else None
    drift = (doc.get("checkpoint_settings") or {}).get("drift") or ck.get("drift")
    return (ck.get("bytes") or doc.get("ckpt"), ck.get("blocks"), ck.get("weights", "fp8"),
            json.dumps(drift, sort_keys=True), doc.get("steps"), doc.get("seed"), arch)


def in_limit_error(docs, doc):
    """The attention kernel's own error through this model: rel. L2 vs the PyTorch arm of the unguarded
    sage arm at the reporter's clean size (38k, 37,966 tokens: inside every sage kernel's index limits,
    the smallest of which is 99,866) in any of `docs` made with the same checkpoint, steps, seed and arch.
    None when no such run is among them."""
    key = _run_identity(doc)
    for d in docs:
        if _run_identity(d) != key:
            continue
        for r in d.get("runs", []):
            if r["size"] == "38k" and r["arm"] == "sage" and r.get("outcome") == "completed" \
                    and r.get("rel_l2_vs_pytorch") is not None:
                return r["rel_l2_vs_pytorch"]
    return None


def table(doc, docs=()) -> str:
    """Markdown table of one driver run. A completed row is marked silently wrong when its rel. L2 vs the
    PyTorch arm passes WRONG_FACTOR x in_limit_error (looked up in doc and `docs`); without that
    reference no row is judged, and a line under the table says so."""
    floor = in_limit_error([doc, *docs], doc)
    rows = ["| tokens (S) | arm | outcome | rel. L2 vs PyTorch arm | rel. L2 vs own unguarded arm | s/step | peak GPU mem (torch alloc / NVML, GiB) | weights resident during the step (MiB, min–max) |",
            "|---|---|---|---|---|---|---|---|"]
    size_order = {k: i for i, k in enumerate(SIZES)}
    size_order.update({"38k": 0, "100k": 1, "169k": 2})
    arm_order = {k: i for i, k in enumerate(ARMS)}
    for r in sorted(doc.get("runs", []), key=lambda r: (size_order.get(r["size"], 9), arm_order.get(r["arm"], 9))):
        w = r.get("worker", {}) or {}
        S = w.get("packed_tokens")
        size = f"{r['size']} ({S:,})" if S else r["size"]
        steps = w.get("s_per_step")
        st = "; ".join(_fmt(x, 2) for x in steps) if steps else "–"
        mem = w.get("memory") or {}
        m = "–"
        if mem:
            m = f"{_fmt(mem.get('torch_peak_allocated_gib'), 1)} / {_fmt(mem.get('nvml_peak_process_gib'), 1)}"
        out = r.get("outcome", "")
        if r.get("error"):
            out += ": `" + r["error"].strip()[:120].replace("|", "\\|") + "`"
            oom = w.get("memory_at_oom") or {}
            if "cuda_free_mib" in oom:
                out += (f"; then: CUDA free {oom['cuda_free_mib']:,} MiB, torch allocated {oom['torch_allocated_gib']} / "
                        f"reserved {oom['torch_reserved_gib']} GiB, weights resident {oom.get('weights_resident_mib', '?')} MiB")
        elif out.startswith(("process abort", "timeout")):
            what = [ln.split("what():", 1)[1].strip() for ln in r.get("key_lines", []) if "what():" in ln]
            if what:
                out += ": `" + what[-1][:100].replace("|", "\\|") + "`"
            stack = r.get("python_stack_at_abort") or []
            if stack:
                mm = re.search(r'File ".*?([^/]+/[^/]+\.py)", line (\d+) in (\S+)', stack[0])
                if mm:
                    out += f"; Python was at `{mm.group(1)}:{mm.group(2)} {mm.group(3)}`"
        elif out == "completed" and floor is not None and (r.get("rel_l2_vs_pytorch") or 0) > WRONG_FACTOR * floor:
            out += " **(silently wrong output)**"
        rel = r.get("rel_l2_vs_pytorch")
        ru = r.get("rel_l2_vs_unguarded")
        ru = f"{_fmt(ru, 4)} (vs {r['unguarded_arm']})" if ru is not None else "–"
        lo, hi = w.get("resident_mib_min"), w.get("resident_mib_max")
        res_ = f"{lo:,}–{hi:,} of {w.get('model_size_mib') or 0:,}" if lo is not None else "–"
        rows.append(f"| {size} | {ARM_LABEL.get(r['arm'], r['arm'])} | {out} | {_fmt(rel, 4) if rel is not None else '–'} "
                    f"| {ru} | {st} | {m} | {res_} |")
    if floor is None:
        rows.append("\n(No unguarded sage run at 38k with this checkpoint among the tables given: "
                    "no row is judged wrong or right by its rel. L2.)")
    return "\n".join(rows)
