"""Preflight: what a MiniMax H3 render of a given size asks of each attention kernel.

From width, height, length (and the number of reference images) it gives the packed token
count H3 attends over -- with ComfyUI's own code (``comfy_extras.nodes_minimax_h3`` and
``comfy.ldm.minimax.model.PackedLayout``) when ComfyUI with H3 is loaded, with the same
arithmetic (:func:`h3_tokens`, compared with ComfyUI's in tests/comfy) otherwise -- then, for
this GPU (or, without one, for common GPUs): the limits of the kernel family sageattention
dispatches to that H3's attention call crosses, the plan SafeSage runs for it (whatever
``planner.choose`` returns, printed with ``Plan.describe()``), the MLP chunk size
(``mlp.resolve_chunk``) and the predicted transient memory of both.

No GPU work and no ComfyUI import at module import time: ComfyUI's modules are only read
when they are already loaded (``sys.modules``) or imported lazily inside
:func:`comfy_h3_tokens`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .envelope import FAMILIES, AttnCall, check
from .h3 import (H3_FFN, H3_HEAD_DIM, H3_HEADS, H3_HIDDEN, H3_LAYERS, H3_TEXT_TOKENS, comfy_h3_tokens,
                 comfy_v_layout, h3_attention_call, h3_frame_count, h3_tokens)
from .planner import Plan, choose, plan_for

GiB = 2 ** 30


def v_layout() -> tuple[str, str]:
    """(V's layout in H3's attention call, where that was read): this ComfyUI's own H3 when it is
    loaded (783545f6 copies V, 0dd9b154 and later upstream hand a view), else 0dd9b154's view."""
    got = comfy_v_layout()
    if got is not None:
        return got, "read from this ComfyUI's H3 Attention"
    return "strided", "ComfyUI's H3 not loaded here: 0dd9b154's layout"


def _h3_call(S: int, arch: str = "") -> AttnCall:
    return h3_attention_call(S, arch=arch, v_layout=v_layout()[0])


def preflight(S: int, families: list[str] | None = None, budget_bytes: int | None = None) -> list[dict]:
    """Per kernel family: violations of H3's call at S tokens and the plan SafeSage would run."""
    _register_sage2()
    call = _h3_call(S)
    rows = []
    for fam in families or [f for f in FAMILIES if f != "sdpa"]:
        env = FAMILIES[fam]
        viol = check(call, env)
        plan = plan_for(call, env, budget_bytes)
        rows.append({"family": fam, "source": env.source,
                     "violations": [str(v) for v in viol],
                     "plan": plan.describe(reasons=False) if plan else "no plan inside the envelope: PyTorch SDPA"})
    return rows


def _register_sage2() -> None:
    try:
        from . import envelope_sage2  # noqa: F401  (registers the sage 2.x families)
    except ImportError:
        pass


# ---------------------------------------------------------------------------- the report
# What a CPU-only ComfyUI reports: common GPUs, each with sageattention 2.2 and 1.x.
COMMON_GPUS = (
    ((8, 9), "RTX 4090 / L40S"),
    ((9, 0), "H100 / H200"),
    ((12, 0), "RTX 5090 / RTX PRO 6000 Blackwell"),
)
COMMON_SAGE = ("2.2.0", "1.0.6")


@dataclass(frozen=True)
class Scenario:
    label: str                      # "this GPU: NVIDIA H200 (sm_90)" / "sm_120 (RTX 5090 ...)"
    arch: tuple[int, int]
    sage_version: str | None
    family: str | None              # the family sageattn dispatches to, None if none
    budget_bytes: int | None        # attention plan budget (None: not limited)
    free_bytes: int | None = None
    note: str = ""


@dataclass
class Verdict:
    scenario: Scenario
    S: int
    violations: list = field(default_factory=list)   # of the sage family, at S
    sage_plan: Plan | None = None                     # SafeSage's plan for the sage family
    plan: Plan | None = None                          # what the call runs under the policy
    safe_up_to: int | None = None                     # largest S the family takes as called
    attn_bytes: int = 0
    mlp_chunk: int = 0
    mlp_bytes: int = 0
    mlp_unchunked_bytes: int = 0
    order: list = field(default_factory=list)          # kernel preference order of the policy
    choice: str = ""                                   # runtime.explain_auto's line for it


def _arch_name(arch) -> str:
    return f"sm_{arch[0]}{arch[1]}"


def _fmt_gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def scenarios_for(rt, free_bytes: int | None = None) -> list[Scenario]:
    """This GPU as the runtime sees it, or, on a machine without CUDA, the common GPUs."""
    from .budget import plan_budget_bytes
    from .runtime import sage_family_for
    if rt.arch is not None:
        label = f"this GPU: {rt.device_name} ({rt.arch_name})"
        budget = plan_budget_bytes(free_bytes)
        out = [Scenario(label, rt.arch, rt.sage_version, rt.sage_family, budget, free_bytes,
                        "" if rt.sage_family else f"sageattention not usable: {rt.sage_error}")]
        if rt.sage_family is None:     # say what installing sage 2.2 would mean here
            fam = sage_family_for("2.2.0", rt.arch)
            if fam:
                out.append(Scenario(f"{label} with sageattention 2.2 installed", rt.arch, "2.2.0", fam,
                                    budget, free_bytes))
        return out
    out = []
    for arch, names in COMMON_GPUS:
        for ver in COMMON_SAGE:
            out.append(Scenario(f"{_arch_name(arch)} ({names}) with sageattention {ver}", arch, ver,
                                sage_family_for(ver, arch), None))
    return out


def _candidates(policy, rt, family: str | None, comfy_wants_sage: bool) -> list[str]:
    """The kernel order the SafeSage Attention node uses for this policy (its own code)."""
    from .attention import SafeAttention
    from .kernels import Kernel
    kernels = [Kernel(FAMILIES[family], None)] if family in FAMILIES else []
    return SafeAttention(policy, kernels=kernels, rt=rt).candidates(None, comfy_wants_sage=comfy_wants_sage)


def _safe_up_to(family: str, hi: int = 2_000_000) -> int | None:
    from .envelope_sage2 import first_unsafe
    env = FAMILIES[family]
    bad = first_unsafe(env, _h3_call, 1, hi)
    return None if bad is None else bad - 1


def verdict(S: int, sc: Scenario, policy, comfy_wants_sage: bool = False, mlp_device=None) -> Verdict:
    """What SafeSage does with H3's attention and MLP at S tokens in scenario ``sc``."""
    import torch

    from .mlp_plan import resolve_chunk
    from .runtime import Runtime, explain_auto, pricing_tflops
    _register_sage2()
    v = Verdict(sc, S)
    call = _h3_call(S, arch=_arch_name(sc.arch))
    fam = sc.family if sc.family in FAMILIES else None
    if fam is not None:
        env = FAMILIES[fam]
        v.violations = check(call, env)
        v.sage_plan = plan_for(call, env, sc.budget_bytes)
        v.safe_up_to = _safe_up_to(fam)
    rt = Runtime("", None, sc.label, sc.arch, sc.sage_version, fam, None, None, None, None)
    order = v.order = _candidates(policy, rt, fam, comfy_wants_sage)
    v.choice = explain_auto(rt, [fam] if fam else [], "sage" if comfy_wants_sage else None, policy.kernel)
    tflops = pricing_tflops(policy.kernel, _arch_name(sc.arch))
    v.plan = choose(call, [FAMILIES[f] for f in order if f in FAMILIES], sc.budget_bytes, tflops)
    out_bytes = S * H3_HEADS * H3_HEAD_DIM * call.elt_bytes
    # the plan's own budgeted peak; where the kernel's temporaries are unknown (SDPA), its output
    v.attn_bytes = v.plan.peak_bytes + (0 if v.plan.kernel_temp_bytes else out_bytes)
    setting = (policy.mlp_chunk_tokens if policy.mlp_chunking == "tokens" else policy.mlp_chunking)
    dev = mlp_device if mlp_device is not None else torch.device("cpu")
    v.mlp_chunk = resolve_chunk(setting, S, H3_HIDDEN, H3_FFN, torch.bfloat16, dev)
    v.mlp_unchunked_bytes = mlp_transient_bytes(S, S)
    v.mlp_bytes = mlp_transient_bytes(S, v.mlp_chunk)
    return v


def mlp_transient_bytes(S: int, chunk: int, dtype_bytes: int = 2) -> int:
    """Predicted working memory of one H3 MLP call above its input and weights: one chunk's
    intermediates (mlp.per_token_bytes) plus, when chunked, the preallocated [S, hidden] output.
    Unchunked it is an upper bound (per_token_bytes counts the quantised path's copies); tests
    compare both with the H200 measurement in bench/results/mlp_h200.json."""
    from .mlp_plan import per_token_bytes
    per_tok = per_token_bytes(H3_HIDDEN, H3_FFN, dtype_bytes)
    if chunk >= S:
        return S * per_tok
    return chunk * per_tok + S * H3_HIDDEN * dtype_bytes


#: what a report without a GPU says about comfy-kitchen's int8_attention (version-dependent
#: envelopes, the same on every arch: safe_ops/envelope_ck.py)
COMMON_CK = (("0.2.36-0.2.40", "ck_int8"), ("0.2.29-0.2.35", "ck_int8_pre236"))


def ck_lines(S: int, rt, budget_bytes: int | None = None) -> tuple[list[str], list[str]]:
    """(report lines, warnings) for comfy-kitchen's int8_attention (what ``--use-ck-attention``
    runs on newer ComfyUI) at ``S`` tokens: the installed version's envelope on a GPU, both
    envelopes without one."""
    from . import envelope_ck  # noqa: F401  (registers the ck families)
    if rt.arch is not None:
        if rt.ck_family not in FAMILIES:
            return [f"[comfy-kitchen int8_attention] not usable here: {rt.ck_error or 'not installed'}"], []
        cases = [(rt.ck_version or "?", rt.ck_family)]
        where = _arch_name(rt.arch)
    else:
        cases, where = list(COMMON_CK), "any GPU"
    lines, warnings = [], []
    call = _h3_call(S)
    for ver, fam in cases:
        env = FAMILIES[fam]
        viol = check(call, env)
        safe = _safe_up_to(fam)
        head = f"[comfy-kitchen {ver} int8_attention -> {fam}]"
        if not viol:
            lines.append(f"{head} limits: none crossed at {S:,} tokens"
                         + (f" (safe up to {safe:,})" if safe else " (no limit up to 2,000,000)"))
            continue
        plan = plan_for(call, env, budget_bytes)
        run = plan.describe(reasons=False) if plan else "no plan inside its limits, so PyTorch SDPA"
        lines.append(f"{head} limits: H3's call crosses {len(viol)} at {S:,} tokens"
                     + (f" (safe up to {safe:,})" if safe else "") + f"; SafeSage runs it as: {run}")
        warnings.append(f"{S:,} tokens: comfy-kitchen {ver} int8_attention on {where} would cross its limits"
                        + (f" (safe up to {safe:,})" if safe else "") + f"; plan: {run}")
    return lines, warnings


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
        warnings.append(f"{S:,} tokens: {_family_text(fam, sc.sage_version)} on {_arch_name(sc.arch)} "
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
    peak = max(v.attn_bytes, v.mlp_bytes)
    lines.append(f"  transients: attention {_fmt_gib(v.attn_bytes)}, {mlp}; predicted peak {_fmt_gib(peak)} "
                 "(one after the other in each block, above weights and activations)")
    if sc.free_bytes is not None and peak > sc.free_bytes:
        warnings.append(f"{_arch_name(sc.arch)}: the predicted transients ({_fmt_gib(peak)}) exceed the "
                        f"{_fmt_gib(sc.free_bytes)} free now; lower the size, or set mlp_chunking to "
                        "'tokens' with fewer mlp_chunk_tokens")
    return lines, warnings


def _call_line(S: int) -> str:
    layout, where = v_layout()
    v = ("V a view too" if layout == "strided"
         else f"V its own token-major copy (token stride {H3_HEADS * H3_HEAD_DIM:,})")
    return (f"attention call: [1, {H3_HEADS}, {S:,}, {H3_HEAD_DIM}], q and k views into the qkv buffer "
            f"(token stride {3 * H3_HEADS * H3_HEAD_DIM:,}), {v} ({where})")


def preflight_report(width: int, height: int, length: int, ref_images: int = 0,
                     text_tokens: int = H3_TEXT_TOKENS, policy=None, rt=None,
                     free_bytes: int | None = None, comfy_wants_sage: bool | None = None,
                     model_note: str = "") -> dict:
    """The SafeSage Preflight node's report: ``{"text", "tokens", "warnings", "verdicts"}``."""
    from .policy import Policy
    from .runtime import runtime
    policy = policy or Policy()
    rt = rt or runtime()
    if comfy_wants_sage is None:
        from .runtime import comfy_attention_choice
        comfy_wants_sage = comfy_attention_choice() == "sage"
    t = comfy_h3_tokens(width, height, length, ref_images, text_tokens) or \
        h3_tokens(width, height, length, ref_images, text_tokens)
    S = t.total
    lines = [f"SafeSage preflight: MiniMax H3, {width}x{height}, {length} frames "
             f"(-> {h3_frame_count(length)} on H3's 17k+5 grid), {ref_images} reference image(s)",
             f"packed tokens: {S:,} = video {t.video:,} + audio {t.audio:,} + references {t.refs:,} "
             f"+ text {t.text:,} (text varies with the prompt); counted with {t.source}",
             _call_line(S),
             f"runtime: {rt.summary()}",
             f"kernel policy: {policy.kernel}; mlp_chunking: {policy.mlp_chunking}"
             + (f" ({policy.mlp_chunk_tokens:,} tokens)" if policy.mlp_chunking == "tokens" else "")]
    if model_note:
        lines.append(model_note)
    if rt.arch is None:
        comfy_wants_sage = True
        lines.append("no CUDA device here: what SafeSage would do on common GPUs, with ComfyUI started "
                     "with --use-sage-attention")
    warnings: list[str] = []
    verdicts = []
    mlp_dev = None
    if rt.arch is not None:
        import torch
        mlp_dev = torch.device("cuda")
        if free_bytes is None:
            from .budget import free_device_bytes
            free_bytes = free_device_bytes(mlp_dev)
    for sc in scenarios_for(rt, free_bytes):
        v = verdict(S, sc, policy, comfy_wants_sage, mlp_dev)
        ls, ws = verdict_lines(v)
        lines += ls
        warnings += ws
        verdicts.append(v)
    ls, ws = ck_lines(S, rt, verdicts[0].scenario.budget_bytes if verdicts else None)
    lines += ls
    warnings += ws
    for w in warnings:
        lines.append("WARNING: " + w)
    return {"text": "\n".join(lines), "tokens": t, "warnings": warnings, "verdicts": verdicts}


def limits_lines(rt, policy, comfy_wants_sage: bool | None = None) -> list[str]:
    """Short lines for the SafeSage Attention node's status: up to how many H3 tokens this
    GPU's sage kernel runs as called, and the plan for the reporter's 1664x960x362 graph."""
    _register_sage2()
    if comfy_wants_sage is None:
        from .runtime import comfy_attention_choice
        comfy_wants_sage = comfy_attention_choice() == "sage"
    S = h3_tokens(1664, 960, 362, ref_images=3).total
    out = []
    for sc in scenarios_for(rt)[:1] if rt.arch is not None else []:
        if sc.family not in FAMILIES:
            continue
        v = verdict(S, sc, policy, comfy_wants_sage)
        out.append(f"H3 attention on {sc.family}: as called it is safe up to "
                   + (f"{v.safe_up_to:,} tokens" if v.safe_up_to else "any length checked (2,000,000)")
                   + f"; at {S:,} tokens (1664x960x362, 3 refs) the call runs: {v.plan.describe(reasons=False)}")
    if rt.arch is not None and rt.ck_family in FAMILIES:
        out += ck_lines(S, rt)[0]
    out.append("SafeSage Preflight (model/patch/attention) reports, for any H3 size before you queue it, "
               "the kernel limits it crosses and the plan SafeSage runs"
               + ("." if rt.arch is not None else " (here, without a GPU: for common GPUs)."))
    return out


def model_context(model_patcher) -> tuple:
    """(Policy, note) for a ModelPatcher handed to the Preflight node: the policy of a SafeSage
    Attention node upstream (its override on the model) or the defaults, and a line saying
    which, and whether the model is MiniMax H3."""
    from .attention import SafeAttention
    from .h3 import is_h3_model
    from .policy import Policy
    if model_patcher is None:
        return Policy(), ("model: not connected; SafeSage Attention's default settings assumed "
                          "(connect its MODEL output to use its settings)")
    to = (getattr(model_patcher, "model_options", None) or {}).get("transformer_options", {})
    override = to.get("optimized_attention_override")
    dm = getattr(getattr(model_patcher, "model", None), "diffusion_model", None)
    kind = type(dm).__name__ if dm is not None else type(model_patcher).__name__
    h3 = "MiniMax H3" if is_h3_model(dm) else f"NOT MiniMax H3 ({kind}): the counts and plans below are H3's"
    if isinstance(override, SafeAttention):
        return override.policy, f"model: {h3}; settings from the SafeSage Attention node on it"
    return Policy(), (f"model: {h3}; no SafeSage Attention node on it (put one after the loader), "
                      "its default settings assumed")
