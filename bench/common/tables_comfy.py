"""The sections of docs/BENCHMARKS.md that measure ComfyUI's own code run whole (bench/common/tables.py
renders them with the kernel benches' sections): the H3 MLP through ComfyUI's layers
(gpu_mlp_comfy.py), H3 blocks under ComfyUI's allocation compiler (compiler_probe.py) and the soak of
many prompts in one ComfyUI server (python -m bench.repro soak)."""
from __future__ import annotations

import statistics

GiB = 2**30


def mlp_comfy_section(d) -> list[str]:
    cast_once = any("casts_per_call" in r for r in d["runs"])
    how = ("ComfyUI's own `MLP.forward` per token chunk, each Linear's cast memoised for the call "
           "(`safe_ops.models.h3.cast_memo`; *casts*: ComfyUI's real casts in one call)" if cast_once
           else "the pack's earlier mirror of ComfyUI's layers (replaced; kept for the record)")
    out = [f"## H3 MLP through ComfyUI's own ops ({d['bench']}): {how.split(' (')[0]}", "",
           f"Measured by `{d['command']}` on {d['gpu']}, torch {d['torch']}, comfy-kitchen {d['comfy_kitchen']}; "
           "ComfyUI 0dd9b154's `MLP` with fp8 (`mixed_precision_ops`, `_scaled_mm`), bf16 or int8 weights"
           + (", or bf16 weights left in host memory (`lowvram_bf16`: every call casts them to the GPU; "
              "*per_chunk*: ComfyUI's forward per chunk without the memo)" if any(r["mode"].startswith("lowvram")
                                                                                  for r in d["runs"]) else "")
           + f", unpatched forward vs `safe_ops.models.h3.mlp.h3_mlp_forward`: {how}. *Queued*: timed behind ~30 ms of GPU "
           "work, so the host-side setup overlaps as inside a model; *idle*: from an idle GPU."
           + (f" {d['note']}" if d.get("note") else ""), "",
           "| mode | S | variant | chunk | ms idle | ratio idle | ms queued | ratio queued | extra peak | vs unpatched "
           "| equal |" + (" casts |" if cast_once else ""),
           "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if cast_once else "")]
    base = {(r["mode"], r["S"]): r["peak_extra_bytes"] for r in d["runs"] if r["variant"] == "unpatched"}
    for r in d["runs"]:
        rel = r["peak_extra_bytes"] / base[(r["mode"], r["S"])] - 1 if base.get((r["mode"], r["S"])) else 0.0
        out.append(f"| {r['mode']} | {r['S']:,} | {r['variant']} | {r.get('chunk_tokens', '')} | {r['time_ms']:.1f} "
                   f"| {r['ratio_vs_unpatched']:.3f} | {r['time_ms_queued']:.1f} | {r['ratio_vs_unpatched_queued']:.3f} "
                   f"| {r['peak_extra_bytes'] / GiB:.2f} GiB | {rel * 100:+.1f} % "
                   f"| {'bitwise' if r['bitwise_equal'] else r['max_abs_diff']} |"
                   + (f" {r.get('casts_per_call', '')} |" if cast_once else ""))
    return out + [""]


def compiler_section(d) -> list[str]:
    """bench/length/compiler_probe.py: H3 blocks under comfy-aimdo's malloc graph, one row per arm."""
    first = next(iter(d["arms"].values()))["result"] or {}
    extra = ", ".join(x for x in (f"free memory SafeSage reads per step: {d['command'].split('--free-gib ')[1].split()[0]} GiB"
                                  if "--free-gib" in d["command"] else "",
                                  "SafeSage not told the compiler is on (a control)" if "--blind" in d["command"] else "")
                      if x)
    out = [f"## H3 blocks under ComfyUI's allocation compiler ({d['tokens']:,} tokens, {d['blocks']} blocks, "
           f"{d['steps']} steps" + (f"; {extra}" if extra else "") + ")", "",
           f"Measured by `{d['command']}` on {first.get('gpu')}, torch {first.get('torch')}, comfy-aimdo "
           f"{first.get('comfy_aimdo')}, sageattention {first.get('sageattention')} (emulated {d['emulate_arch']} "
           "dispatch), allocator " + str(first.get("allocator")) + ". *Breaks* per step (step 0 records, later steps "
           "replay), *rogues* over the run, *graph peak*: the malloc graph's `peak_used`; *vs no compiler*: the "
           "output against the same forward without the compiler in the same process.", "",
           "| arm | breaks per step | rogues | graph peak | ms per replayed step | ms without compiler "
           "| vs no compiler | SafeSage's attention plan (first) | MLP chunks per call |",
           "|---|---|---|---|---|---|---|---|---|"]
    for arm, a in d["arms"].items():
        r = a["result"]
        if not r:
            out.append(f"| {arm} | rc {a['rc']} | | | | | | | |")
            continue
        steps = a["steps"]
        ms = statistics.median(x["ms"] for x in steps[1:]) if len(steps) > 1 else steps[0]["ms"]
        plan = next(iter((r.get("safesage") or {}).get("plans", {}).values()), "")
        plan = plan.split(";")[0] if plan else "(no SafeSage)"
        m = (r.get("safesage") or {}).get("mlp") or {}
        chunks = f"{m['chunks'] / m['chunked_calls']:.1f}" if m.get("chunked_calls") else "–"
        out.append(f"| {arm} | {' / '.join(str(x['breaks']) for x in steps)} | {r['rogues']} "
                   f"| {r['peak_used'] / GiB:.2f} GiB | {ms:,.0f} | {r['eager_ms']:,.0f} "
                   f"| {'bitwise' if r['out_bitwise_equal_no_compiler'] else format(r['out_vs_no_compiler_rel_l2'], '.2e')} "
                   f"| {plan} | {chunks} |")
    return out + [""]


def soak_section(d) -> list[str]:
    """bench/repro soak: one ComfyUI server, many prompts, an interrupted one, unload and reload."""
    v = d["verdict"]
    out = [f"## Soak: {d['prompts']} prompts in one ComfyUI server, {d['arm_label']} ({d['size']}, "
           f"{d['steps']} step(s) each)", "",
           f"Measured by `{d['command']}` (ComfyUI 0dd9b154's own server; sageattention 2.2.0 dispatching as "
           f"{d['emulate_arch']}). GPU memory as the server's torch sees it after each event "
           "(`/safesage_repro/memory`; with dynamic VRAM the weights live outside torch's allocator). "
           f"Memory back to the first prompt's level after every prompt: **{v['memory_back_after_each_prompt']}** "
           f"(largest deviation {v['max_abs_deviation_bytes']:,} bytes).", "",
           "| after | status | allocated (bytes) | reserved (MiB) | SafeSage attention calls | SafeSage fallbacks |",
           "|---|---|---|---|---|---|"]
    for x in d["samples"]:
        ss = x.get("safesage") or {}
        status = x.get("status") or ""
        if x.get("interrupted"):
            status += " (interrupted)"
        out.append(f"| {x['what']} | {status} | {x.get('allocated', 0):,} | {x.get('reserved', 0) / 2**20:,.0f} "
                   f"| {ss.get('attention_calls', '–')} | {ss.get('fallbacks', '–')} |")
    return out + [""]
