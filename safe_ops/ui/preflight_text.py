"""Preflight in words: the SafeSage Preflight node's report, from ``preflight``'s verdicts.

Every number here is computed in ``preflight`` (and ``h3``); this module only words it: one
block of lines per scenario, comfy-kitchen's lines, and plain-language warnings.
"""
from __future__ import annotations

from ..families.envelope import FAMILIES
from ..models.h3.dims import H3_HEAD_DIM, H3_HEADS, H3_LAYERS, H3_TEXT_TOKENS, h3_frame_count, v_layout_here
from .preflight import Assessment, CkVerdict, Verdict, arch_name, assess

GiB = 2 ** 30


def _fmt_gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def _family_text(fam: str | None, ver: str | None) -> str:
    if fam is None:
        return "no SageAttention kernel" + (f" (sageattention {ver} has none for this GPU)" if ver else "")
    return f"SageAttention {ver} -> {fam}" if ver else fam


def verdict_lines(v: Verdict) -> tuple[list[str], list[str]]:
    """(report lines, plain-language warnings) for one scenario."""
    sc, S = v.scenario, v.S
    fam = sc.family if sc.family in FAMILIES else None
    lines = [f"[{sc.label}" + (f" -> {fam}]" if fam else "]")]
    warnings = []
    if sc.note:
        lines.append(f"  {sc.note}")
    if fam is None:
        lines.append(f"  {_family_text(None, sc.sage_version)}: PyTorch SDPA (int64 indexing, no token limit)")
    elif v.violations:
        first = v.violations[0]
        lines.append(f"  limits: H3's call crosses {len(v.violations)} at {S:,} tokens"
                     + (f" (as called, safe up to {v.safe_up_to:,})" if v.safe_up_to else "")
                     + f", e.g. {first}")
        if v.sage_plan is None or v.sage_plan != v.plan:
            lines.append(f"  {fam} itself: " + (v.sage_plan.describe(reasons=False) if v.sage_plan else
                                                 "no plan inside its limits, so PyTorch SDPA"))
        need = (v.sage_plan.kind.replace("_", " ") if v.sage_plan else "PyTorch SDPA instead")
        warnings.append(f"{S:,} tokens: {_family_text(fam, sc.sage_version)} on {arch_name(sc.arch)} "
                        f"would cross its limits ({first.rule}"
                        + (f", safe up to {v.safe_up_to:,}" if v.safe_up_to else "")
                        + f") and would need {need}; plan: {v.plan.describe(reasons=False)}")
    else:
        lines.append(f"  limits: none crossed at {S:,} tokens"
                     + (f" (safe up to {v.safe_up_to:,})" if v.safe_up_to else ""))
    if v.choice:
        lines.append(f"  kernel choice: {v.choice}")
    lines.append(f"  each attention call ({H3_LAYERS} blocks) runs: {v.plan.describe(reasons=False)}")
    mlp = (f"MLP {v.mlp_chunk:,} tokens per chunk, {_fmt_gib(v.mlp_bytes)} (unchunked up to "
           f"{_fmt_gib(v.mlp_unchunked_bytes)})" if v.mlp_chunk < S else
           f"MLP unchunked, up to {_fmt_gib(v.mlp_unchunked_bytes)}")
    peak = v.peak_bytes
    lines.append(f"  transients: attention {_fmt_gib(v.attn_bytes)}, {mlp}; predicted peak {_fmt_gib(peak)} "
                 "(one after the other in each block, above weights and activations)")
    if sc.free_bytes is not None and peak > sc.free_bytes:
        warnings.append(f"{arch_name(sc.arch)}: the predicted transients ({_fmt_gib(peak)}) exceed the "
                        f"{_fmt_gib(sc.free_bytes)} free now; lower the size, or set mlp_chunking to "
                        "'tokens' with fewer mlp_chunk_tokens")
    return lines, warnings


def ck_lines(S: int, cks: list[CkVerdict], rt) -> tuple[list[str], list[str]]:
    """(report lines, warnings) for comfy-kitchen's int8_attention at ``S`` tokens
    (``preflight.ck_verdicts``; none on a GPU where it is not usable, and ``rt.ck_error`` says why)."""
    if not cks:
        return [f"[comfy-kitchen int8_attention] not usable here: {rt.ck_error or 'not installed'}"], []
    lines, warnings = [], []
    for c in cks:
        safe = c.safe_up_to
        head = f"[comfy-kitchen {c.version} int8_attention -> {c.family}]"
        if not c.violations:
            lines.append(f"{head} limits: none crossed at {S:,} tokens"
                         + (f" (safe up to {safe:,})" if safe else " (no limit up to 2,000,000)"))
            continue
        run = c.plan.describe(reasons=False) if c.plan else "no plan inside its limits, so PyTorch SDPA"
        lines.append(f"{head} limits: H3's call crosses {len(c.violations)} at {S:,} tokens"
                     + (f" (safe up to {safe:,})" if safe else "") + f"; SafeSage runs it as: {run}")
        warnings.append(f"{S:,} tokens: comfy-kitchen {c.version} int8_attention on {c.where} would cross its "
                        "limits" + (f" (safe up to {safe:,})" if safe else "") + f"; plan: {run}")
    return lines, warnings


def call_line(S: int) -> str:
    """The report's line on H3's attention call at ``S`` tokens: its shape, its strides, V's layout here."""
    layout, where = v_layout_here()
    v = ("V a view too" if layout == "strided"
         else f"V its own token-major copy (token stride {H3_HEADS * H3_HEAD_DIM:,})")
    return (f"attention call: [1, {H3_HEADS}, {S:,}, {H3_HEAD_DIM}], q and k views into the qkv buffer "
            f"(token stride {3 * H3_HEADS * H3_HEAD_DIM:,}), {v} ({where})")


def report_lines(a: Assessment, model_note: str = "") -> tuple[list[str], list[str]]:
    """(report lines, warnings) of one assessment; the warnings are also the report's last lines."""
    t, S, policy, rt = a.tokens, a.S, a.policy, a.rt
    lines = [f"SafeSage preflight: MiniMax H3, {a.width}x{a.height}, {a.length} frames "
             f"(-> {h3_frame_count(a.length)} on H3's 17k+5 grid), {a.ref_images} reference image(s)",
             f"packed tokens: {S:,} = video {t.video:,} + audio {t.audio:,} + references {t.refs:,} "
             f"+ text {t.text:,} (text varies with the prompt); counted with {t.source}",
             call_line(S),
             f"runtime: {rt.summary()}",
             f"kernel policy: {policy.kernel}; mlp_chunking: {policy.mlp_chunking}"
             + (f" ({policy.mlp_chunk_tokens:,} tokens)" if policy.mlp_chunking == "tokens" else "")]
    if model_note:
        lines.append(model_note)
    if rt.arch is None:
        lines.append("no CUDA device here: what SafeSage would do on common GPUs, with ComfyUI started "
                     "with --use-sage-attention")
    warnings: list[str] = []
    for v in a.verdicts:
        ls, ws = verdict_lines(v)
        lines += ls
        warnings += ws
    ls, ws = ck_lines(S, a.ck, rt)
    lines += ls
    warnings += ws
    for w in warnings:
        lines.append("WARNING: " + w)
    return lines, warnings


def preflight_report(width: int, height: int, length: int, ref_images: int = 0,
                     text_tokens: int = H3_TEXT_TOKENS, policy=None, rt=None,
                     free_bytes: int | None = None, comfy_wants_sage: bool | None = None,
                     model_note: str = "") -> dict:
    """The SafeSage Preflight node's report: ``{"text", "tokens", "warnings", "verdicts"}``
    (arguments as ``preflight.assess``; ``model_note``: a line on the connected model)."""
    a = assess(width, height, length, ref_images, text_tokens, policy, rt, free_bytes, comfy_wants_sage)
    lines, warnings = report_lines(a, model_note)
    lines += quality_lines(policy, a.rt, comfy_wants_sage)
    lines += measured_length_lines()
    return {"text": "\n".join(lines), "tokens": a.tokens, "warnings": warnings, "verdicts": a.verdicts}


#: the arms of facts/measured_lengths.json as the Preflight text names them
MEASURED_ARMS = (("safesage", "SafeSage (node defaults)"), ("sage", "unguarded --use-sage-attention"),
                 ("pytorch", "ComfyUI's own attention"))


def measured_length_lines() -> list[str]:
    """The measured longest lengths (facts/measured_lengths.json, issue #40), one line per free-memory
    budget: what Preflight's own prediction -- SafeSage's temporaries only, not ComfyUI's weights and
    activations -- cannot say."""
    import json
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "facts", "measured_lengths.json")
    with open(path) as f:
        m = json.load(f)
    lines = []
    for gib, arms in sorted(m["budgets"].items(), key=lambda kv: float(kv[0])):
        got = ", ".join(f"{label} {arms[k]['max_frames']} frames ({arms[k]['max_tokens']:,} tokens)"
                        for k, label in MEASURED_ARMS if k in arms)
        lines.append(f"measured longest at {gib} GiB free ({m['gpu']}, {m['width']}x{m['height']}, "
                     f"{m['blocks']}-block H3, {m['steps']} step; {m['source']}): {got}")
    return lines


def quality_lines(policy, rt=None, comfy_wants_sage: bool | None = None) -> list[str]:
    """Where the quality guard (``quality`` on SafeSage Attention) moves a block over its target on this
    machine: move_order.runtime_move_order, the rule the node itself measures and moves by
    (``comfy_wants_sage``: as ``preflight.assess``; default ComfyUI's own flags, --use-ck-attention included)."""
    from ..attention.kernel_choice import comfy_attention_choice
    from ..attention.move_order import describe, runtime_move_order
    from ..facts.devices import runtime
    from ..policy import Policy
    policy = policy or Policy()
    q = policy.quality
    if q == "faults only":
        return ["quality guard: faults only (no per-block error measurement)"]
    rt = rt or runtime()
    choice = comfy_attention_choice() if comfy_wants_sage is None else ("sage" if comfy_wants_sage else None)
    order = runtime_move_order(policy.kernel, rt, choice)
    if not order:
        return [f"quality guard ({q}): {describe(order)}"]
    from ..attention.speed_budget import budget_line
    from ..families.registry import installed_kernels
    installed = sorted({k.family for k in installed_kernels(rt)} - {"sdpa"})
    return [f"quality guard ({q}): blocks run {order[0]}; a block over its target {describe(order)} "
            "(the first of these under its target, measured at step 1; ComfyUI's own attention is the reference)",
            f"quality guard ({q}): " + budget_line(q, policy.kernel, rt.arch_name, rt.device_name, installed, order[0])]
