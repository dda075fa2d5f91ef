"""The quality target and the choice of kernel family per block (pure functions, no torch).

``quality`` on the node:

* ``faults only`` -- today's guard: envelopes and the first-call check (0.05-0.12 rel. L2), no
  per-block measurement.
* ``balanced`` (default) -- a block's target is :data:`BALANCED_FACTOR` x the median error of the
  same kernel family over the run's blocks of the same class of call. Each family's own benign error
  differs (issue #28: sage 2's fp8 PV ~0.039, its fp16 PV ~0.011, comfy-kitchen ~0.017 rel. L2 on
  random H3-shaped inputs), so the target is relative; blocks also differ among themselves as the
  hidden state takes shape. The factor comes from measurement (bench/gpu_quality.py on the H200,
  bench/results/quality_guard_sage22_h200.json and quality_guard_sage106_h200.json, 3 seeds x sage
  1.0.6 and sage 2.2.0's sm_120 and sm_89 paths): benign blocks reach at most 3.70x the run's median,
  blocks with 4 of 128 q/k channels x16 / x32 start at 5.17x; 4.4 is their geometric middle
  (tests/unit/test_quality_targets.py holds the constant between the committed numbers).
  Never above the family's ceiling (:func:`decide`): :data:`CEILING_FACTOR` x the kernel's error on
  random H3-shaped inputs (its worst benign case, flat attention; families' ``benign_error``), at most
  its fault tolerance: a relative target alone moves nothing where most blocks drift.
  A block over its target but under that ceiling stays where the best other fast family measured
  the same rows within a factor :data:`KERNEL_EXCESS` of the planned family's error, either way: where
  fast kernels give the block about the same error (sage 1.0.6's early blocks at 8k tokens:
  0.008-0.010, comfy-kitchen 0.007-0.008 on them), the error comes with the block's inputs, and
  moving it buys little accuracy for the time. A candidate far worse than the planned family (a
  kernel broken on these inputs) says nothing about the block and does not keep it.
* ``strict`` -- :data:`STRICT_FACTOR` x the median, and never above :data:`STRICT_ERROR` (rel. L2
  against ComfyUI's own attention); no evidence asked.

A block over its target moves to the first family of the preference order (fastest first, for
this GPU) whose error on the same rows is under it; when none is, to ComfyUI's own attention
(the reference: under every target).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from ..attention import COMFY   # ComfyUI's own attention (the family name SafeSage gives it)

QUALITY = ("faults only", "balanced", "strict")
DEFAULT_QUALITY = "balanced"
BALANCED_FACTOR = 4.4
STRICT_FACTOR = 2.0
STRICT_ERROR = 0.02
#: a family's ceiling where the caller names none: the default fault tolerance (families.family)
DEFAULT_CEILING = 0.12
#: a family's ceiling: this many times its error on random H3-shaped inputs (:func:`family_ceiling`) --
#: the repro's own rule for a silently wrong output (bench/repro/verdict.py WRONG_FACTOR: 2 x the
#: kernel's in-limit error), applied per block: sage 1.0.6 0.027, sage 2's fp16 PV 0.023, its fp8 PV
#: 0.078-0.079, comfy-kitchen 0.035 (each under its fault tolerance, 0.05 / 0.12)
CEILING_FACTOR = 2.0
#: ``balanced``: a block over its target (and under its ceiling) stays where the best other fast
#: family measured the same rows within this factor of the planned family's error (either way). Fitted on
#: the committed measurements (docs/MEASURED.md, bench.quality_decisions): benign blocks with an
#: error over 0.005 measured at most 1.49x their best candidate (H100 8k default profile; 1.24x on
#: the H200 38k runs), x16/x32 drifting blocks at least 2.45x (4.51x on the H200); 1.9 is the
#: geometric middle of 1.49 and 2.45. Checked on the profiles it was not fitted to (majority,
#: gradual, heads, keys): tests/unit/test_quality_targets.py.
KERNEL_EXCESS = 1.9


@dataclass
class BlockErrors:
    """What step 1 measured on one (block, class of call)."""
    block: int
    klass: str                       # the class of call (without the family)
    planned: str                       # the family the plan ran
    error: float | None                # its error on the sampled rows (None: inconclusive)
    candidates: dict = field(default_factory=dict)   # family -> error on the same rows (None: could not run)


@dataclass
class Choice:
    block: int
    klass: str
    family: str                        # what runs from step 2 on
    error: float | None                # its measured error
    planned: str
    planned_error: float | None
    target: float | None
    why: str
    candidates: dict = field(default_factory=dict)   # what the other families measured on its rows
    #: the other families under the target, in the move order: where ``family`` cannot run a call
    #: (it failed its first-call check, or was switched off), the block runs the first of these that
    #: can, else ComfyUI's own
    alternatives: tuple = ()

    @property
    def moved(self) -> bool:
        return self.family != self.planned


def family_ceiling(tolerance: float, benign_error: float | None) -> float:
    """The most error a block planned on a kernel keeps under ``balanced``, whatever the run's median
    (:func:`decide`'s ceiling): :data:`CEILING_FACTOR` x the kernel's random-input error
    (``Kernel.benign_error``), never above its fault tolerance; the tolerance where no such error is
    known."""
    return tolerance if benign_error is None else min(tolerance, CEILING_FACTOR * benign_error)


def target_for(quality: str, median: float | None, ceiling: float | None = None) -> float | None:
    """A block's target given its family's median error over the run's blocks of its class, never
    above ``ceiling`` (the family's own ceiling: :func:`decide`). With no median (every block of the
    class inconclusive) there is no target."""
    if quality == "faults only" or median is None or not math.isfinite(median):
        return None
    if quality == "strict":
        return min(STRICT_FACTOR * median, STRICT_ERROR)
    target = BALANCED_FACTOR * median
    return target if ceiling is None else min(target, ceiling)


def decide(measured: list[BlockErrors], quality: str, order: list[str],
           ceilings: dict | None = None) -> list[Choice]:
    """One choice per measured (block, class). ``order``: the families to move to, fastest first
    (ComfyUI's own is the last resort whether listed or not).

    ``ceilings``: planned family -> the most error a block of it may keep under ``balanced``,
    whatever the run's median -- the guard hands in each kernel's :func:`family_ceiling`
    (:data:`CEILING_FACTOR` x its random-input error, at most its fault tolerance); a family not in
    it gets :data:`DEFAULT_CEILING`. A relative target alone never moves anything when half
    or more of a class's blocks drift (the median is then the drift: sage 1.0.6's drifting blocks
    measured 0.22-0.66 rel. L2, issue #37); the ceiling moves those blocks. ``strict`` keeps its own
    absolute bound (:data:`STRICT_ERROR`, lower than every ceiling)."""
    ceilings = ceilings or {}
    medians: dict = {}
    for (klass, fam) in {(m.klass, m.planned) for m in measured}:
        errs = [m.error for m in measured if m.klass == klass and m.planned == fam
                and m.error is not None and math.isfinite(m.error)]
        medians[(klass, fam)] = statistics.median(errs) if errs else None
    out = []
    for m in measured:
        ceiling = ceilings.get(m.planned, DEFAULT_CEILING)
        target = target_for(quality, medians[(m.klass, m.planned)], ceiling)
        if m.error is None or target is None:
            why = "inconclusive (kept as planned)" if m.error is None else "no target"
            out.append(Choice(m.block, m.klass, m.planned, m.error, m.planned, m.error, target, why))
            continue
        if m.error <= target:
            out.append(Choice(m.block, m.klass, m.planned, m.error, m.planned, m.error, target,
                              f"{m.planned} {m.error:.3f} within target {target:.3f}"))
            continue
        over = f"{m.planned} {m.error:.3f} over target {target:.3f}"
        shared = _shared_error(m) if quality == "balanced" and m.error <= ceiling else None
        if shared is not None:
            fam, err = shared
            out.append(Choice(m.block, m.klass, m.planned, m.error, m.planned, m.error, target,
                              f"{over}, but {fam} measured {err:.3f} on the same rows: the block's own "
                              f"error, not the kernel's (kept)"))
            continue
        under = [fam for fam in order if fam not in (m.planned, COMFY)
                 and m.candidates.get(fam) is not None and math.isfinite(m.candidates[fam])
                 and m.candidates[fam] <= target]
        if under:
            fam = under[0]
            out.append(Choice(m.block, m.klass, fam, m.candidates[fam], m.planned, m.error, target, over,
                              alternatives=tuple(under[1:])))
        else:
            tried = ", ".join(f"{f} {e:.3f}" if e is not None else f"{f} could not run"
                              for f, e in m.candidates.items())
            out.append(Choice(m.block, m.klass, COMFY, None, m.planned, m.error, target,
                              over + (f"; candidates {tried} not under it" if tried else "; no other candidate")))
    for c, m in zip(out, measured):
        c.candidates = dict(m.candidates)
    return out


def _shared_error(m: BlockErrors) -> tuple | None:
    """(family, error) of the best other fast family measured on ``m``'s rows when its error is
    within a factor :data:`KERNEL_EXCESS` of the planned family's, either way (the error is the
    block's, not the kernel's); None when no other family measured the rows, when the best is
    clearly better (the planned kernel is at fault: the block moves) or when every other is far
    worse (no evidence about the block)."""
    measured = [(e, fam) for fam, e in m.candidates.items()
                if fam not in (m.planned, COMFY) and e is not None and math.isfinite(e)]
    if not measured or not m.error > 0:
        return None
    err, fam = min(measured)
    return (fam, err) if m.error / KERNEL_EXCESS < err < m.error * KERNEL_EXCESS else None


def summary_lines(choices: list[Choice]) -> list[str]:
    """Runs of consecutive blocks with the same outcome, one line each, e.g.
    ``blocks 41-49: ck_int8 -- sage2_sm89_fp8pv 0.051-0.064 over target 0.045``."""
    lines, run = [], []

    def flush():
        if not run:
            return
        c0, c1 = run[0], run[-1]
        span = f"block {c0.block}" if c0.block == c1.block else f"blocks {c0.block}-{c1.block}"
        if not c0.moved:
            errs = [c.planned_error for c in run if c.planned_error is not None]
            tail = (f" ({min(errs):.3f}-{max(errs):.3f}" if errs else " (inconclusive") + (
                f", target {max(c.target for c in run if c.target is not None):.3f})"
                if any(c.target is not None for c in run) else ")")
            lines.append(f"{span}: {c0.family}{tail}")
        else:
            pe = [c.planned_error for c in run]
            tg = [c.target for c in run]
            lines.append(f"{span}: {c0.family} -- {c0.planned} {min(pe):.3f}-{max(pe):.3f} over target "
                         f"{min(tg):.3f}" + (f"-{max(tg):.3f}" if max(tg) - min(tg) >= 5e-4 else ""))
        run.clear()

    for c in sorted(choices, key=lambda c: (c.klass, c.block)):
        if run and (c.family != run[-1].family or c.planned != run[-1].planned or c.klass != run[-1].klass
                    or c.block != run[-1].block + 1):
            flush()
        run.append(c)
    flush()
    return lines
