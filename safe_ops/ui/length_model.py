"""How long a MiniMax H3 video fits: one sampling step's predicted peak per arm, and the longest length
whose peak fits a free-memory budget (issue #47 item 3). The Preflight node's prediction.

Per arm -- ``safesage`` (the SafeSage Attention node's settings), ``sage`` (unguarded
``--use-sage-attention``), ``pytorch`` (ComfyUI's own attention) -- for S packed tokens and F bytes free
before the run, the step's peak is::

    peak(S) = overhead + constant + per_token x S + own(S)

* ``overhead``: what the process holds beyond its live tensors at the peak: the CUDA context and the
  weights dynamic VRAM keeps resident (outside torch's pool: F - torch reserved - CUDA free at the
  out-of-memory probes) plus the allocator's slack (nvml_process - torch_alloc at a completed probe,
  less that);
* ``constant + per_token x S``: ComfyUI's live tensors at the arm's peak. The unguarded arms peak in
  ComfyUI's unchunked MLP; SafeSage, whose MLP runs in token chunks, in the attention call (the block's
  activations, not counting the attention's result, which ``own`` adds);
* ``own(S)``: SafeSage's own tensors at that peak, priced by its own code: the attention's result plus
  the larger of the plan's transients (``planner.choose`` within ``budget.plan_budget_bytes`` of the
  memory still free, so the plan shrinks as the activations grow) and the result's copy into ComfyUI's
  [B, S, H*D] form; in the MLP phase, the chunked MLP's (``mlp_plan``: one chunk + the [S, hidden]
  output). Zero for the unguarded arms (their MLP and attention are ComfyUI's own, in ``per_token``).

A length fits when its peak is at most F; the longest is searched on H3's 17k+5 frame grid. The constants
are fitted from GPU runs and kept in ``safe_ops/facts/length_model.json`` (``python -m bench.length.fit_lengths``
writes it from bench/results, naming the fields and lengths it fitted on, and checks the prediction
against the measured longest lengths). No ComfyUI import, no GPU work.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass

from ..models.h3.dims import H3_FFN, H3_HEAD_DIM, H3_HEADS, H3_HIDDEN, H3_TEXT_TOKENS, h3_tokens

GiB = 2 ** 30
ARMS = ("safesage", "sage", "pytorch")
#: how the Preflight text names each arm
ARM_LABELS = {"safesage": "SafeSage", "sage": "unguarded --use-sage-attention",
              "pytorch": "ComfyUI's own attention"}
FACTS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "facts", "length_model.json")
#: what the model leaves out, in words (the Preflight text and the facts file say it)
NOT_MODELLED = (
    "other ComfyUI trees (fitted on 0dd9b154; 783545f6 clones V: 14,336 bytes a token more at the attention call)",
    "a guider that batches cond and uncond (CFG: about twice the per-token activations; fitted with the "
    "reporter's BasicGuider)",
    "the full 50-block model (fitted on an 8-block H3-shaped fp8 model: dynamic VRAM streams one block's "
    "weights at a time)",
    "a real RTX card (sage 2.2's sm_120 path was emulated on an H100; its driver and allocator may hold more)",
    "other sizes than 1280x720 (the same per-token terms, unmeasured there)",
)


@functools.lru_cache(maxsize=4)
def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def facts(path: str | None = None) -> dict:
    """The fitted constants (``safe_ops/facts/length_model.json``, or ``path``)."""
    return _load(path or FACTS)


@dataclass(frozen=True)
class ArmModel:
    """One arm's fitted constants (bytes)."""
    arm: str
    phase: str                  # where the arm's step peaks: "attention" or "mlp"
    constant: float
    per_token: float
    overhead: float

    @classmethod
    def of(cls, arm: str, f: dict | None = None) -> "ArmModel":
        a = (f or facts())["arms"][arm]
        return cls(arm, a["phase"], a["constant_bytes"], a["per_token_bytes"], a["overhead_bytes"])


def result_bytes(S: int, elt: int = 2) -> int:
    """The attention's result for H3's call at S tokens: [1, S, H*D] in bf16."""
    return S * H3_HEADS * H3_HEAD_DIM * elt


def result_copied(plan) -> bool:
    """Whether the call's result is copied once more into ComfyUI's [B, S, H*D] form: a plan of several
    launches writes an HND result (executor), as does an HND launch; ComfyUI's own attention (an SDPA
    plan) reshapes its HND result too. Only one NHD launch hands back a view (call_forms.finish)."""
    one = not (plan.head_group or plan.q_chunk or plan.kv_chunk)
    return plan.kind == "sdpa" or not one or plan.layout != "NHD"


def own_attention_bytes(S: int, plan) -> int:
    """SafeSage's own tensors at its attention call's peak with ``plan``: the result, plus the larger of
    the plan's transients (``Plan.peak_bytes``) and the result's copy (:func:`result_copied`)."""
    out = result_bytes(S)
    return out + max(plan.peak_bytes, out if result_copied(plan) else 0)


# ---------------------------------------------------------------------------- the scenario
def measured_scenario(f: dict | None = None):
    """The scenario the constants were measured in: sage 2.2.0's sm_120 family on the bench's GPU
    (``setup`` in the facts file), as ``preflight.Scenario`` (its plan budget is set per call)."""
    from ..facts.devices import sage_family_for
    from .preflight import Scenario
    s = (f or facts())["setup"]
    arch = tuple(s["arch"])
    return Scenario(f"{s['gpu']} ({s['arch_name']} emulated)", arch, s["sage"], sage_family_for(s["sage"], arch),
                    None, gpu=s["gpu"])


@functools.lru_cache(maxsize=64)
def _order(arch, family, gpu, sage_version, policy) -> tuple:
    """The SafeSage Attention node's kernel order and pricing for a scenario (preflight's own rule)."""
    from ..attention.kernel_choice import pricing_tflops
    from ..facts.devices import Runtime
    from ..families.envelope import FAMILIES
    from .preflight import _candidates, arch_name, register_families
    register_families()
    fam = family if family in FAMILIES else None
    rt = Runtime("", None, gpu, arch, sage_version, fam, None, None, None, None)
    order = _candidates(policy, rt, fam, True)
    tflops = pricing_tflops(policy.kernel, arch_name(arch), gpu)
    return tuple(FAMILIES[f] for f in order if f in FAMILIES), (tuple(sorted(tflops.items())) if tflops else None)


@functools.lru_cache(maxsize=4096)
def _plan_cached(S: int, budget: int | None, arch, family, gpu, sage_version, policy):
    from ..attention.planner import choose
    from ..models.h3.dims import attention_call_here
    from .preflight import arch_name
    envs, tflops = _order(arch, family, gpu, sage_version, policy)
    call = attention_call_here(S, arch=arch_name(arch))
    return choose(call, list(envs), budget, dict(tflops) if tflops else None)


def attention_plan(S: int, free_bytes: int, scenario, policy):
    """The plan SafeSage's attention runs at S tokens with ``free_bytes`` free when it plans: what
    ``planner.choose`` makes under ``budget.plan_budget_bytes`` of it, in the node's kernel order."""
    from ..facts.budget import plan_budget_bytes
    sc = scenario
    return _plan_cached(int(S), plan_budget_bytes(max(int(free_bytes), 0)), tuple(sc.arch), sc.family, sc.gpu,
                        sc.sage_version, policy)


def mlp_chunk(S: int, free_bytes: int, policy) -> int:
    """The chunk SafeSage's MLP runs with ``free_bytes`` free (mlp_plan's rule, that free memory read)."""
    import torch

    from ..facts.budget import mlp_budget_bytes
    from ..models.h3 import mlp_plan
    setting = policy.mlp_chunk_tokens if policy.mlp_chunking == "tokens" else policy.mlp_chunking
    setting = mlp_plan.parse_chunk_setting(setting)
    budget = None
    if setting == "auto":
        budget = mlp_budget_bytes(None, mlp_plan.AUTO_BUDGET_BYTES, read_free=lambda _d: max(int(free_bytes), 0))
    return mlp_plan.chunk_tokens(setting, S, H3_HIDDEN, H3_FFN, torch.bfloat16, torch.device("cpu"), budget)


# ---------------------------------------------------------------------------- one step's peak
@dataclass(frozen=True)
class Peak:
    """One step's predicted peak at S tokens with ``free`` bytes free before the run (bytes)."""
    arm: str
    S: int
    free: int
    overhead: float
    activations: float          # constant + per_token x S
    own: float                  # SafeSage's own tensors at the peak (0 for the unguarded arms)
    phase: str
    plan: object = None         # SafeSage's attention plan in the peak (None for the unguarded arms)
    mlp_chunk: int = 0          # SafeSage's MLP chunk at this length
    planned: object = None      # the plan SafeSage's budget rule makes (``plan`` unless it would not fit)

    @property
    def total(self) -> float:
        return self.overhead + self.activations + self.own

    @property
    def fits(self) -> bool:
        return self.total <= self.free


def step_peak(arm: str, S: int, free_bytes: int, scenario=None, policy=None, f: dict | None = None) -> Peak:
    """The predicted peak of one sampling step of ``arm`` at ``S`` packed tokens with ``free_bytes`` free
    before the run (``scenario``: a ``preflight.Scenario``, default the measured one; ``policy``: the
    SafeSage node's settings, default its defaults).

    SafeSage's attention plan is the one its budget rule makes within what is free when it plans
    (:attr:`Peak.planned`); where that plan with the result and its copy would not fit, the smallest plan
    that does: the plan made within what is free less the result and its copy, which fits whenever
    anything does (ComfyUI's own attention, what SafeSage runs when no plan fits the budget, needs the
    result and its copy too)."""
    from ..policy import Policy
    f = f or facts()
    m = ArmModel.of(arm, f)
    if arm != "safesage":
        return Peak(arm, S, free_bytes, m.overhead, m.constant + m.per_token * S, 0.0, m.phase)
    scenario = scenario or measured_scenario(f)
    policy = policy or Policy()
    # the attention call: the block's activations, then the plan made within what is still free
    act = m.constant + m.per_token * S
    left = free_bytes - m.overhead - act
    planned = plan = attention_plan(S, left, scenario, policy)
    own = own_attention_bytes(S, plan)
    if own > left:
        smaller = attention_plan(S, left - 2 * result_bytes(S), scenario, policy)
        if own_attention_bytes(S, smaller) < own:
            plan, own = smaller, own_attention_bytes(S, smaller)
    attn = Peak(arm, S, free_bytes, m.overhead, act, own, "attention", plan, 0, planned)
    # the chunked MLP: ComfyUI's activations outside its MLP (the unguarded arms' MLP-phase term less
    # the unchunked MLP's own intermediates), then one chunk planned within what is still free
    mp = f["mlp_phase"]
    act_mlp = mp["constant_bytes"] + mp["per_token_bytes"] * S
    chunk = mlp_chunk(S, free_bytes - m.overhead - act_mlp, policy)
    from .preflight import mlp_transient_bytes
    own_mlp = mlp_transient_bytes(S, chunk)
    if m.overhead + act_mlp + own_mlp > attn.total:
        return Peak(arm, S, free_bytes, m.overhead, act_mlp, own_mlp, "mlp", plan, chunk, planned)
    return Peak(arm, S, free_bytes, m.overhead, act, own, "attention", plan, chunk, planned)


# ---------------------------------------------------------------------------- the longest length
@dataclass(frozen=True)
class Longest:
    """:func:`longest`'s answer for one arm: the longest grid length whose predicted peak fits, and the
    next grid length, which does not (None past ``max_length``)."""
    arm: str
    free: int
    frames: int | None
    tokens: int | None
    peak: Peak | None
    next_frames: int | None
    next_tokens: int | None
    next_peak: Peak | None

    @property
    def capped(self) -> bool:
        return self.frames is not None and self.next_frames is None


def longest(arm: str, free_bytes: int, width: int, height: int, ref_images: int = 0,
            text_tokens: int = H3_TEXT_TOKENS, scenario=None, policy=None, count=h3_tokens,
            max_length: int | None = None, f: dict | None = None) -> Longest:
    """The longest H3 length (frames on the 17k+5 grid, at most ``max_length``, default the Preflight
    node's top) whose predicted step peak (:func:`step_peak`) fits ``free_bytes``. The peak grows with the
    length (more tokens, and less left for SafeSage's plan), so the grid is bisected; ``count`` gives the
    tokens (``h3_tokens`` by default: no ComfyUI import)."""
    from .preflight import MAX_LENGTH, grid_lengths
    grid = grid_lengths(MAX_LENGTH if max_length is None else max_length)

    cache: dict = {}

    def at(i: int) -> tuple[int, int, Peak]:
        if i not in cache:
            n = grid[i]
            S = count(width, height, n, ref_images, text_tokens).total
            cache[i] = (n, S, step_peak(arm, S, free_bytes, scenario, policy, f))
        return cache[i]

    # start where the linear part alone (SafeSage: with its result and the result's copy) reaches the
    # budget, step out by doubling until the fit changes, then bisect: a few plans instead of ~8
    m = ArmModel.of(arm, f)
    slope = m.per_token + (2 * result_bytes(1) if arm == "safesage" else 0)
    guess = (free_bytes - m.overhead - m.constant) / slope if slope > 0 else float("inf")
    i = max(0, min(len(grid) - 1, sum(1 for n in grid if count(width, height, n, ref_images, text_tokens).total
                                       <= guess) - 1))
    if at(i)[2].fits:
        lo, step = i, 1
        while lo + step < len(grid) and at(lo + step)[2].fits:
            lo, step = lo + step, step * 2
        hi = min(lo + step, len(grid))
    else:
        hi, step = i, 1
        while hi - step >= 0 and not at(hi - step)[2].fits:
            hi, step = hi - step, step * 2
        lo = max(hi - step, -1)
    while hi - lo > 1:              # grid[lo] fits (lo = -1: nothing does), grid[hi] does not
        mid = (lo + hi) // 2
        if at(mid)[2].fits:
            lo = mid
        else:
            hi = mid
    got = at(lo) if lo >= 0 else None
    nxt = at(hi) if hi < len(grid) else None
    return Longest(arm, free_bytes, *(got or (None, None, None)), *(nxt or (None, None, None)))


def measured_budget(free_bytes: int, f: dict | None = None) -> dict | None:
    """The facts file's check of the prediction at the budget ``free_bytes`` is (to 0.1 GiB), if any:
    ``{"measured": bool, "arms": {arm: {"preflight_over_measured", ...}}}``."""
    for key, b in (f or facts())["budgets"].items():
        if abs(float(key) * GiB - free_bytes) < 0.1 * GiB:
            return b
    return None
