"""Status lines of the SafeSage nodes that come from preflight's verdicts and the run report.

:func:`limits_lines` closes the SafeSage Attention node's status text (its kernel's H3 limit
on this GPU, and the plan for the reporter's graph); :func:`process_lines` says what earlier
prompts in this process switched off (kernel families, failed first-call checks);
:func:`model_context` is what the Preflight node takes from the MODEL connected to it. The nodes
call these through ``nodes/_backend.py`` (the Attention node through ``patch.apply_node``) and stay thin.
"""
from __future__ import annotations

from ..families.envelope import FAMILIES
from ..models.h3.dims import h3_tokens, is_h3_model
from .preflight import ck_verdicts, register_families, scenarios_for, verdict
from .preflight_text import ck_lines


def limits_lines(rt, policy, comfy_wants_sage: bool | None = None) -> list[str]:
    """Short lines for the SafeSage Attention node's status: up to how many H3 tokens this
    GPU's sage kernel runs as called, and the plan for the reporter's 1664x960x362 graph."""
    register_families()
    if comfy_wants_sage is None:
        from ..attention.kernel_choice import comfy_attention_choice
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
        out += ck_lines(S, ck_verdicts(S, rt), rt)[0]
    out.append("SafeSage Preflight (model/patch/attention) reports, for any H3 size before you queue it, "
               "the kernel limits it crosses and the plan SafeSage runs"
               + ("." if rt.arch is not None else " (here, without a GPU: for common GPUs)."))
    return out


def process_lines(snap: dict, show: int = 3) -> list[str]:
    """Lines for the SafeSage Attention node's status from ``run_stats.snapshot()``: kernel families
    switched off in this process (off until ComfyUI restarts) and call classes whose kernel failed
    the first-call check (ComfyUI's own attention ran them; a new SafeSage node checks them again)."""
    out = []
    for fam, why in (snap.get("disabled_families") or {}).items():
        out.append(f"WARNING: {fam} is off for this ComfyUI process (ComfyUI's own attention runs instead): {why}")
    failed = snap.get("failed_checks") or {}
    if failed:
        shown = "; ".join(f"{cls}: {why}" for cls, why in list(failed.items())[:show])
        more = f" (+{len(failed) - show} more, see /safesage/stats)" if len(failed) > show else ""
        out.append(f"WARNING: {len(failed)} kind(s) of call failed the first-call check earlier in this process "
                   f"(ComfyUI's own attention ran them): {shown}{more}")
    errors = int(snap.get("internal_errors", 0) or 0)
    mlp_errors = int((snap.get("mlp") or {}).get("internal_errors", 0) or 0)
    if errors or mlp_errors:
        out.append(f"WARNING: SafeSage's own code raised {errors} time(s) outside the H3 MLP (attention calls, its "
                   f"model wrappers, a SafeSage node) and in {mlp_errors} MLP call(s) earlier in this process; each "
                   "time ComfyUI's own code ran instead, or the node left that part out (the error and its "
                   "traceback are in the log: please report it)")
    return out


def model_context(model_patcher) -> tuple:
    """(Policy, note) for a ModelPatcher handed to the Preflight node: the policy of a SafeSage
    Attention node upstream (its override on the model) or the defaults, and a line saying
    which, and whether the model is MiniMax H3."""
    from ..attention.override import SafeAttention
    from ..policy import Policy
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
