"""H200 runs for issue 11: every sage-2 family and comfy-kitchen at H3 shapes, kv_chunks through
SafeAttention, the comfy-kitchen boundary probe and the 99,866-token guarded/in-limit ratio.

    python -m bench.kernels.gpu_kvchunks --out bench/results/kvchunks_h200.json          # ~5-6 min on an H200
    python -m bench.kernels.gpu_kvchunks --quick --out /tmp/kvchunks_quick.json          # ~2-3 min
    python -m bench.kernels.gpu_kvchunks --update-table bench/results/kvchunks_h200.json  # -> kernel_table.json
    python -m bench.kernels.gpu_kvchunks --only merge --out bench/results/kvchunks_merge_h200.json  # fused merge, ~5 min

Sections (``--only a,b``): ``families`` (time + rel. L2 of each sage-2 family, comfy-kitchen
int8 and SDPA; TFLOP/s rows for kernel_table.json), ``kvchunks`` (the kv_chunks plan with the
real sage 2.2 kernels vs the same kernel's unchunked plan), ``ck_probe`` (where comfy-kitchen's
int8_attention starts refusing or failing), ``guard`` (guarded/in-limit at 99,866 tokens),
``anatomy`` (where kv_chunks' extra time goes: raw kernel with/without ``return_lse``, keys
whole/split, the merge alone, per-kernel profiles; not in the default ``--only``), ``merge`` (issue 29:
kv_chunks with the fused and the old key-chunk merge vs the kernel's ``return_lse`` and plain variants
on the whole call, bench/kernels/kvchunks_merge.py; not in the default ``--only``).
Every section runs in its own child process (an illegal memory access poisons the CUDA
context) and every family inside it in try/except, with the error recorded.

Inputs are MiniMax H3's: q/k/v are strided [1,56,S,128] views of one [S, 3*56*128] bf16
buffer (random normal values). Relative L2 is measured against PyTorch SDPA on a slice of
query rows (the first and last ``ROWS`` rows, all heads, all keys): the full SDPA output at
314k tokens is slow and large, and the last rows are where index wrap-around shows.
Timings: CUDA events, median of ``--reps`` after one warm-up, interleaved.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from bench.common.benchutil import profile_table, time_ms  # noqa: F401  (time_ms: used by the sections)
from bench.kernels.kvchunks_ck_probe import sec_ck_probe
from bench.kernels.kvchunks_merge import sec_merge
from bench.kernels.kvchunks_common import (D, HEADS, SM120_KV_RULE, emit, env_info, first_call, flops, guarded, h3_buffer,
                                   h3_views, kernels, noop, record_error, rel_l2, row_index, sdpa_rows, with_kv_rule)


# ---------------------------------------------------------------------- families
def inlimit_fn(kern, nhd):
    """The raw kernel on in-limit inputs: contiguous NHD copies, in the fewest equal head groups
    whose every launch passes the family's envelope. At 314,437 tokens a whole
    contiguous NHD call is itself past sage2_sm80's limit (299,595), so it cannot be the
    reference there. Returns (callable, number of groups)."""
    from safe_ops.families.envelope import AttnCall, TensorDesc, check
    from safe_ops.facts.devices import runtime
    S = nhd[0].shape[1]
    for groups in (g for g in range(1, HEADS + 1) if HEADS % g == 0):
        hg = HEADS // groups
        t = TensorDesc.contiguous((1, hg, S, D), "NHD")
        call = AttnCall(t, t, t, "bfloat16", "NHD", False, "cuda", runtime().arch_name, 2)
        if not check(call, kern.envelope):
            break
    else:
        raise RuntimeError(f"{kern.family}: no head group of contiguous NHD at {S:,} tokens is in limit")
    if groups == 1:
        return (lambda: kern.fn(*nhd, "NHD", None)), 1
    hg = HEADS // groups
    parts = [[x[:, :, i * hg:(i + 1) * hg].contiguous() for x in nhd] for i in range(groups)]
    return (lambda: [kern.fn(*p, "NHD", None) for p in parts]), groups


def sec_families(args) -> dict:
    """Each family at H3 shapes: the guarded call on the strided views (the plan the planner
    picks for that family alone) and the raw kernel on in-limit inputs (contiguous NHD copies);
    SDPA on the views. TFLOP/s use the in-limit time, as kernel_table.json always has."""
    from safe_ops.ui import run_stats
    rows = []
    ks = kernels()
    for S in args.sizes:
        torch.cuda.empty_cache()
        buf = h3_buffer(S)
        q, k, v = h3_views(buf)
        idx = row_index(S)
        ref = sdpa_rows(q, k, v, idx)
        t_sdpa = time_ms({"sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)}, args.reps)["sdpa"]
        row = {"S": S, "sdpa_ms": t_sdpa, "tflops": {"sdpa": flops(S) / t_sdpa / 1e9}, "families": {}}
        nhd = [t.transpose(1, 2).contiguous() for t in (q, k, v)]        # [1,S,56,128] contiguous
        for fam, kern in ks.items():
            r = {"tolerance": kern.tolerance}
            try:
                run_stats.reset()
                att = guarded(kern)
                g = lambda: att(noop, q, k, v, HEADS, skip_reshape=True, skip_output_reshape=True)  # noqa: E731
                o = g()
                torch.cuda.synchronize()
                r["plan"] = next(iter(run_stats.PLANS.values()), "")
                r["rel_l2_vs_sdpa"] = rel_l2(o[:, :, idx], ref)
                r["finite"] = bool(torch.isfinite(o).all())
                del o
                kin, groups = inlimit_fn(kern, nhd)
                r["inlimit_head_groups"] = groups
                t = time_ms({"guarded": g, "inlimit": kin}, args.reps)
                r.update(guarded_ms=t["guarded"], inlimit_kernel_ms=t["inlimit"],
                         guarded_over_inlimit=t["guarded"] / t["inlimit"],
                         tflops_inlimit=flops(S) / t["inlimit"] / 1e9, tflops_guarded=flops(S) / t["guarded"] / 1e9)
                row["tflops"][fam] = r["tflops_inlimit"]
            except Exception as e:  # noqa: BLE001
                record_error(r, e)
            row["families"][fam] = r
            print(S, fam, json.dumps({k_: v_ for k_, v_ in r.items() if k_ != "traceback"})[:400], flush=True)
            torch.cuda.synchronize()
        rows.append(row)
        del buf, q, k, v, nhd, ref
    # kernel_table.json entry: median over sizes (families with a number at every size)
    import statistics
    fams = set.intersection(*(set(r["tflops"]) for r in rows)) if rows else set()
    entry = {f: round(statistics.median(r["tflops"][f] for r in rows), 1) for f in sorted(fams)}
    # only families whose output is right may order `auto`
    bad = {f for r in rows for f, x in r["families"].items()
           if "error" in x or not x.get("finite", False) or x.get("rel_l2_vs_sdpa", 1) > x["tolerance"]}
    return {"rows": rows, "kernel_table_tflops": {f: t for f, t in entry.items() if f not in bad},
            "excluded_from_table": sorted(bad), "sizes": args.sizes}


def sec_kvchunks(args) -> dict:
    """kv_chunks through SafeAttention with the real sage 2.2 kernel: the family's envelope plus
    sm_120's key-length rule (kv_len < 150,000) makes the planner chunk the keys, exactly as on an
    RTX 5090; the reference is the same kernel's unchunked plan (the envelope without that rule)."""
    from safe_ops.ui import run_stats
    out = []
    ks = kernels()
    for i, fam in enumerate(args.kv_families):
        if fam not in ks:
            out.append({"family": fam, "error": "not available here"})
            continue
        kern = ks[fam]
        chunked = with_kv_rule(kern, SM120_KV_RULE)
        for S in (args.kv_sizes if i == 0 else args.kv_sizes_more):
            r = {"family": fam, "S": S}
            try:
                torch.cuda.empty_cache()
                buf = h3_buffer(S)
                q, k, v = h3_views(buf)
                idx = row_index(S)
                ref = sdpa_rows(q, k, v, idx)
                run_stats.reset()
                a_kv, a_ref = guarded(chunked), guarded(kern)
                f_kv = lambda: a_kv(noop, q, k, v, HEADS, skip_reshape=True, skip_output_reshape=True)  # noqa: E731
                f_ref = lambda: a_ref(noop, q, k, v, HEADS, skip_reshape=True, skip_output_reshape=True)  # noqa: E731
                # first call of each: plan, warm-up, output for rel. L2 and measured peak memory
                o, r["peak_extra_kv"], p_kv = first_call(a_kv, f_kv)
                r.update(plan_kv=p_kv.describe(False), kv_chunk=p_kv.kv_chunk, kind=p_kv.kind,
                         rel_l2_kv=rel_l2(o[:, :, idx], ref), finite_kv=bool(torch.isfinite(o).all()))
                del o
                o, r["peak_extra_ref"], p_ref = first_call(a_ref, f_ref)
                r.update(plan_ref=p_ref.describe(False), rel_l2_ref=rel_l2(o[:, :, idx], ref))
                del o
                fns = {"kv": f_kv, "ref": f_ref}
                # the same kernel on in-limit inputs made beforehand (contiguous NHD copies), where
                # such inputs exist for this family at S
                from safe_ops.families.envelope import AttnCall, TensorDesc, check
                nd = TensorDesc.contiguous((1, HEADS, S, D), "NHD")
                if not check(AttnCall(nd, nd, nd, "bfloat16", "NHD"), kern.envelope):
                    nhd = [t_.transpose(1, 2).contiguous() for t_ in (q, k, v)]
                    fns["inlimit"] = lambda: kern.fn(*nhd, "NHD", None)  # noqa: E731
                    fns["inlimit"]()
                t = time_ms(fns, args.kv_reps, warm=False)
                if "inlimit" in t:
                    r.update(inlimit_kernel_ms=t["inlimit"], kv_over_inlimit=t["kv"] / t["inlimit"],
                             ref_over_inlimit=t["ref"] / t["inlimit"])
                    del nhd
                r.update(kv_ms=t["kv"], ref_ms=t["ref"], kv_over_ref=t["kv"] / t["ref"],
                         predicted_peak_kv=p_kv.peak_bytes, predicted_peak_ref=p_ref.peak_bytes,
                         output_bytes=q.numel() * q.element_size())
                del buf, q, k, v, ref
            except Exception as e:  # noqa: BLE001
                record_error(r, e)
            out.append(r)
            emit(r)
    return {"rows": out, "kv_rule": SM120_KV_RULE}


# ---------------------------------------------------------------------- anatomy
def sec_anatomy(args) -> dict:
    """Where kv_chunks' extra time goes, at one size: the raw kernel on contiguous NHD inputs
    (whole keys, with and without ``return_lse``; the keys split in the plan's chunks, with and
    without ``return_lse``; the split plus the pack's own merge), the pack's kv_chunks call and
    its unchunked plan, and a per-kernel profile of the pack's call and of the whole-key call."""
    from safe_ops.ui import run_stats
    from safe_ops.attention.lse_merge import KeyChunkMerge
    fam = args.kv_families[0]
    ks = kernels()
    if fam not in ks:
        return {"error": f"{fam} not available here"}
    kern = ks[fam]
    S = args.anatomy_S
    buf = h3_buffer(S)
    q, k, v = h3_views(buf)
    run_stats.reset()
    a_kv, a_ref = guarded(with_kv_rule(kern, SM120_KV_RULE)), guarded(kern)
    f_kv = lambda: a_kv(noop, q, k, v, HEADS, skip_reshape=True, skip_output_reshape=True)  # noqa: E731
    f_ref = lambda: a_ref(noop, q, k, v, HEADS, skip_reshape=True, skip_output_reshape=True)  # noqa: E731
    o, _, plan = first_call(a_kv, f_kv)
    del o
    kc = plan.kv_chunk or S
    spans = [(a, min(a + kc, S)) for a in range(0, S, kc)]
    nq, nk, nv = [t.transpose(1, 2).contiguous() for t in (q, k, v)]      # [1,S,56,128] contiguous
    f, fl = kern.fn, kern.fn_lse

    def split(lse: bool, merge: bool = False, cuts=None):
        def run():
            outs = []
            dst = torch.empty_like(q) if merge else None
            m = KeyChunkMerge(dst, len(cuts or spans)) if merge else None   # the pack's merge
            for a, b in (cuts or spans):
                if lse:
                    o_, l_ = fl(nq, nk[:, a:b], nv[:, a:b], "NHD", None)
                    if merge:
                        m.add(o_.transpose(1, 2), l_)
                        del o_, l_
                    else:
                        outs.append(o_)
                else:
                    outs.append(f(nq, nk[:, a:b], nv[:, a:b], "NHD", None))
            return dst if merge else outs
        return run

    # one long chunk and one short one (the planner splits evenly; is the split or the count the cost?)
    big = min(S - 128, (SM120_KV_RULE - 1) // 128 * 128)
    fns = {
        "whole": lambda: f(nq, nk, nv, "NHD", None),
        "whole_lse": lambda: fl(nq, nk, nv, "NHD", None),
        "split": split(False),
        "split_lse": split(True),
        "split_lse_merge": split(True, merge=True),
        "uneven_lse": split(True, cuts=[(0, big), (big, S)]),
        "pack_kv": f_kv,
        "pack_ref": f_ref,
    }
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    t = time_ms(fns, args.anatomy_reps, warm=False)
    res = {"family": fam, "S": S, "plan_kv": plan.describe(False), "kv_chunk": kc, "spans": spans,
           "uneven_cuts": [[0, big], [big, S]], "ms": t,
           "over_whole": {k_: v_ / t["whole"] for k_, v_ in t.items()}}
    # the merge alone on outputs made beforehand
    outs = [fl(nq, nk[:, a:b], nv[:, a:b], "NHD", None) for a, b in spans]
    dst = torch.empty_like(q)

    def merge_only():
        m = KeyChunkMerge(dst, len(outs))
        for o_, l_ in outs:
            m.add(o_.transpose(1, 2), l_)
        return dst
    res["merge_only_ms"] = time_ms({"m": merge_only}, args.anatomy_reps)["m"]
    del outs
    print(json.dumps(res)[:1500], flush=True)
    res["profile_pack_kv"] = profile_table(f_kv)[1]
    res["profile_whole"] = profile_table(fns["whole"])[1]
    res["profile_split_lse"] = profile_table(fns["split_lse"])[1]
    for k_ in ("profile_pack_kv", "profile_whole", "profile_split_lse"):
        print(k_, json.dumps(res[k_])[:1500], flush=True)
    return res


# ---------------------------------------------------------------------- guard
def sec_guard(args) -> dict:
    """Guarded call (SafeAttention, the runtime's sage kernel, the planner's plan) vs the same
    kernel on in-limit inputs made beforehand (contiguous copies in the plan's layout), at the
    first length past the strided limit; interleaved, median of ``--guard-reps``."""
    from safe_ops.ui import run_stats
    from safe_ops.families.registry import sage_kernel
    from safe_ops.facts.devices import runtime
    rt = runtime()
    rows = []
    fams = [rt.sage_family] + [f for f in args.guard_families if f != rt.sage_family]
    ks = kernels()
    for fam in fams:
        kern = sage_kernel(rt) if fam == rt.sage_family else ks.get(fam)
        r = {"family": fam, "S": args.guard_S}
        if kern is None:
            r["error"] = rt.sage_error or "not available"
            rows.append(r)
            continue
        try:
            S = args.guard_S
            buf = h3_buffer(S)
            q, k, v = h3_views(buf)
            run_stats.reset()
            att = guarded(kern)
            g = lambda: att(noop, q, k, v, HEADS, skip_reshape=True, skip_output_reshape=True)  # noqa: E731
            g()
            prepared = next(iter(att.prepared_plans()), None)
            if prepared is None:     # the kernel raised or failed its probe: the call fell back to SDPA
                raise RuntimeError(f"no plan kept: fallbacks {dict(run_stats.snapshot()['fallback_reasons'])}")
            plan = prepared.plan
            lay = plan.layout
            if lay == "NHD":
                ins = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
            else:
                ins = [t.contiguous() for t in (q, k, v)]
            kin = lambda: kern.fn(*ins, lay, None)  # noqa: E731
            t = time_ms({"guarded": g, "inlimit": kin}, args.guard_reps)
            r.update(plan=plan.describe(False), guarded_ms=t["guarded"], inlimit_kernel_ms=t["inlimit"],
                     guarded_over_inlimit=t["guarded"] / t["inlimit"])
            del buf, q, k, v, ins
        except Exception as e:  # noqa: BLE001
            record_error(r, e)
        rows.append(r)
        emit(r)
        torch.cuda.empty_cache()
    return {"rows": rows}


def update_table(result_path: str, table_path: str, only: list[str] | None = None) -> dict:
    """Merge a run's measured TFLOP/s (``families`` section: families whose output was right)
    into safe_ops/facts/kernel_table.json under the run's arch; families not re-measured are kept.
    ``only``: merge just these families (a run at other sizes adds a family without moving
    the medians the others were measured at)."""
    with open(result_path) as f:
        res = json.load(f)
    fam = res.get("sections", {}).get("families", {})
    if not fam.get("kernel_table_tflops"):
        raise SystemExit(f"{result_path}: no measured families section (error: {fam.get('error') or fam.get('stderr_tail')})")
    new = {k: v for k, v in fam["kernel_table_tflops"].items() if only is None or k in only}
    if not new:
        raise SystemExit(f"{result_path}: none of {only} measured right in this run")
    from tables import merge_into_table
    rel = os.path.relpath(os.path.abspath(result_path), ROOT)
    return merge_into_table(res["env"]["arch"], res["env"]["gpu"], new, fam["sizes"],
                            f"{rel} (families: {', '.join(sorted(new))}): {res['env']['command']}",
                            table_path=table_path)


SECTIONS = {"families": sec_families, "kvchunks": sec_kvchunks, "ck_probe": sec_ck_probe, "guard": sec_guard,
            "anatomy": sec_anatomy, "merge": sec_merge}


def run_section(name: str, argv: list[str], timeout: int) -> dict:
    tmp = f"/tmp/safesage_kv_{name}_{os.getpid()}.json"
    if os.path.exists(tmp):
        os.remove(tmp)
    t0 = time.time()
    try:
        p = subprocess.run([sys.executable, "-m", "bench.kernels.gpu_kvchunks", "--child", name, "--child-out", tmp] + argv,
                           capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        rc, err, outp = p.returncode, p.stderr, p.stdout
    except subprocess.TimeoutExpired as e:
        rc, err, outp = "timeout", (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or ""), ""
    sys.stdout.write(outp or "")
    res = {"returncode": rc, "seconds": round(time.time() - t0, 1)}
    if rc != 0:
        res["stderr_tail"] = (err or "").strip().splitlines()[-15:]
    if os.path.exists(tmp):
        with open(tmp) as f:
            res.update(json.load(f))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true", help="fewer sizes, families and repetitions (~2-3 min)")
    ap.add_argument("--only", default="families,kvchunks,ck_probe,guard")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--sizes", default="38000,100000,169000")
    ap.add_argument("--kv-sizes", default="169000,230000,314437")
    ap.add_argument("--kv-reps", type=int, default=2)
    ap.add_argument("--kv-sizes-more", default="314437", help="sizes for the 2nd and later --kv-families")
    # per_warp is sm_120's kernel; sm89_fp8pv has the Triton per_thread quantiser (sageattn on
    # sm_89). sage2_sm90 as built on the H200 computes garbage (HAZARDS.md), so not by default.
    ap.add_argument("--kv-families", default="sage2_fp8pv_perwarp,sage2_sm89_fp8pv")
    ap.add_argument("--ck-max", type=int, default=320_000)
    ap.add_argument("--guard-S", type=int, default=99_866)
    ap.add_argument("--guard-reps", type=int, default=7)
    ap.add_argument("--guard-families", default="sage2_sm89_fp8pv",
                    help="besides the runtime's own sage family; sm89_fp8pv needs a q copy at 99,866 "
                         "(per_warp runs direct there: nothing to measure)")
    ap.add_argument("--anatomy-S", type=int, default=169_000)
    ap.add_argument("--anatomy-reps", type=int, default=3)
    ap.add_argument("--merge-sizes", default="169000,314437")
    ap.add_argument("--merge-reps", type=int, default=3)
    ap.add_argument("--section-timeout", type=int, default=420)
    ap.add_argument("--update-table", metavar="RESULT_JSON",
                    help="merge RESULT_JSON's measured TFLOP/s into safe_ops/facts/kernel_table.json and exit (no GPU)")
    ap.add_argument("--table-families", default=None, metavar="A,B",
                    help="with --update-table: merge only these families")
    ap.add_argument("--child")
    ap.add_argument("--child-out")
    args = ap.parse_args()
    if args.quick:
        args.reps, args.guard_reps, args.kv_reps = 1, 3, 1
        args.sizes, args.kv_sizes = "38000,169000", "169000,314437"
        args.kv_families = "sage2_fp8pv_perwarp"
    args.sizes = [int(x) for x in str(args.sizes).split(",") if x]
    args.kv_sizes = [int(x) for x in str(args.kv_sizes).split(",") if x]
    args.kv_sizes_more = [int(x) for x in str(args.kv_sizes_more).split(",") if x]
    args.merge_sizes = [int(x) for x in str(args.merge_sizes).split(",") if x]
    args.kv_families = [x for x in str(args.kv_families).split(",") if x]
    args.guard_families = [x for x in str(args.guard_families).split(",") if x]
    if args.update_table:
        entry = update_table(args.update_table, os.path.join(ROOT, "safe_ops", "facts", "kernel_table.json"),
                             args.table_families.split(",") if args.table_families else None)
        print(json.dumps(entry, indent=1))
        return
    if args.child:
        try:
            res = SECTIONS[args.child](args)
        except Exception as e:  # noqa: BLE001
            res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
        with open(args.child_out, "w") as f:
            json.dump(res, f, indent=1, default=str)
        return
    if not torch.cuda.is_available():
        print("gpu_kvchunks: needs a CUDA GPU (none visible); nothing measured.")
        sys.exit(2)
    res = {"env": env_info(), "quick": args.quick, "sections": {}}
    child_argv, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
        elif a == "--out":
            skip = True
        elif not a.startswith("--out="):
            child_argv.append(a)
    for name in [x for x in args.only.split(",") if x]:
        print(f"== {name}", flush=True)
        res["sections"][name] = run_section(name, child_argv, args.section_timeout)
        if args.out:          # write as we go: a later crash keeps what was measured
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1, default=str)
    print(json.dumps(res, default=str)[:3000])


if __name__ == "__main__":
    main()
