"""Preflight: what a MiniMax H3 render of a given size asks of each attention kernel -- the model.

From a packed token count (``h3.packed_tokens`` of width, height, length and reference images:
ComfyUI's own H3 code where it is loaded, SafeSage's copy of it otherwise) it works out, for
this GPU (or, without one, for common GPUs): the limits of the kernel family sageattention
dispatches to that H3's attention call crosses, the plan SafeSage runs for it (whatever
``planner.choose`` returns), the MLP chunk size (``mlp_plan.resolve_chunk``) and the predicted
transient memory of both; and the same limits for comfy-kitchen's int8_attention. These are
data (:class:`Verdict`, :class:`CkVerdict`, :class:`Assessment`); ``preflight_text`` words
them for the Preflight node, ``status`` for the SafeSage Attention node.

No GPU work and no ComfyUI import at module import time: ComfyUI's modules are only read
when they are already loaded (``sys.modules``) or imported lazily by ``h3``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..families.envelope import FAMILIES, check
from ..families.ck_int8 import VERSION_RANGES
from ..families.sage_dispatch import GPU_NAMES, SAGE_VERSIONS, gpu_words
from ..models.h3.dims import (H3_FFN, H3_HEAD_DIM, H3_HEADS, H3_HIDDEN, H3_TEXT_TOKENS, H3Tokens, attention_call_here,
                              h3_frame_count, packed_tokens)
from ..attention.planner import Plan, choose, plan_for


def preflight(S: int, families: list[str] | None = None, budget_bytes: int | None = None) -> list[dict]:
    """Per kernel family: violations of H3's call at S tokens and the plan SafeSage would run."""
    register_families()
    call = attention_call_here(S)
    rows = []
    for fam in families or [f for f in FAMILIES if f != "sdpa"]:
        env = FAMILIES[fam]
        viol = check(call, env)
        plan = plan_for(call, env, budget_bytes)
        rows.append({"family": fam, "source": env.source,
                     "violations": [str(v) for v in viol],
                     "plan": plan.describe(reasons=False) if plan else "no plan inside the envelope: PyTorch SDPA"})
    return rows


def register_families() -> None:
    """Register every kernel family in ``FAMILIES`` (the registry imports each family's module)."""
    from ..families import registry  # noqa: F401  (registers every family)


# ---------------------------------------------------------------------------- the scenarios
# What a CPU-only ComfyUI reports: common GPUs, each with sageattention 2.2 and 1.x.
COMMON_GPUS = tuple((arch, GPU_NAMES[arch]) for arch in ((8, 9), (9, 0), (12, 0)))
COMMON_SAGE = SAGE_VERSIONS


@dataclass(frozen=True)
class Scenario:
    label: str                      # "this GPU: NVIDIA H200 (sm_90)" / "sm_120 (RTX 5090 ...)"
    arch: tuple[int, int]
    sage_version: str | None
    family: str | None              # the family sageattn dispatches to, None if none
    budget_bytes: int | None        # attention plan budget (None: not limited)
    free_bytes: int | None = None
    note: str = ""
    gpu: str | None = None          # this GPU's name (kernel_table.json's speed holds for its model only)


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
    choice: str = ""                                   # kernel_choice.explain_auto's line for it

    @property
    def peak_bytes(self) -> int:
        """The predicted peak of SafeSage's transients: attention's and the MLP's, one after the other
        in each block (so the larger of the two), above weights and activations, which are not modelled."""
        return max(self.attn_bytes, self.mlp_bytes)


def arch_name(arch) -> str:
    return f"sm_{arch[0]}{arch[1]}"


def scenarios_for(rt, free_bytes: int | None = None) -> list[Scenario]:
    """This GPU as the runtime sees it, or, on a machine without CUDA, the common GPUs."""
    from ..facts.budget import plan_budget_bytes
    from ..facts.devices import sage_family_for
    if rt.arch is not None:
        label = f"this GPU: {rt.device_name} ({rt.arch_name})"
        budget = plan_budget_bytes(free_bytes)
        out = [Scenario(label, rt.arch, rt.sage_version, rt.sage_family, budget, free_bytes,
                        "" if rt.sage_family else f"sageattention not usable: {rt.sage_error}", rt.device_name)]
        if rt.sage_family is None:     # say what installing sage 2.2 would mean here
            fam = sage_family_for("2.2.0", rt.arch)
            if fam:
                out.append(Scenario(f"{label} with sageattention 2.2 installed", rt.arch, "2.2.0", fam,
                                    budget, free_bytes, gpu=rt.device_name))
        return out
    out = []
    for arch, _ in COMMON_GPUS:
        for ver in COMMON_SAGE:
            out.append(Scenario(f"{gpu_words(arch)} with sageattention {ver}", arch, ver,
                                sage_family_for(ver, arch), None))
    return out


def _candidates(policy, rt, family: str | None, comfy_wants_sage: bool) -> list[str]:
    """The kernel order the SafeSage Attention node uses for this policy (its own code)."""
    from ..attention.override import SafeAttention
    from ..families.family import Kernel
    kernels = [Kernel(FAMILIES[family], None)] if family in FAMILIES else []
    return SafeAttention(policy, kernels=kernels, rt=rt).candidates(None, comfy_wants_sage=comfy_wants_sage)


def _safe_up_to(family: str, hi: int = 2_000_000) -> int | None:
    from ..families.rules import first_unsafe
    env = FAMILIES[family]
    bad = first_unsafe(env, attention_call_here, 1, hi)
    return None if bad is None else bad - 1


def verdict(S: int, sc: Scenario, policy, comfy_wants_sage: bool = False, mlp_device=None) -> Verdict:
    """What SafeSage does with H3's attention and MLP at S tokens in scenario ``sc``."""
    import torch

    from ..models.h3.mlp_plan import resolve_chunk
    from ..attention.kernel_choice import explain_auto, pricing_tflops
    from ..facts.devices import Runtime
    register_families()
    v = Verdict(sc, S)
    call = attention_call_here(S, arch=arch_name(sc.arch))
    fam = sc.family if sc.family in FAMILIES else None
    if fam is not None:
        env = FAMILIES[fam]
        v.violations = check(call, env)
        v.sage_plan = plan_for(call, env, sc.budget_bytes)
        v.safe_up_to = _safe_up_to(fam)
    rt = Runtime("", None, sc.gpu, sc.arch, sc.sage_version, fam, None, None, None, None)
    order = v.order = _candidates(policy, rt, fam, comfy_wants_sage)
    v.choice = explain_auto(rt, [fam] if fam else [], "sage" if comfy_wants_sage else None, policy.kernel)
    tflops = pricing_tflops(policy.kernel, arch_name(sc.arch), sc.gpu)
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
    from ..models.h3.mlp_plan import per_token_bytes
    per_tok = per_token_bytes(H3_HIDDEN, H3_FFN, dtype_bytes)
    if chunk >= S:
        return S * per_tok
    return chunk * per_tok + S * H3_HIDDEN * dtype_bytes



# ---------------------------------------------------------------------------- comfy-kitchen
#: what a report without a GPU says about comfy-kitchen's int8_attention (version-dependent
#: envelopes, the same on every arch: safe_ops/families/ck_int8.py)
COMMON_CK = tuple((VERSION_RANGES[f], f) for f in ("ck_int8", "ck_int8_pre236"))


@dataclass
class CkVerdict:
    version: str                    # the installed version, or the range a report without a GPU covers
    family: str
    where: str                      # "sm_90", or "any GPU" without one
    violations: list                # of H3's call at S
    safe_up_to: int | None          # largest S the family takes as called (None: no limit up to 2,000,000)
    plan: Plan | None = None        # SafeSage's plan for the family, where the call crosses its limits


def ck_verdicts(S: int, rt, budget_bytes: int | None = None) -> list[CkVerdict]:
    """comfy-kitchen's int8_attention (what ``--use-ck-attention`` runs on newer ComfyUI) at ``S``
    tokens: the installed version's envelope on a GPU (none where it is not usable: ``rt.ck_error``
    says why), both envelopes without one."""
    register_families()
    if rt.arch is not None:
        if rt.ck_family not in FAMILIES:
            return []
        cases, where = [(rt.ck_version or "?", rt.ck_family)], arch_name(rt.arch)
    else:
        cases, where = list(COMMON_CK), "any GPU"
    call = attention_call_here(S)
    out = []
    for ver, fam in cases:
        env = FAMILIES[fam]
        viol = check(call, env)
        out.append(CkVerdict(ver, fam, where, viol, _safe_up_to(fam),
                             plan_for(call, env, budget_bytes) if viol else None))
    return out


# ---------------------------------------------------------------------------- a render size
@dataclass
class Assessment:
    """Everything the Preflight node reports about one render size."""
    width: int
    height: int
    length: int
    ref_images: int
    tokens: H3Tokens
    policy: object
    rt: object
    verdicts: list                  # of Verdict, one per scenario
    ck: list                        # of CkVerdict

    @property
    def S(self) -> int:
        return self.tokens.total


def assess(width: int, height: int, length: int, ref_images: int = 0, text_tokens: int = H3_TEXT_TOKENS,
           policy=None, rt=None, free_bytes: int | None = None,
           comfy_wants_sage: bool | None = None) -> Assessment:
    """The verdicts for an H3 render of this size under ``policy`` (default: the node's defaults)
    on ``rt`` (default: this process's runtime). ``comfy_wants_sage`` (default: ComfyUI's own
    flags) is taken as True without a GPU: the common GPUs are reported with --use-sage-attention."""
    from ..policy import Policy
    from ..facts.devices import runtime
    policy = policy or Policy()
    rt = rt or runtime()
    if comfy_wants_sage is None:
        from ..attention.kernel_choice import comfy_attention_choice
        comfy_wants_sage = comfy_attention_choice() == "sage"
    t = packed_tokens(width, height, length, ref_images, text_tokens)
    S = t.total
    if rt.arch is None:
        comfy_wants_sage = True
    mlp_dev = None
    if rt.arch is not None:
        import torch
        mlp_dev = torch.device("cuda")
        if free_bytes is None:
            from ..facts.budget import free_device_bytes
            free_bytes = free_device_bytes(mlp_dev)
    verdicts = [verdict(S, sc, policy, comfy_wants_sage, mlp_dev) for sc in scenarios_for(rt, free_bytes)]
    ck = ck_verdicts(S, rt, verdicts[0].scenario.budget_bytes if verdicts else None)
    return Assessment(width, height, length, ref_images, t, policy, rt, verdicts, ck)


# ---------------------------------------------------------------------------- the longest length
#: the Preflight node's (and EmptyMiniMaxH3LatentAV's) largest ``length`` input
MAX_LENGTH = 3600


@dataclass(frozen=True)
class LengthFit:
    """:func:`max_length_within`'s answer: the longest H3 length at one width x height whose predicted
    transients (:attr:`Verdict.peak_bytes`) fit a budget, and the next grid length, which does not."""
    budget_bytes: int
    length: int | None              # frames on H3's 17k+5 grid; None: not even 5 frames fit
    tokens: int | None
    peak_bytes: int | None          # its predicted peak
    next_length: int | None         # the next grid length; None past ``max_length``
    next_tokens: int | None
    next_peak_bytes: int | None     # its predicted peak, over the budget
    capped: bool                    # no grid length up to ``max_length`` exceeds the budget
    scenario: Scenario


def grid_lengths(max_length: int = MAX_LENGTH) -> list[int]:
    """H3's frame counts (the 17k+5 grid EmptyMiniMaxH3LatentAV snaps a length up to) up to ``max_length``."""
    out, n = [], h3_frame_count(5)
    while n <= max_length:
        out.append(n)
        n = h3_frame_count(n + 1)
    return out


def max_length_within(budget_bytes: int, width: int, height: int, ref_images: int = 0,
                      text_tokens: int = H3_TEXT_TOKENS, policy=None, rt=None, comfy_wants_sage: bool = True,
                      max_length: int = MAX_LENGTH, count=packed_tokens, mlp_device=None) -> LengthFit:
    """The longest H3 length (frames on the 17k+5 grid, at most ``max_length``) whose predicted peak --
    :attr:`Verdict.peak_bytes`, the larger of the attention plan's and the MLP's transients, what the
    Preflight node compares with free memory -- is at most ``budget_bytes``, for this GPU's scenario
    (:func:`scenarios_for` of ``rt``, default this process's runtime, with ``budget_bytes`` as the free
    memory: the attention plan is chosen under its budget). The prediction is not monotone in the length
    (plans change), so every grid length is checked from ``max_length`` down. ``count``: the token count,
    ``packed_tokens`` by default (ComfyUI's own where it is loaded; a caller that must not import ComfyUI
    passes ``h3.dims.h3_tokens``). Weights and activations are not part of Preflight's model."""
    from ..policy import Policy
    from ..facts.devices import runtime
    policy = policy or Policy()
    rt = rt or runtime()
    if rt.arch is None:
        raise ValueError("max_length_within needs a runtime with a GPU arch (Runtime(..., arch=(12, 0), ...))")
    sc = scenarios_for(rt, budget_bytes)[0]
    above = None                     # (length, tokens, peak) of the grid length after the one checked
    for n in reversed(grid_lengths(max_length)):
        S = count(width, height, n, ref_images, text_tokens).total
        peak = verdict(S, sc, policy, comfy_wants_sage, mlp_device).peak_bytes
        if peak <= budget_bytes:
            nxt = above or (None, None, None)
            return LengthFit(budget_bytes, n, S, peak, *nxt, capped=above is None, scenario=sc)
        above = (n, S, peak)
    return LengthFit(budget_bytes, None, None, None, *(above or (None, None, None)), capped=False, scenario=sc)
