"""Which kernel a call prefers: ``auto``'s order (measured, else what ComfyUI was started with), the
TFLOP/s that price plans, the policy's candidate order, and the one line that explains ``auto``.

Per call, the planner still falls back down the order when a kernel cannot run a call safely
(planner.choose); this module only orders the candidates.
"""
from __future__ import annotations

import sys

from ..facts.devices import Runtime
from ..families.registry import family_kind, speed_tflops


def pricing_tflops(kernel_policy: str, arch_name: str, gpu_name: str | None) -> dict | None:
    """The TFLOP/s that price plans against SDPA (``planner.choose``): only ``auto``, only on the
    GPU model the table measured (registry.speed_tflops). One rule for the attention override and
    Preflight's prediction."""
    return (speed_tflops(arch_name, gpu_name) or None) if kernel_policy == "auto" else None


# ------------------------------------------------------------------ auto's order
def comfy_attention_choice() -> str | None:
    """What ComfyUI itself was configured to run, from its flags if ComfyUI is loaded
    (``--use-sage-attention``, ``--use-ck-attention``): "sage", "ck" (comfy-kitchen int8) or None
    (PyTorch/other). Per call, the function ComfyUI hands the override says it instead
    (comfy_functions.unguarded_kind)."""
    mm = sys.modules.get("comfy.model_management")
    fn = getattr(mm, "sage_attention_enabled", None)
    try:
        if callable(fn) and fn():
            return "sage"
    except Exception:
        pass
    cli = sys.modules.get("comfy.cli_args")
    if cli is not None and getattr(getattr(cli, "args", None), "use_ck_attention", False):
        return "ck"
    return None


def auto_order(arch_name: str, families: list[str], comfy_choice: str | None,
               gpu_name: str | None = None) -> tuple[list[str], str]:
    """``auto``'s preference over ``families`` (installed, non-SDPA) plus "sdpa", and why.

    Measured GPU (kernel_table.json, measured on this GPU model: registry.speed_tflops): fastest
    first by measured TFLOP/s; families with no number follow. Unmeasured GPU -- another model of
    a measured arch included: what ComfyUI was configured to run first, then SDPA; a family
    ComfyUI was not configured for comes after SDPA (never used by ``auto``)."""
    order = measured_order(arch_name, families + ["sdpa"], gpu_name)
    if order is not None:
        tflops = speed_tflops(arch_name, gpu_name)
        first = order[0]
        rest = ", ".join(f"{f} {tflops[f]:.0f}" for f in order[1:] if f in tflops)
        unmeasured = [f for f in order if f not in tflops]
        why = (f"it measured fastest on {arch_name} ({tflops[first]:.0f} TFLOP/s"
               + (f"; {rest}" if rest else "")
               + (f"; not measured: {', '.join(unmeasured)}" if unmeasured else "")
               + "; safe_ops/facts/kernel_table.json)")
        return order, why
    wanted = [f for f in families if comfy_choice is not None and family_kind(f) == comfy_choice]
    others = [f for f in families if f not in wanted]
    if wanted:
        flag = {"sage": "--use-sage-attention", "ck": "--use-ck-attention"}[comfy_choice]
        return wanted + ["sdpa"] + others, (
            f"{arch_name} has no measurement here and ComfyUI is set to run it ({flag})")
    if comfy_choice is not None:
        return ["sdpa"] + families, (f"{arch_name} has no measurement here and the kernel ComfyUI is set to "
                                     f"run ({comfy_choice}) is not usable here")
    return ["sdpa"] + families, (f"{arch_name} has no measurement here and ComfyUI runs PyTorch attention "
                                 "(start ComfyUI with --use-sage-attention or --use-ck-attention to prefer those)")


def policy_order(kernel_policy: str, arch_name: str, families: list[str], comfy_choice: str | None,
                 gpu_name: str | None = None) -> list[str]:
    """A policy's planning preference over ``families`` (the planning families here, non-SDPA) plus
    "sdpa": ``sdpa`` -> ComfyUI's own only; ``sage`` -> the families as listed, then SDPA; ``auto`` ->
    :func:`auto_order` (``comfy_choice``: what ComfyUI was started with). What PlanChoice.candidates
    answers for a call ComfyUI hands no function of a layer's own, and what the quality guard's move order
    starts from (move_order.runtime_move_order)."""
    if kernel_policy == "sdpa":
        return ["sdpa"]
    if kernel_policy == "sage":
        return list(families) + ["sdpa"]
    return auto_order(arch_name, list(families), comfy_choice, gpu_name)[0]


def explain_auto(rt: Runtime, families: list[str], comfy_choice: str | None = None,
                 kernel_policy: str = "auto") -> str:
    """One plain-language line for the node's status: which kernel ``auto`` prefers and why.

    ``families``: the installed non-SDPA families (e.g. ``SafeAttention.kernels`` minus sdpa).
    Per call, the planner still falls back down the order when a kernel cannot run a call
    safely (those fallbacks are counted and logged separately), and on a measured GPU runs
    SDPA where it is cheaper than the preferred kernel's plan for that call (planner.choose)."""
    if kernel_policy == "sdpa":
        return ("kernel 'sdpa': ComfyUI's own attention for every call, as asked (never SageAttention or INT8 "
                "attention: PyTorch attention where ComfyUI is set to one)")
    if kernel_policy == "sage":
        if not families:
            return (f"kernel 'sage' asked, but no sage kernel is usable ({rt.sage_error}); "
                    "every call runs ComfyUI's own attention")
        return (f"kernel 'sage': {families[0]} first, as asked (ComfyUI's own attention only for calls it cannot "
                "run safely)")
    if not families:
        return (f"auto picked ComfyUI's own attention because no sage-family kernel is usable here "
                f"(sageattention: {rt.sage_error}; comfy-kitchen: {rt.ck_error})")
    if comfy_choice is None:
        comfy_choice = comfy_attention_choice()
    order, why = auto_order(rt.arch_name, families, comfy_choice, rt.device_name)
    name = "ComfyUI's own attention (PyTorch SDPA)" if order[0] == "sdpa" else order[0]
    return f"auto picked {name} because {why}"


def measured_order(arch_name: str, families: list[str], gpu_name: str | None = None) -> list[str] | None:
    """Families sorted fastest first by the measured table, or None if this GPU is unmeasured."""
    tflops = speed_tflops(arch_name, gpu_name)
    if not tflops:
        return None
    known = [f for f in families if f in tflops]
    if not known:
        return None
    known.sort(key=lambda f: -tflops[f])
    return known + [f for f in families if f not in tflops]
