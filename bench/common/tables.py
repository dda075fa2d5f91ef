"""Write docs/BENCHMARKS.md (and the measured kernel table) from bench/results/*.json.

    python -m bench.common.tables                 # regenerate docs/BENCHMARKS.md
    python -m bench.common.tables --update-table  # also merge attention_h200.json's numbers into safe_ops/facts/kernel_table.json

Every table names the command and machine recorded in its JSON file.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RES = os.path.join(ROOT, "bench", "results")
GiB = 2**30

from bench.common.tables_comfy import compiler_section, mlp_comfy_section, soak_section  # noqa: E402


def _load(name):
    p = os.path.join(RES, name)
    if not os.path.exists(p):
        return None
    with open(p) as f:
        return json.load(f)


def _env_line(env: dict) -> str:
    return (f"`{env.get('command')}` on {env.get('gpu')}, torch {env.get('torch')}, "
            f"sageattention {env.get('sageattention')}, triton {env.get('triton')} ({env.get('time_utc')})")


def attention_section(d) -> list[str]:
    out = ["## Guarded attention vs the same kernel in-limit vs SDPA", "",
           "MiniMax H3 shape: q/k/v `[1, 56, S, 128]` bf16, strided views into the fused qkv buffer "
           "(token stride 21,504). *In-limit kernel*: raw `sageattn` on pre-made contiguous copies "
           "(no overflow possible). Device time: CUDA events, best of two interleaved rounds of medians. "
           "*Extra peak*: `max_memory_allocated` above the inputs during one call.", "",
           f"Measured by {_env_line(d['env'])}.", "",
           "| S | plan | guarded ms | same plan, repack in the other layout ms | in-limit kernel ms | SDPA ms "
           "| guarded / in-limit | guarded / SDPA "
           "| sage TFLOP/s | SDPA TFLOP/s | extra peak guarded | extra peak in-limit | extra peak SDPA |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        plan = r["plan"].split(", 1 launch")[0].split(", repack")[0]
        alt = r.get("other_layout_repack_ms")
        out.append(f"| {r['S']:,} | {plan} | {r['guarded_ms']:.1f} | {'' if alt is None else f'{alt:.1f}'} "
                   f"| {r['inlimit_kernel_ms']:.1f} | {r['sdpa_ms']:.1f} "
                   f"| {r['guarded_over_inlimit']:.4f} | {r['guarded_over_sdpa']:.3f} "
                   f"| {r['tflops']['sage1_triton']:.0f} | {r['tflops']['sdpa']:.0f} "
                   f"| {r['extra_peak_bytes_guarded'] / GiB:.2f} GiB | {r['extra_peak_bytes_inlimit_kernel'] / GiB:.2f} GiB "
                   f"| {r['extra_peak_bytes_sdpa'] / GiB:.2f} GiB |")
    out += ["", "At 38,000 tokens the plan is `direct`: the guarded call *is* the raw kernel on the strided "
            "views, so the ratio there is the kernel's own strided-vs-contiguous difference plus noise, "
            "not guard overhead. Past 99,865 tokens the plan repacks q and k into contiguous NHD (their "
            "memory order; the HND copy timed the same); that copy (2 x 1.4-2.3 GiB) is the extra peak.", ""]
    return out


def host_section(d) -> list[str]:
    h = d["host_overhead"]
    return ["## Host time per call", "",
            f"Measured by {_env_line(d['env'])}; S = {h['S']} (small, so the host is the bottleneck), "
            f"{h['calls']} calls, best of 3.", "",
            "| guarded call | raw sageattn | SDPA | guard's own work (override around a null kernel, minus the null kernel) |",
            "|---|---|---|---|",
            f"| {h['guarded_host_us']:.1f} us | {h['raw_sage_host_us']:.1f} us | {h['sdpa_host_us']:.1f} us "
            f"| {h['guard_overhead_us']:.1f} us |", ""]


def probe_section(d) -> list[str]:
    out = ["## First-call verification (probe)", "",
           f"Measured by {_env_line(d['env'])}. The probe compares 256 query rows of heads 0 and 55 against "
           "all keys with fp32 attention. *Broken kernel*: the real kernel with rows past 60% of the "
           "sequence corrupted.", "",
           "| S | real sage verdict (rel. L2) | probe alone | probe / call | broken kernel caught | output returned vs SDPA |",
           "|---|---|---|---|---|---|"]
    for r in d["sizes"]:
        v = next(iter(r["real_verdicts"].values()))
        out.append(f"| {r['S']:,} | {'pass' if v[0] else 'FAIL'} ({v[1]:.4f}) "
                   f"| {r['probe_only_s'] * 1e3:.1f} ms | {r['probe_only_pct']:.2f} % "
                   f"| {'yes' if r['broken_caught'] else 'NO'} | {r['broken_output_rel_err_vs_sdpa']:.4f} |")
    out.append("")
    return out


def stress_section(d) -> list[str]:
    fam = d["env"].get("family")
    title = ("Stress: guarded vs unguarded sageattention" if d.get("unguarded") else
             "Stress re-run after the NHD repack change (guarded only)")
    if d["env"].get("sageattention", "").startswith("2.") and fam:
        title = f"Stress, sageattention {d['env']['sageattention']} family `{fam}`: guarded vs unguarded"
    out = [f"## {title}", "",
           f"Measured by {_env_line(d['env'])}. Guarded: SafeSage on the current stream = default and = a "
           "side stream (same results on both, so one column). Unguarded: "
           + ("the family's own function called directly" if fam else "raw `sageattn`")
           + " on the same inputs, each in its own process (a fault poisons the CUDA context).", "",
           "| S | inputs | SafeSage plan | SafeSage rel. L2 vs SDPA | kernel's in-limit error | unguarded outcome |",
           "|---|---|---|---|---|---|"]
    ung = {(r["S"], r["layout"]): r for r in d.get("unguarded", [])}
    seen = set()
    for r in d["guarded"]:
        key = (r["S"], r["layout"])
        if key in seen:
            continue
        seen.add(key)
        u = ung.get(key, {})
        if u.get("outcome") == "fault":
            tail = (u.get("stderr_tail") or [""])[-1]
            uo = "fault: " + tail.split(":")[-1].strip()
        elif u:
            uo = f"{u['outcome']} (worst head rel. L2 {u['worst_head_rel_err']:.3f})"
            if u.get("tail_worst_row_rel_err") is not None:
                uo += f", worst of the last 256 rows {u['tail_worst_row_rel_err']:.3f}"
        else:
            uo = "not run"
        inl = f"{r['inlimit_rel_err']:.4f}" if r["inlimit_rel_err"] is not None else "none exists"
        out.append(f"| {r['S']:,} | {r['layout']} | {r['plan'].split(';')[0].split(' on ')[0]} "
                   f"| {r['guarded_rel_err']:.4f} (worst head {r['guarded_worst_head']:.4f}) | {inl} | {uo} |")
    if not d.get("unguarded"):
        out += ["", "(Re-run after the planner started repacking into NHD; unguarded arms not repeated.)", ""]
        return out
    if fam == "sage2_fp8pv_perwarp" and any(r["S"] >= 199_730 for r in d["unguarded"]):
        out += ["", "At 199,730 only the last query row's u32 offset wraps, which whole-head L2 cannot show; "
                "`tests/gpu/test_gpu_guard.py::test_unguarded_call_faults_or_is_wrong_in_a_subprocess` runs "
                "1,024 rows past the limit and requires a fault or a wrong row (passed on the H200; which of the two was not recorded, "
                "bench/results/logs/gputests_sage22_perwarp_h200_run2.log)."]
    if fam:
        out += [""]
        return out
    out += ["", "`compute-sanitizer --tool memcheck python3 -m bench.kernels.sanitizer_call --S 99866` on the same "
            "machine: 0 errors (bench/results/sanitizer_memcheck_h200.log; HND repack at the time).", ""]
    return out


def mlp_section(d) -> list[str]:
    out = ["## Chunked H3 MLP (one block: hidden 5376, ffn 14336, fp8 e4m3 weights, bf16 activations)", "",
           f"Measured by `{d['command']}` on {d['gpu']}, torch {d['torch']}. *dequant*: weights dequantised to "
           "bf16 once per call (ComfyUI's fallback path); *scaled_mm*: fp8 input x fp8 weight via "
           "`torch._scaled_mm` (ComfyUI's native fp8 path). *Working*: peak above input + weights. This "
           "bench imitates ComfyUI's layers with plain torch, and `auto` was 6,912 tokens then; the real "
           "path through ComfyUI's own ops is in the sections \"H3 MLP through ComfyUI's own ops\" below.", "",
           "| mode | S | variant | peak | working | time ms | time ratio | working reduction | equal |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in d["runs"]:
        if "error" in r:
            out.append(f"| {r.get('mode')} | {r.get('S')} | {r.get('variant')} | error: {r['error']} |||||| ")
            continue
        ratio = r.get("time_ratio_vs_unpatched")
        wred = r.get("working_reduction")
        eq = r.get("equal_bitwise")
        out.append(f"| {r['mode']} | {r['S']:,} | {r['variant']} | {r['peak_bytes'] / GiB:.2f} GiB "
                   f"| {r['working_bytes'] / GiB:.2f} GiB | {r['time_ms_median']:.1f} "
                   f"| {'' if ratio is None else f'{ratio:.3f}'} | {'' if wred is None else f'{100 * wred:.0f} %'} "
                   f"| {'' if eq is None else ('bitwise' if eq else r.get('equal_max_abs_diff'))} |")
    out.append("")
    return out


def sage2_probe_section(d) -> list[str]:
    out = [f"## First-call probe on sageattention {d['env'].get('sageattention')} family "
           f"`{d['env'].get('family')}`", "", f"Measured by {_env_line(d['env'])}.", "",
           "| S | verdict on the real kernel (rel. L2 on the probed slice) | deliberately broken kernel caught |",
           "|---|---|---|"]
    for r in d["sizes"]:
        v = "; ".join(f"{'pass' if ok else 'FAIL'} ({err:g})" for ok, err in r["real_verdicts"].values())
        out.append(f"| {r['S']:,} | {v} | {'yes' if r['broken_caught'] else 'no'} |")
    return out + [""]


def kvchunks_section(d) -> list[str]:
    sec = d["sections"]
    out = ["## kv_chunks: key/value-chunked sage launches merged by log-sum-exp", "",
           f"Measured by {_env_line(d['env'])}. The real sage 2.2 kernel with sm_120's 150,000-key rule added "
           "(what makes SafeSage chunk keys on an RTX 5090), H3 strided views, through `SafeAttention`; "
           "rel. L2 vs SDPA on the first and last 1,024 query rows of every head. *In-limit*: the same kernel "
           "on pre-made contiguous copies, unchunked. Goal of issue 11: time <= 1.02x in-limit (missed: sage's "
           "`return_lse=True` kernel variant alone costs +4.8%, see the next section).", "",
           "| S | plan | rel. L2 kv_chunks | rel. L2 unchunked | kv_chunks / in-limit time | extra peak kv_chunks / unchunked (GiB) |",
           "|---|---|---|---|---|---|"]
    for r in sec.get("kvchunks", {}).get("rows", []):
        if "error" in r:
            out.append(f"| {r.get('S', '?')} | error: {r['error'][:80]} | | | | |")
            continue
        out.append(f"| {r['S']:,} | {r['plan_kv'].split(';')[0]} | {r['rel_l2_kv']:.4f} | {r['rel_l2_ref']:.4f} "
                   f"| {r['kv_over_inlimit']:.3f} | {r['peak_extra_kv'] / GiB:.1f} / {r['peak_extra_ref'] / GiB:.1f} |")
    g = [r for r in sec.get("guard", {}).get("rows", []) if "guarded_over_inlimit" in r]
    if g:
        out += ["", "Guarded / in-limit time at 99,866 tokens (issue 11 goal <= 1.005): "
                + "; ".join(f"`{r['family']}` {r['guarded_over_inlimit']:.4f} ({r['plan'].split(';')[0]})" for r in g)]
    return out + [""]


def anatomy_section(d) -> list[str]:
    a = d["sections"]["anatomy"]
    names = {"whole": "kernel, all keys", "whole_lse": "kernel, all keys, `return_lse=True`",
             "split": "kernel, keys in the plan's chunks", "split_lse": "same, `return_lse=True`",
             "split_lse_merge": "same + the pack's LSE merge", "uneven_lse": "2 chunks of 149,888 + rest, `return_lse=True`",
             "pack_kv": "SafeAttention kv_chunks plan (the real path)", "pack_ref": "SafeAttention unchunked plan"}
    out = ["## Where kv_chunks' time goes", "",
           f"Measured by {_env_line(d['env'])}. `{a['family']}` at {a['S']:,} tokens, raw kernel on contiguous NHD "
           f"copies unless noted; plan: {a['plan_kv'].split(';')[0]}. The {len(a['ms'])} variants interleaved, median "
           "of `--anatomy-reps` rounds (in the command).", "",
           "| variant | ms | / kernel, all keys |", "|---|---|---|"]
    for k, v in a["ms"].items():
        out.append(f"| {names.get(k, k)} | {v:.1f} | {a['over_whole'][k]:.3f} |")
    prof = {r["name"][:40]: r for r in a.get("profile_pack_kv", [])}
    att = next((r for n, r in prof.items() if "attn_kernel" in n), None)
    whole = next((r for r in a.get("profile_whole", []) if "attn_kernel" in r["name"]), None)
    out += ["", f"The LSE merge alone on pre-made outputs: {a['merge_only_ms']:.1f} ms."]
    if att and whole:
        out.append(f"Profiler (CUDA time of sage's attention kernel): {whole['ms']:.0f} ms in 1 launch over all keys "
                   f"without LSE, {att['ms']:.0f} ms in {att['count']} launches with `return_lse=True` in the pack's "
                   "call: the LSE-returning kernel variant is the cost, not the split or the merge.")
    return out + [""]


def families_section(d) -> list[str]:
    f = d["sections"]["families"]
    out = [f"## Kernel families at H3 shapes ({', '.join(sorted({k for r in f['rows'] for k in r['families']}))})", "",
           f"Measured by {_env_line(d['env'])}, comfy-kitchen {d['env'].get('comfy-kitchen')}. Guarded: through "
           "`SafeAttention` on H3's strided views (the plan the planner picks for that family alone); in-limit: the "
           "raw kernel on pre-made contiguous NHD copies (in the fewest head groups whose launches are inside the "
           "family's envelope, where a whole copy is not: the column after the ratio). TFLOP/s from the in-limit time.", "",
           "| S | family | plan | rel. L2 vs SDPA | guarded / in-limit | in-limit head groups | TFLOP/s | SDPA TFLOP/s |",
           "|---|---|---|---|---|---|---|---|"]
    for r in f["rows"]:
        for fam, x in r["families"].items():
            if "error" in x:
                out.append(f"| {r['S']:,} | {fam} | error: {x['error'][:70]} | | | | | {r['tflops']['sdpa']:.0f} |")
                continue
            out.append(f"| {r['S']:,} | {fam} | {x['plan'].split(';')[0].split(',')[0]} | {x['rel_l2_vs_sdpa']:.4f} "
                       f"| {x['guarded_over_inlimit']:.4f} | {x.get('inlimit_head_groups', 1)} | {x['tflops_inlimit']:.0f} "
                       f"| {r['tflops']['sdpa']:.0f} |")
    out += ["", f"Into `kernel_table.json`: {f['kernel_table_tflops']}; excluded (wrong or failing): "
            f"{f['excluded_from_table'] or 'none'}." + (f" {d['note']}" if d.get("note") else "")]
    return out + [""]


def ck_probe_call(side: str, layout: str, S: int):
    """The AttnCall of one ``gpu_kvchunks.py ck_probe`` attempt (256 rows on the short side)."""
    from safe_ops.families.envelope import AttnCall, TensorDesc
    from safe_ops.models.h3.dims import H3_HEAD_DIM as D, H3_HEADS as H, h3_attention_call
    long_ = (h3_attention_call(S).q if layout == "strided"                 # H3's fused-qkv views
             else TensorDesc.contiguous((1, H, S, D), layout.upper()))      # "hnd" / "nhd"
    short = TensorDesc.contiguous((1, H, 256, D), "HND")
    q, kv = (short, long_) if side == "kv" else (long_, short)
    return AttnCall(q, kv, kv, "bfloat16", "HND", False, "cuda", "sm_90", 2)


def ck_predicted_first_refusing(version: str, side: str, layout: str, hi: int) -> int | None:
    """The first S <= hi that SafeSage's envelope for comfy-kitchen ``version`` says refuses."""
    from safe_ops.families.envelope import FAMILIES, check
    from safe_ops.families.ck_int8 import ck_family_for
    from safe_ops.families import registry  # noqa: F401  (registers every family)
    env = FAMILIES[ck_family_for(version)]
    bad = lambda n: bool(check(ck_probe_call(side, layout, n), env))  # noqa: E731
    if not bad(hi):
        return None
    lo = 1024
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if bad(mid) else (mid, hi)
    return hi


def ck_probe_section(d) -> list[str]:
    p = d["sections"]["ck_probe"]
    ver = d["env"].get("comfy-kitchen")
    out = [f"## comfy-kitchen {ver} `int8_attention`: where it refuses", "",
           f"Measured by {_env_line(d['env'])}. Key side: 256 queries x S keys; query side: S queries x 256 keys. "
           "*Envelope*: the first S SafeSage's envelope for this version marks as refused "
           "(`bench/common/tables.py ck_predicted_first_refusing`, computed when this page is generated).", "",
           "| side | layout of the long tensor | first refusing S | envelope | rel. L2 at 299,520 / 299,521 / max |",
           "|---|---|---|---|---|"]
    for r in p["probes"]:
        at = r.get("rel_l2_at", {})
        fmt = lambda x: f"{x:.4f}" if isinstance(x, float) else "–" if x is None else str(x)[:40]  # noqa: E731
        hi = r.get("first_failing") or r.get("passes_up_to", 0)
        pred = ck_predicted_first_refusing(ver, r["side"], r["layout"], hi)
        out.append(f"| {r['side']} | {r['layout']} | {format(hi, ',') if r.get('first_failing') else 'none up to ' + format(hi, ',')} "
                   f"| {format(pred, ',') if pred else 'none up to ' + format(hi, ',')} "
                   f"| {fmt(at.get('299520'))} / {fmt(at.get('299521'))} / {fmt(r.get('rel_l2_at_max'))} |")
    return out + [""]


def kernel_table(d) -> dict:
    rows = d["rows"]
    tf = {k: round(statistics.median(r["tflops"][k] for r in rows), 1) for k in ("sage1_triton", "sdpa")}
    return {"about": ("Measured attention throughput per GPU arch and kernel family (TFLOP/s, non-causal, "
                      "56 heads x 128, bf16, MiniMax H3 shapes; median over the sizes measured). 'auto' orders "
                      "kernels by this table; an arch not listed follows the kernel ComfyUI itself was "
                      "configured with. Regenerate: python -m bench.kernels.gpu_attention bench --out "
                      "bench/results/attention_h200.json && python -m bench.common.tables --update-table"),
            "archs": {"sm_90": {"gpu": d["env"]["gpu"], "tflops": tf,
                                "sizes": [r["S"] for r in rows],
                                "source": "bench/results/attention_h200.json: " + d["env"]["command"]}}}


SECTIONS = (("stress_h200.json", stress_section), ("stress_nhd_repack_h200.json", stress_section),
            ("attention_h200.json", attention_section),
            ("host_overhead_h200.json", host_section), ("probe_h200.json", probe_section),
            ("mlp_h200.json", mlp_section),
            ("stress_sage22_perwarp_h200.json", stress_section),
            ("stress_sage22_perwarp_b2_fp16_h200.json", stress_section),
            ("stress_sage22_sm89_h200.json", stress_section),
            ("stress_sage22_sm90_h200.json", stress_section),
            ("probe_sage22_sm90_h200.json", sage2_probe_section),
            ("stress_sage22_sm80_h200.json", stress_section),
            ("kvchunks_h200.json", kvchunks_section),
            ("kv_anatomy_h200.json", anatomy_section),
            ("kvchunks_families_h200.json", families_section),
            ("ck240_families_h200.json", families_section),
            ("ck239_families_h200.json", families_section),
            ("families_230k_h200.json", families_section),
            ("ck240_probe_h200.json", ck_probe_section),
            ("ck239_probe_h200.json", ck_probe_section),
            ("ck235_probe_h200.json", ck_probe_section),
            ("stress_sage22_sm86_h200.json", stress_section),
            ("mlp_comfy_h200.json", mlp_comfy_section),
            ("mlp_comfy_h200_run1.json", mlp_comfy_section),
            ("mlp_comfy_castonce_h200.json", mlp_comfy_section),
            ("mlp_comfy_castonce_balanced_h200.json", mlp_comfy_section),
            ("compiler_h200.json", compiler_section),
            ("compiler_shrinking_free_h200.json", compiler_section),
            ("compiler_shrinking_free_blind_h200.json", compiler_section),
            ("soak_38k_safesage_h200.json", soak_section), ("soak_38k_sage_h200.json", soak_section),
            ("soak_169k_safesage_h200.json", soak_section), ("soak_169k_sage_h200.json", soak_section))
TABLE_PATH = os.path.join(ROOT, "safe_ops", "facts", "kernel_table.json")
DOC_PATH = os.path.join(ROOT, "docs", "BENCHMARKS.md")


def merge_into_table(arch: str, gpu: str, tflops: dict, sizes, source: str, about: str | None = None,
                     table_path: str = TABLE_PATH) -> dict:
    """Merge measured TFLOP/s of some families into safe_ops/facts/kernel_table.json under ``arch``: those
    families' numbers are replaced, the others kept; sizes are united and ``source`` (the result
    file and its command) is appended once. Returns the arch's entry."""
    with open(table_path) as f:
        cur = json.load(f)
    entry = cur.setdefault("archs", {}).setdefault(arch, {})
    entry["gpu"] = gpu
    entry["tflops"] = dict(sorted({**entry.get("tflops", {}), **tflops}.items()))
    entry["sizes"] = sorted(set(entry.get("sizes", [])) | set(sizes))
    sources = [x for x in str(entry.get("source", "")).split(" | ") if x]
    entry["source"] = " | ".join(sources + ([source] if source not in sources else []))
    if about is not None:
        cur["about"] = about
    with open(table_path, "w") as f:
        json.dump(cur, f, indent=2)
        f.write("\n")
    return entry


def merge_attention_into_table() -> None:
    """Merge attention_h200.json's numbers into safe_ops/facts/kernel_table.json (other rows stay)."""
    att = _load("attention_h200.json")
    if att is None:
        return
    t = kernel_table(att)
    for arch, e in t["archs"].items():
        merge_into_table(arch, e["gpu"], e["tflops"], e["sizes"], e["source"], t["about"])


def render() -> str:
    """docs/BENCHMARKS.md's text from bench/results/*.json and safe_ops/facts/kernel_table.json."""
    lines = ["# Benchmarks", "",
             "Generated by `python -m bench.common.tables` from the JSON files in `bench/results/` (each records the "
             "command that produced it). GPU numbers are from one NVIDIA H200 (sm_90); CI has no GPU.", ""]
    for name, fn in SECTIONS:
        d = _load(name)
        if d is not None:
            lines += fn(d)
    with open(TABLE_PATH) as f:
        table = json.load(f)
    lines += ["## The table `kernel=auto` reads (`safe_ops/facts/kernel_table.json`)", ""]
    for arch, e in table.get("archs", {}).items():
        fams = list(e["tflops"])
        lines += ["| arch | GPU | " + " | ".join(fams) + " |", "|---|---|" + "---|" * len(fams),
                  f"| {arch} | {e['gpu']} | " + " | ".join(f"{e['tflops'][k]:.0f}" for k in fams) + " |", "",
                  f"TFLOP/s, each family the median over the sizes its source measured (all together: {', '.join(f'{x:,}' for x in e['sizes'])} tokens). Sources: {e['source']}", ""]
    lines += ["So on an H200 `auto` prefers PyTorch SDPA over every kernel family measured there; the guard "
              "still protects `kernel=sage`. An entry's speed holds for the GPU model it names only "
              "(`kernel_table.measured_on`): another GPU of its arch, an H100 for sm_90, follows what ComfyUI was "
              "started with.", "",
              "The `sdpa` column is **torch's default backend order** (`torch.nn.functional.scaled_dot_product_attention` "
              "called directly), not ComfyUI's own `attention_pytorch`; the H200 row stays so until an H200 is lent to "
              "time it with `python3 -m bench.kernels.gpu_attention bench --comfy $COMFY`. On an H100 ComfyUI's own function "
              "ran at 347-374 TFLOP/s, sage 1.0.6 at 456-463 (`bench/results/attention_comfy_sdpa_h100.json`, "
              "`bench/results/attention_comfy_sdpa_h100_run2.json`; docs/MEASURED.md).", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--update-table", action="store_true")
    a = ap.parse_args()
    if a.update_table:
        merge_attention_into_table()
    with open(DOC_PATH, "w") as f:
        f.write(render())
    print("wrote docs/BENCHMARKS.md")


if __name__ == "__main__":
    main()
