"""Where the quality guard moves a block over its target: the move order.

:func:`move_order` is the one rule. The guard measures and moves by it (``PlanChoice.quality_order``:
``quality/guard.py`` measures those families as candidates at step 1, ``quality/targets.decide`` moves a
block to the first one under its target, else to ComfyUI's own attention), the node's status line and
Preflight word it (:func:`describe`, :func:`runtime_move_order`), and docs/USING.md / docs/DESIGN.md
carry its table for the common setups (tests/unit/test_quality_order.py renders it and checks them).

The order is ``[planned, target, ...]``:

* ``planned``: the family the policy plans (``kernel=auto``: the measured fastest, else what ComfyUI
  was started with; ``kernel=sage``: sage's own). ``[]`` when that is ComfyUI's own attention (nothing
  is guarded, nothing measured, nothing moves) or for ``kernel=sdpa``.
* the targets: the installed families -- move-only kernels included (registry.move_only_kernels:
  sage 2.2's own fp16-PV ``sage2_sm80`` where the arch's dispatch family is fp8 PV) -- that drift less
  than ``planned`` (a lower ``KernelFamily.drift_rank``, :data:`DRIFT_RANKS`: a family of the same
  precision drifts as much, and measuring it would cost the probe a candidate for nothing), fastest
  first on this GPU:

  - a GPU the kernel table measured (``registry.speed_tflops``: today the H200): by its TFLOP/s; under
    ``auto`` only those faster than ComfyUI's own (``auto`` never prefers a kernel SDPA beats there),
    under ``sage`` all of them (the policy puts the quantised kernels before SDPA);
  - any other GPU (every RTX card, the H100): ComfyUI's own is last. The targets are ranked among
    themselves by the arch's table where it has them (another GPU model of a measured arch: the H100
    by the H200's sm_90 entry), else by :data:`UPSTREAM_ORDER` -- the upstream numbers in
    docs/DESIGN.md "Where a block moves" (the device cannot time an RTX card).

  A family with no ``drift_rank`` (an extra family, e.g. the tests' fakes) is always a target and
  keeps its installed place after the ranked ones.
"""
from __future__ import annotations

from ..families.registry import family, installed_kernels, measured_tflops, speed_tflops
from . import COMFY
from .kernel_choice import policy_order

COMFY_WORDS = "ComfyUI's own attention"

#: ``KernelFamily.drift_rank``: how far a family's error rises on H3's late-block outlier channels,
#: 0 = least. rel. L2 vs fp32 attention at H3's shape (56 x 128, bf16, 38,000 tokens) on the H200,
#: benign / 4 of 128 q/k channels x32 (docs/HAZARDS.md H-9), and on the quality bench's drifting
#: blocks (docs/MEASURED.md "The quality guard", bench/results/quality_guard_sage*_h200.json).
DRIFT_RANKS = {
    0: "comfy-kitchen int8_attention (channels rotated before int8): 0.017 / 0.016, flat at x8-x32 (H-9)",
    1: "sage 2 int8 QK per thread + fp16 PV (sage2_sm80): 0.011 / 0.050 (H-9)",
    2: "sage 2 int8 QK + fp8 PV (sm_89, sm_90, sm_120 paths): 0.039 / 0.056-0.064 (H-9; sm_90's path "
       "shares the fp8 PV, not measured: H-6)",
    3: "int8 QK per block + fp16 PV (sage 1.0.6: 0.22-0.66 on the bench's drifting blocks, where the fp8-PV "
       "paths gave 0.016-0.026; sage2_sm86_triton quantises per block the same way, not measured)",
}

#: move targets ranked among themselves, fastest first, on a GPU whose arch the kernel table has no
#: numbers for (docs/DESIGN.md "Where a block moves" gives the upstream number behind each): on sm_120
#: comfy-kitchen's int8_attention ran 536 TFLOP/s on an RTX 5090 D v2 (comfy-kitchen
#: docs/benchmarks/dense-tma-sm120.md), about sage's own fp8-PV speed there (560, SageAttention README);
#: elsewhere (sm_89, sm_86, sm_80) no number for it was found, while sage's int8-QK + fp16-PV design has
#: one (2.1x FlashAttention2 on an RTX 4090, arXiv 2410.02367), so sage2_sm80 comes first.
UPSTREAM_ORDER = {
    "sm_120": ("ck_int8", "ck_int8_pre236", "sage2_sm80"),
}
DEFAULT_UPSTREAM_ORDER = ("sage2_sm80", "ck_int8", "ck_int8_pre236")


def drift_rank(name: str) -> int | None:
    f = family(name)
    return f.drift_rank if f is not None else None


def drifts_less(name: str, than: str) -> bool:
    """Whether ``name`` may fix a block ``than`` drifted on: a lower drift rank, or either rank unknown."""
    r, p = drift_rank(name), drift_rank(than)
    return r is None or p is None or r < p


def move_order(planned: str | None, families: list[str], arch_name: str, gpu_name: str | None = None,
               kernel_policy: str = "auto") -> list[str]:
    """``[planned] + its move targets``, fastest first on this GPU (module docstring); ``[]`` when
    ``planned`` is ComfyUI's own attention (or None) or ``kernel_policy`` is ``sdpa``. ``families``: the
    kernels installed here (move-only ones included), in installed order."""
    if kernel_policy == "sdpa" or planned in (None, COMFY):
        return []
    targets = [f for f in dict.fromkeys(families) if f not in (planned, COMFY) and drifts_less(f, planned)]
    ranked = [f for f in targets if drift_rank(f) is not None]
    extra = [f for f in targets if drift_rank(f) is None]
    tflops = speed_tflops(arch_name, gpu_name)
    if tflops:                                   # measured on this GPU model
        known = sorted((f for f in ranked if f in tflops), key=lambda f: -tflops[f])
        unknown = [f for f in ranked if f not in tflops]
        sd = tflops.get(COMFY)
        if kernel_policy == "auto" and sd is not None:
            ranked = [f for f in known if tflops[f] > sd]     # auto_order's cut: nothing SDPA beats here
        else:
            ranked = known + unknown
    else:
        arch = measured_tflops(arch_name)        # another GPU model of a measured arch: ranks the kernels
        upstream = UPSTREAM_ORDER.get(arch_name, DEFAULT_UPSTREAM_ORDER)

        def key(f):
            if f in arch:
                return (0, -arch[f], 0)
            return (1, 0, upstream.index(f) if f in upstream else len(upstream))
        ranked = sorted(ranked, key=key)
    return [planned] + ranked + extra


def planning_families(kernels) -> list[str]:
    """The families a plan may use among ``kernels`` (Kernel objects, in installed order): all but
    ComfyUI's own and the quality guard's move-only kernels (registry.move_only_kernels), which a
    block only moves to. The one filter (``PlanChoice.planning_families``, :func:`runtime_move_order`)."""
    return [k.family for k in kernels if k.family != COMFY and not getattr(k, "move_only", False)]


def runtime_move_order(kernel_policy: str, rt, comfy_choice: str | None, kernels: list | None = None) -> list[str]:
    """:func:`move_order` for a node with ``kernel_policy`` on ``rt`` (default kernels: what is installed
    there, registry.installed_kernels) when ComfyUI was started with ``comfy_choice`` ("sage", "ck" or
    None): what Preflight reports (a patched model's own override answers ``quality_order``)."""
    kernels = installed_kernels(rt) if kernels is None else kernels
    names = [k.family for k in kernels if k.family != COMFY]
    planned = policy_order(kernel_policy, rt.arch_name, planning_families(kernels), comfy_choice, rt.device_name)[0]
    return move_order(planned, names, rt.arch_name, rt.device_name, kernel_policy)


def describe(order: list[str]) -> str:
    """The move order in words: ``moves to ck_int8, else sage2_sm80, else ComfyUI's own attention``,
    or why nothing moves."""
    if not order:
        return "nothing to measure or move: ComfyUI's own attention is the plan here"
    return "moves to " + ", else ".join(order[1:] + [COMFY_WORDS])


def table_markdown(rows: list[tuple[str, str, list[str]]]) -> str:
    """A markdown table of move orders: (GPU, ComfyUI started with, order) per row -- docs/USING.md and
    docs/DESIGN.md carry it (tests/unit/test_quality_order.py renders and checks them)."""
    out = ["| GPU | ComfyUI started with | blocks run | a block over its target moves to |",
           "| --- | --- | --- | --- |"]
    for gpu, flags, order in rows:
        runs = f"`{order[0]}`" if order else COMFY_WORDS
        moves = (", else ".join(f"`{f}`" for f in order[1:]) + (", else " if order[1:] else "") + COMFY_WORDS
                 if order else "nothing (no block is measured)")
        out.append(f"| {gpu} | {flags} | {runs} | {moves} |")
    return "\n".join(out)
