"""The ``merge`` section of bench/kernels/gpu_kvchunks.py (issue 29 point 4): the pack's kv_chunks call with the
fused key-chunk merge and with the old (torch) merge, in one process, against the same kernel on the
whole call -- its own ``return_lse`` variant and its plain variant -- on contiguous NHD inputs made
beforehand (as the ``anatomy`` section), at ``--merge-sizes`` (169,000 and 314,437 by default).

    python3 -m bench.kernels.gpu_kvchunks --only merge --out bench/results/kvchunks_merge_h200.json

Fields per size: ``kv_chunks_over_lse`` = kv_chunks (fused merge) ÷ the ``return_lse`` variant,
``kv_chunks_over_plain`` = kv_chunks (fused merge) ÷ the plain kernel; the same with the old merge
(``*_old_merge``, same process, same inputs); the earlier committed measurements under ``*_before``
(:data:`BEFORE`); the merge alone on chunk outputs made beforehand (``merge_only_ms``). The output of
both merges is compared (``fused_vs_old_max_abs``) and the plan of the last timed call recorded (a
re-plan between calls would show as more than one plan).
"""
from __future__ import annotations

import json
import os

import torch

from bench.common.benchutil import time_ms
from bench.kernels.kvchunks_common import HEADS, SM120_KV_RULE, first_call, guarded, h3_buffer, h3_views, kernels, noop, \
    record_error, with_kv_rule

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: the earlier numbers (before the fused merge), from committed results: size -> field -> (value, source)
BEFORE = {
    169000: {
        "kv_chunks_over_lse_before": ("kv_anatomy_h200.json", ("sections", "anatomy", "ms"), "pack_kv", "whole_lse"),
        "kv_chunks_over_plain_before": ("kv_anatomy_h200.json", ("sections", "anatomy", "ms"), "pack_kv", "whole"),
    },
    314437: {
        # no return_lse run over the whole call at 314,437 was committed (issue 29 quotes 1.011)
        "kv_chunks_over_plain_before": ("kvchunks_h200.json", ("sections", "kvchunks", "rows", "S=314437"),
                                        "kv_ms", "inlimit_kernel_ms"),
    },
}


def before_numbers(S: int, results_dir: str | None = None) -> dict:
    """The ``*_before`` ratios at ``S`` read from the committed results named in :data:`BEFORE`:
    field -> value, and ``before_sources``: field -> where it was read (or why it could not be: a
    file that is missing or lacks the numbers gives None and the error)."""
    results_dir = results_dir or os.path.join(ROOT, "bench", "results")
    out: dict = {"before_sources": {}}
    for field, (fname, path, num, den) in BEFORE.get(S, {}).items():
        src = f"bench/results/{fname}: {'/'.join(path)} {num} / {den}"
        try:
            with open(os.path.join(results_dir, fname)) as f:
                node = json.load(f)
            for p in path:
                if p.startswith("S="):
                    node = next(r for r in node if r.get("S") == int(p[2:]) and "error" not in r)
                else:
                    node = node[p]
            out[field] = node[num] / node[den]
        except (OSError, KeyError, StopIteration, TypeError, ValueError, ZeroDivisionError) as e:
            out[field] = None
            src += f" (not read: {type(e).__name__}: {e})"
        out["before_sources"][field] = src
    return out


def ratios(ms: dict) -> dict:
    """The section's ratios from its median times (keys plain, lse, kv_fused, kv_old)."""
    return {"kv_chunks_over_lse": ms["kv_fused"] / ms["lse"],
            "kv_chunks_over_plain": ms["kv_fused"] / ms["plain"],
            "kv_chunks_over_lse_old_merge": ms["kv_old"] / ms["lse"],
            "kv_chunks_over_plain_old_merge": ms["kv_old"] / ms["plain"],
            "fused_over_old_merge": ms["kv_fused"] / ms["kv_old"]}


def _merge_only(kern, nq, nk, nv, spans, dst, reps: int) -> dict:
    """The merge alone (fused and old) on chunk outputs made beforehand, into ``dst``."""
    from safe_ops.attention.lse_merge import KeyChunkMerge, set_fused
    outs = [kern.fn_lse(nq, nk[:, a:b], nv[:, a:b], "NHD", None) for a, b in spans]

    def run(fused: bool):
        def go():
            set_fused(fused)
            try:
                m = KeyChunkMerge(dst, len(outs))
                for o, lse in outs:
                    # the torch merge updates a float32 first output in place; sage's are bf16
                    m.add(o.transpose(1, 2), lse)
                return dst
            finally:
                set_fused(True)
        return go
    t = time_ms({"fused": run(True), "old": run(False)}, reps)
    del outs
    return t


def sec_merge(args) -> dict:
    from safe_ops.attention import lse_merge
    from safe_ops.ui import run_stats
    fam = args.kv_families[0]
    ks = kernels()
    if fam not in ks:
        return {"error": f"{fam} not available here"}
    kern = ks[fam]
    fused_mod = lse_merge.fused_module()
    res = {"family": fam, "kv_rule": SM120_KV_RULE, "reps": args.merge_reps,
           "fused_available": fused_mod is not None, "rows": []}
    for S in args.merge_sizes:
        r: dict = {"S": S}
        try:
            torch.cuda.empty_cache()
            buf = h3_buffer(S)
            q, k, v = h3_views(buf)
            # the whole-call references' inputs first: the plan is chosen with them allocated
            nq, nk, nv = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
            run_stats.reset()
            att = guarded(with_kv_rule(kern, SM120_KV_RULE))

            def kv():
                return att(noop, q, k, v, HEADS, skip_reshape=True, skip_output_reshape=True)

            def kv_old():
                lse_merge.set_fused(False)
                try:
                    return kv()
                finally:
                    lse_merge.set_fused(True)
            o, r["peak_extra_kv"], plan = first_call(att, kv)
            r.update(plan_kv=plan.describe(False), kv_chunk=plan.kv_chunk, kind=plan.kind,
                     fused_blocks=run_stats.value("kv_merge_fused"), torch_blocks=run_stats.value("kv_merge_torch"))
            o_old = kv_old()
            torch.cuda.synchronize()
            r["fused_vs_old_max_abs"] = float((o.float() - o_old.float()).abs().max())
            r["output_max_abs"] = float(o_old.float().abs().max())
            del o, o_old
            fns = {"plain": lambda: kern.fn(nq, nk, nv, "NHD", None),
                   "lse": lambda: kern.fn_lse(nq, nk, nv, "NHD", None),
                   "kv_fused": kv, "kv_old": kv_old}
            ms = time_ms(fns, args.merge_reps)
            r["ms"] = ms
            r.update(ratios(ms))
            try:
                r["plans_kept"] = len(att.prepared_plans())
                r["plan_kv_last"] = att.prepared_plans()[-1].plan.describe(False)
            except Exception as e:  # noqa: BLE001 - bookkeeping only
                r["plans_kept"] = f"unknown: {type(e).__name__}: {e}"
            kc = plan.kv_chunk or S
            spans = [(a, min(a + kc, S)) for a in range(0, S, kc)]
            r["merge_only_ms"] = _merge_only(kern, nq, nk, nv, spans, torch.empty_like(q), args.merge_reps)
            r.update(before_numbers(S))
            del buf, q, k, v, nq, nk, nv
        except Exception as e:  # noqa: BLE001
            record_error(r, e)
        res["rows"].append(r)
        print(json.dumps({k_: v_ for k_, v_ in r.items() if k_ != "traceback"})[:1500], flush=True)
    return res
