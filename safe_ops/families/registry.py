"""The kernel families SafeSage knows (one module each, listed here), and which of them run here.

Every shipped family module defines ``KERNEL_FAMILY`` (or ``KERNEL_FAMILIES``): a
:class:`~.family.KernelFamily` with its envelope, adapter, tolerance, archs and kernel-table entry.
This module lists them (:data:`SHIPPED`), registers their envelopes (``envelope.FAMILIES``) and
answers the questions the rest of the pack asks of a family by name: :func:`family`,
:func:`kernel_of`, :func:`installed_kernels` (what a runtime can run, in ``kernel=sage`` preference
order, and the quality guard's move-only kernels: :func:`move_only_kernels`), :func:`family_kind`,
:func:`table_aliases`, :func:`family_users` (which GPUs and package versions run it, in words).

**Extra families** (tests, the quality guard's fake families, a family under development): the
environment variable ``SAFESAGE_EXTRA_FAMILIES=module.path[,module.path]`` names modules whose
families join the shipped ones when this module is first imported -- in a test process, and in a
ComfyUI server started with it (the module must be importable there: ``PYTHONPATH``). Such a module
defines ``kernel_families(kit)`` returning its families, built from ``kit`` (this package's
types: ``kit.KernelFamily``, ``kit.Envelope``, ``kit.IndexTerm``, ...) so that it needs no import of
the pack, whose package name differs between a checkout and a ComfyUI install. Read by
:func:`extra_family_modules` only: the one environment variable the shipped pack reads, unset in
normal use (tests/unit/test_registry.py pins it). A module that fails to load is logged and skipped.
"""
from __future__ import annotations

import importlib
import logging
import os
import types

from . import (ck_int8, envelope, family as family_mod, rules, sage1, sage2_fp8pv_perwarp, sage2_sm80,
               sage2_sm86_triton, sage2_sm89_fp8pv, sage2_sm90, sage2_sm120_fp8pv, sdpa)
from ..facts.kernel_table import arch_tflops, measured_on
from .envelope import register
from .family import Kernel, KernelFamily
from .rules import KvLenRule
from .sage_dispatch import SAGE1, SAGE_VERSIONS, dispatch_archs, gpu_words, sage_family_for, sageattn_users

log = logging.getLogger("SafeSage")

#: the shipped family modules; adding a family is its module plus its line here
SHIPPED = (sage1, sage2_sm80, sage2_sm86_triton, sage2_sm89_fp8pv, sage2_fp8pv_perwarp, sage2_sm120_fp8pv,
           sage2_sm90, ck_int8, sdpa)
EXTRA_FAMILIES_VARIABLE = "SAFESAGE_EXTRA_FAMILIES"

#: what an extra family module gets to build its families from (``kernel_families(kit)``)
KIT = types.SimpleNamespace(
    KernelFamily=KernelFamily, Kernel=Kernel, DEFAULT_TOLERANCE=family_mod.DEFAULT_TOLERANCE,
    Envelope=envelope.Envelope, IndexTerm=envelope.IndexTerm, AttnCall=envelope.AttnCall,
    TensorDesc=envelope.TensorDesc, Violation=envelope.Violation, check=envelope.check, KvLenRule=rules.KvLenRule,
    sdpa_fn=sdpa.sdpa_fn)


def families_of(module) -> tuple[KernelFamily, ...]:
    """The families a module defines: ``KERNEL_FAMILY`` / ``KERNEL_FAMILIES``, and ``kernel_families(KIT)``."""
    out = list(getattr(module, "KERNEL_FAMILIES", ()))
    if getattr(module, "KERNEL_FAMILY", None) is not None:
        out.append(module.KERNEL_FAMILY)
    make = getattr(module, "kernel_families", None)
    if make is not None:
        out.extend(make(KIT))
    return tuple(out)


def extra_family_modules() -> list[str]:
    """The module paths named by ``SAFESAGE_EXTRA_FAMILIES`` (comma-separated; empty when unset)."""
    return [m.strip() for m in os.environ.get(EXTRA_FAMILIES_VARIABLE, "").split(",") if m.strip()]


def _extra_families() -> list[KernelFamily]:
    out = []
    for name in extra_family_modules():
        try:
            out.extend(families_of(importlib.import_module(name)))
        except Exception as e:  # noqa: BLE001 - a developer's module must not break the pack
            log.warning("SafeSage: %s names %s, which cannot be loaded (%s: %s); its families are left out",
                        EXTRA_FAMILIES_VARIABLE, name, type(e).__name__, e)
    return out


_FAMILIES: dict[str, KernelFamily] = {}
for _f in [f for m in SHIPPED for f in families_of(m)] + _extra_families():
    _FAMILIES[_f.name] = _f
    register(_f.envelope)


def families() -> dict[str, KernelFamily]:
    """Every known family by name (shipped, then extra), in registration order."""
    return dict(_FAMILIES)


def family(name: str | None) -> KernelFamily | None:
    return _FAMILIES.get(name) if name else None


def kernel_of(name: str | None) -> Kernel | None:
    """The family ``name`` as a Kernel, None when unknown or the installed package lacks it."""
    fam = family(name)
    return fam.kernel() if fam is not None else None


def sage_kernel(rt) -> Kernel | None:
    """The installed sageattention as a Kernel: the family ``sageattn`` dispatches to here, or None
    (reason in ``rt.sage_error``)."""
    return kernel_of(rt.sage_family)


def ck_kernel(rt) -> Kernel | None:
    """comfy-kitchen's ``int8_attention`` as a Kernel, or None (reason in ``rt.ck_error``)."""
    return kernel_of(rt.ck_family)


def installed_kernels(rt) -> list[Kernel]:
    """Every usable kernel family here, in ``kernel=sage`` preference order: the family
    ``sageattn`` dispatches to; then (sage 2.2) the other sage-2 families this build runs on
    this arch *that kernel_table.json measured on it* (only verified families are written
    there; an unmeasured family could shadow the dispatch family's evidence-based rules, e.g.
    per_warp FP8-PV on sm_120 without #388's length rule), fastest first; then comfy-kitchen;
    then every family with a ``detect`` of its own that detects this runtime (extra families);
    last, :func:`move_only_kernels` (quality-guard move targets, never planning candidates)."""
    first = sage_kernel(rt)
    out = [first]
    if (first is not None and first.family != SAGE1 and rt.arch is not None
            and not any(isinstance(r, KvLenRule) for r in first.envelope.extra_rules)):
        tflops = measured_tflops(rt.arch_name)
        for fam in sorted(tflops, key=lambda f: -tflops[f]):
            f = family(fam)
            if fam != first.family and f is not None and f.runs_here(rt.arch):
                out.append(f.kernel())
    out.append(ck_kernel(rt))
    taken = {kk.family for kk in out if kk is not None}
    for f in _FAMILIES.values():
        if f.detect is not None and f.name not in taken and f.detected(rt):
            out.append(f.kernel())
    out = [kk for kk in out if kk is not None]
    return out + move_only_kernels(rt, {kk.family for kk in out})


def move_only_kernels(rt, taken=frozenset()) -> list[Kernel]:
    """sage 2.2's kernels that drift less than the one ``sageattn`` dispatches to here (a lower
    ``drift_rank``: its int8-QK + fp16-PV ``sage2_sm80`` where the dispatch family is fp8 PV on
    sm_89 / sm_90 / sm_120, or per-block on sm_86) and that this build runs on this arch
    (``runs_on``), not already in ``taken``: each a :class:`Kernel` with ``move_only`` set -- a
    block the quality guard moves may run it (attention.move_order), the planner never offers it
    (PlanChoice.candidates), so planning is what it was without them. It shadows no rule of the
    dispatch family: a block runs it only after step 1 measured it under target on that block's own
    inputs, inside its own envelope, with its own first-call check. Empty without sage 2.2 or a GPU."""
    first = family(rt.sage_family)
    if first is None or first.name == SAGE1 or first.drift_rank is None or rt.arch is None:
        return []
    out = []
    for f in _FAMILIES.values():
        if (f.name not in taken and f.name != first.name and f.kind == "sage" and f.detect is None
                and f.function.startswith("sageattention.sageattn_qk_int8") and f.runs_here(rt.arch)
                and f.drift_rank is not None and f.drift_rank < first.drift_rank):
            kern = f.kernel()
            if kern is not None:
                kern.move_only = True
                out.append(kern)
    return out


def family_kind(name: str) -> str:
    """The kind of kernel a family is -- "sage", "ck" (comfy-kitchen), "sdpa" or the family's own --
    which ``auto`` matches against what ComfyUI itself was started with."""
    f = family(name)
    if f is not None:
        return f.kind
    return "ck" if name.startswith("ck_") else "sdpa" if name == "sdpa" else "sage"


def measured_tflops(arch_name: str) -> dict:
    """kernel_table.json's TFLOP/s on ``arch_name``, every family measured under another's entry filled
    in (comfy-kitchen 0.2.29-0.2.35 and 0.2.36-0.2.40 time the same int8_attention); {} when unmeasured."""
    return arch_tflops(arch_name, table_aliases())


def speed_tflops(arch_name: str, gpu_name: str | None) -> dict:
    """:func:`measured_tflops` where the entry was measured on this GPU model
    (kernel_table.measured_on), else {}: what ``auto`` orders kernels by and plans are priced with.
    Another GPU of the same arch is unmeasured (its SDPA may run at another speed)."""
    return measured_tflops(arch_name) if measured_on(arch_name, gpu_name) else {}


def table_aliases() -> dict[str, str]:
    """Families measured under another family's kernel_table.json entry (the same kernel)."""
    return {f.name: f.table_entry for f in _FAMILIES.values() if f.table_entry != f.name}


def family_users(name: str) -> str:
    """Who runs family ``name``, in Preflight's words: the GPUs and sageattention version whose ``sageattn``
    dispatches to it ("sm_89 (RTX 4090 / L40S) with sageattention 2.2.0"), the comfy-kitchen versions whose
    ``int8_attention`` it is, and the other archs its build carries where SafeSage calls it directly -- as
    the quality guard's move target (it drifts less than what ``sageattn`` runs there:
    :func:`move_only_kernels`) or as a faster kernel kernel_table.json measured there
    (:func:`installed_kernels`: a candidate ``auto`` and ``sage`` may pick). "" for a family none of these runs."""
    from .ck_int8 import VERSION_RANGES, ck_family_for
    f = family(name)
    parts = []
    users = sageattn_users(name)
    if users:
        parts.append(users)
    if name in VERSION_RANGES:
        later = " and any version after 0.2.40 (not read: held to these stricter limits)" \
            if name == ck_family_for("99.0") else ""
        parts.append(f"comfy-kitchen {VERSION_RANGES[name]}{later} int8_attention (ComfyUI --use-ck-attention), "
                     "any GPU")
    if f is not None and f.kind == "sage" and f.runs_on:
        ver = SAGE_VERSIONS[0]
        dispatched = set(dispatch_archs(name, ver))
        moves, faster = [], []
        for arch in f.runs_on:
            if arch in dispatched:
                continue
            first = family(sage_family_for(ver, arch))
            if (first is not None and first.drift_rank is not None and f.drift_rank is not None
                    and f.drift_rank < first.drift_rank):
                moves.append(gpu_words(arch))
            elif name in measured_tflops(f"sm_{arch[0]}{arch[1]}"):
                faster.append(gpu_words(arch))
        if moves:
            parts.append(f"the quality guard's move target on {', '.join(moves)} with sageattention {ver}")
        if faster:
            parts.append(f"a candidate SafeSage calls directly on {', '.join(faster)} with sageattention {ver}, "
                         "where kernel_table.json measured it")
    return "; ".join(parts)
