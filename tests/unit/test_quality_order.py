"""The quality guard's move order under the node's defaults (issue #37 point 1): where a block over its
target moves, per GPU, policy and ComfyUI flag -- attention/move_order.py, the one rule that
``PlanChoice.quality_order`` (the guard), the node's status line, Preflight and docs/USING.md's table use.

Every GPU here is emulated (tests/unit/emulated_gpus.py: its arch and name, stand-in sageattention 2.2 /
comfy-kitchen 0.2.40 packages, ComfyUI's flags); the order is what the real registry, planner and
kernel table make of them. Why each order is what it is (the upstream numbers): docs/DESIGN.md
"Where a block moves".
"""
from __future__ import annotations

from pathlib import Path

import pytest

import emulated_gpus as E

REPO = Path(__file__).resolve().parents[2]
SAGE_FLAG, CK_FLAG = "`--use-sage-attention`", "`--use-ck-attention`"


@pytest.fixture
def packages(monkeypatch):
    E.install_packages(monkeypatch)
    return monkeypatch


def node(rt, kernel="auto", quality="balanced"):
    """The SafeSage Attention node's override on ``rt``, with the kernels installed there."""
    from safe_ops.attention.override import SafeAttention
    from safe_ops.policy import Policy
    return SafeAttention(Policy(kernel=kernel, quality=quality), rt=rt)


def order(monkeypatch, gpu, flag, kernel="auto", **versions):
    E.comfy_flags(monkeypatch, flag)
    return node(E.runtime(gpu, **versions), kernel).quality_order(None)


def _decide(order_, errors):
    """targets.decide on one drifting block planned on order_[0] (error 0.06 against benign blocks at
    0.01: target 0.044) whose candidates measured ``errors``."""
    from safe_ops.quality import targets
    benign = [targets.BlockErrors(b, "k", order_[0], 0.01, {}) for b in range(9)]
    drifting = targets.BlockErrors(9, "k", order_[0], 0.06, dict(errors))
    return targets.decide(benign + [drifting], "balanced", order_)[-1]


# ------------------------------------------------------------------------------------------------
def test_quality_order_auto_sm89_sage22_ck240_use_sage_attention(packages):
    """RTX 4090, sage 2.2 + comfy-kitchen 0.2.40, --use-sage-attention, kernel=auto: blocks plan sage's
    fp8-PV dispatch family; one over its target moves to sage's own fp16-PV kernel (move-only: installed
    for the guard, never planned), else comfy-kitchen, else ComfyUI's own. Before issue #37 it was
    ['sage2_sm89_fp8pv']: every moved block ran SDPA."""
    from safe_ops import patch
    E.comfy_flags(packages, "sage")
    rt = E.runtime(E.RTX4090)
    att = node(rt)
    assert att.quality_order(None) == ["sage2_sm89_fp8pv", "sage2_sm80", "ck_int8"]
    assert att.kernels["sage2_sm80"].move_only and not att.kernels["ck_int8"].move_only
    assert att.candidates(None) == ["sage2_sm89_fp8pv", "sdpa", "ck_int8"]          # planning as before
    # targets.decide moves the block to the first family under its target, in that order
    assert _decide(att.quality_order(None), {"sage2_sm80": 0.03, "ck_int8": 0.015}).family == "sage2_sm80"
    assert _decide(att.quality_order(None), {"sage2_sm80": 0.05, "ck_int8": 0.015}).family == "ck_int8"
    # the node's status line says the same order
    line = patch._quality_line(att.policy, att, 50)
    assert ("a block over its target moves to sage2_sm80, else ck_int8, else ComfyUI's own attention "
            "from step 2") in line, line


def test_quality_order_auto_sm120_sage22_ck240_use_sage_attention(packages):
    """RTX 5090, same setup: comfy-kitchen first (536 TFLOP/s on an RTX 5090 D v2, about sage's fp8-PV
    speed there; sage2_sm80 has no published number on sm_120), then sage2_sm80, then ComfyUI's own.
    Preflight's line is the same order."""
    from safe_ops.ui.preflight_text import preflight_report
    E.comfy_flags(packages, "sage")
    rt = E.runtime(E.RTX5090)
    att = node(rt)
    assert att.quality_order(None) == ["sage2_sm120_fp8pv", "ck_int8", "sage2_sm80"]
    assert att.candidates(None) == ["sage2_sm120_fp8pv", "sdpa", "ck_int8"]
    assert _decide(att.quality_order(None), {"sage2_sm80": 0.03, "ck_int8": 0.015}).family == "ck_int8"
    text = preflight_report(1664, 960, 362, ref_images=3, rt=rt, free_bytes=28 * 2**30)["text"]
    line = next(ln for ln in text.splitlines() if ln.startswith("quality guard (balanced)"))
    assert line == ("quality guard (balanced): blocks run sage2_sm120_fp8pv; a block over its target moves to "
                    "ck_int8, else sage2_sm80, else ComfyUI's own attention (the first of these under its target, "
                    "measured at step 1; ComfyUI's own attention is the reference)"), line


@pytest.mark.parametrize("gpu, planned, targets", [
    (E.RTX4090, "sage2_sm89_fp8pv", ["sage2_sm80", "ck_int8"]),
    (E.RTX5090, "sage2_sm120_fp8pv", ["ck_int8", "sage2_sm80"]),
])
def test_quality_order_comfy_flags_and_sage_policy(packages, gpu, planned, targets):
    """--use-ck-attention: blocks plan comfy-kitchen, which drifts least: nothing to move to but ComfyUI's
    own. Neither flag: ``auto`` runs ComfyUI's own attention -- nothing measured, nothing moved. kernel=sage:
    sage's family whatever the flags, with the same targets as under --use-sage-attention."""
    assert order(packages, gpu, "ck") == ["ck_int8"]
    assert order(packages, gpu, None) == []
    for flag in ("sage", "ck", None):
        assert order(packages, gpu, flag, kernel="sage") == [planned] + targets, flag
    assert order(packages, gpu, "sage", kernel="sdpa") == []


def test_quality_order_measured_gpu_and_the_h100(packages):
    """The H200 (kernel_table.json's sm_90 GPU): ``auto`` plans ComfyUI's own attention (550.6 TFLOP/s,
    the fastest there) -- nothing moves; ``sage`` plans sage2_sm90 and moves by measured speed (ck_int8
    478.6 > sage2_sm80 459.7), the quantised kernels before SDPA as the policy says; the fp8-PV families
    the table also verified there (sage2_sm89_fp8pv, sage2_fp8pv_perwarp) drift as much as sage2_sm90
    and the per-block sage2_sm86_triton more: not targets. The H100 (same arch, speed unmeasured) with
    --use-sage-attention: sage2_sm90, then the arch's table ranks ck_int8 before sage2_sm80."""
    for flag in ("sage", "ck", None):
        assert order(packages, E.H200, flag) == [], flag
    assert order(packages, E.H200, "sage", kernel="sage") == ["sage2_sm90", "ck_int8", "sage2_sm80"]
    assert order(packages, E.H100, "sage") == ["sage2_sm90", "ck_int8", "sage2_sm80"]
    assert not node(E.runtime(E.H100)).kernels["sage2_sm80"].move_only      # a planning family there already


def test_quality_order_measured_gpu_auto_keeps_only_what_beats_sdpa(packages):
    """``auto`` on a measured GPU moves a block only to a family measured faster than ComfyUI's own there
    (a table where sage's dispatch family is fastest, sage2_sm80 beats SDPA and comfy-kitchen does not)."""
    table = {"archs": {"sm_90": {"gpu": "NVIDIA H200", "tflops": {
        "sage2_sm90": 700.0, "sage2_sm80": 600.0, "sdpa": 550.0, "ck_int8": 478.0}}}}
    packages.setattr("safe_ops.facts.kernel_table.kernel_table", lambda: table)
    assert order(packages, E.H200, None) == ["sage2_sm90", "sage2_sm80"]
    assert order(packages, E.H200, None, kernel="sage") == ["sage2_sm90", "sage2_sm80", "ck_int8"]


def test_quality_order_cpu_no_sage_and_sage1(packages):
    """No move targets, nothing moves: a machine without CUDA, or an RTX card without sageattention
    (--use-sage-attention then runs ComfyUI's own). sage 1.0.6 (its own per-block kernel, drifting most):
    comfy-kitchen only -- sage 2's sage2_sm80 is not in that build."""
    cpu = E.runtime((None, None), sage=None, ck=None)
    for kernel in ("auto", "sage"):
        E.comfy_flags(packages, "sage")
        assert node(cpu, kernel).quality_order(None) == [], kernel
    assert order(packages, E.RTX4090, "sage", sage=None) == []
    assert order(packages, E.RTX4090, "ck", sage=None) == ["ck_int8"]
    assert order(packages, E.RTX4090, "sage", sage="1.0.6") == ["sage1_triton", "ck_int8"]
    assert order(packages, E.RTX4090, "sage", ck=None) == ["sage2_sm89_fp8pv", "sage2_sm80"]


def test_every_shipped_family_has_a_drift_rank():
    """move_order keeps a target only if it drifts less than the planned family: every shipped family
    states how much (KernelFamily.drift_rank, documented in move_order.DRIFT_RANKS)."""
    from safe_ops.attention.move_order import DRIFT_RANKS
    from safe_ops.families import registry
    for module in registry.SHIPPED:
        for f in registry.families_of(module):
            if f.kind != "sdpa":
                assert f.drift_rank in DRIFT_RANKS, f.name


# ------------------------------------------------------------------------------------------------
USING_ROWS = [  # (GPU, its emulation, ComfyUI's flag, the flag in words, kernel)
    ("RTX 40xx (sm_89)", E.RTX4090, "sage", SAGE_FLAG, "auto"), ("RTX 40xx (sm_89)", E.RTX4090, "ck", CK_FLAG, "auto"),
    ("RTX 40xx (sm_89)", E.RTX4090, None, "neither", "auto"),
    ("RTX 50xx (sm_120)", E.RTX5090, "sage", SAGE_FLAG, "auto"), ("RTX 50xx (sm_120)", E.RTX5090, "ck", CK_FLAG, "auto"),
    ("RTX 50xx (sm_120)", E.RTX5090, None, "neither", "auto"),
    ("H100 (sm_90)", E.H100, "sage", SAGE_FLAG, "auto"), ("H200 (sm_90, measured)", E.H200, "sage", "any", "auto")]
DESIGN_ROWS = USING_ROWS + [
    ("RTX 30xx (sm_86)", E.RTX3090, "sage", SAGE_FLAG, "auto"), ("A100 (sm_80)", E.A100, "sage", SAGE_FLAG, "auto"),
    ("RTX 40xx (sm_89), `kernel` `sage`", E.RTX4090, None, "any", "sage"),
    ("RTX 50xx (sm_120), `kernel` `sage`", E.RTX5090, None, "any", "sage"),
    ("H100 / H200 (sm_90), `kernel` `sage`", E.H200, None, "any", "sage")]


@pytest.mark.parametrize("doc, rows", [("docs/USING.md", USING_ROWS), ("docs/DESIGN.md", DESIGN_ROWS)])
def test_quality_order_docs_carry_the_orders_move_order_makes(packages, doc, rows):
    """docs/USING.md's "Where a block moves" table (sage 2.2.0 + comfy-kitchen 0.2.40, the node's defaults) and
    docs/DESIGN.md's are what move_order makes of those setups: USING.md's word that a drifting block
    moves to comfy-kitchen is true where the table says so, and checked here."""
    from safe_ops.attention.move_order import table_markdown
    if doc == "docs/DESIGN.md":                  # kernel=sage on the H100 and the H200: one order
        assert order(packages, E.H100, None, kernel="sage") == order(packages, E.H200, None, kernel="sage")
    want = table_markdown([(label, flags, order(packages, gpu, flag, kernel=kernel))
                           for label, gpu, flag, flags, kernel in rows])
    text = (REPO / doc).read_text()
    assert want in text, f"{doc} is stale; its move-order table should read:\n{want}"
