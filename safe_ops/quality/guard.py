"""The quality guard over one sampling run: measure at step 1, choose once, hold the choices.

* **Step 1** (the forwards at the schedule's first sigma; with ``exact_steps`` N, step N+1: the
  first step that runs guarded kernels) runs every block as planned while
  :meth:`QualityGuard.measure` takes each guarded call's error on sampled rows (probe.py) and,
  for ``balanced``/``strict``, the other candidate families' errors on the same rows. Nothing is
  read back to the host during the step.
* **The end of step 1** (the next forward's start, or the run's end): one host read of every
  error; :func:`targets.decide` chooses each block's family; the choices hold from step 2 to the
  end of the run -- plans change at most once per run (under ComfyUI's allocation compiler that
  is one re-record, counted as ``quality.plan_changes``). Step 1 is not recomputed.
* **An optional later step** (``quality_probe_step``) is measured the same way, without
  candidates; it only reports.
* **exact steps** (``exact_steps`` N): the first and last N steps run ComfyUI's own attention.

The step comes from ComfyUI's ``transformer_options["sigmas"]`` against
``transformer_options["sample_sigmas"]``, read once per forward by patch.py's APPLY_MODEL wrapper
together with any pending errors: one host read per forward, only while the guard is on. That
wrapper runs eagerly also under ComfyUI's TorchCompileModel, which compiles the diffusion model
inside an APPLY_MODEL wrapper of its own (a DIFFUSION_MODEL wrapper would be traced there: HAZARDS
H-10). A run is ``facts.compiler.run_id()`` (the calling thread's sampling run; patch.py's
OUTER_SAMPLE wrapper ends it). Under torch.compile the measurement runs inside SafeSage's opaque
op (its body is eager) and the moved blocks' plans are chosen there, so a compiled model is
measured at step 1 and runs the choices from step 2 with no graph break added; during CUDA-graph
capture nothing here runs (special_calls.py).
Everything is counted in the ``quality`` section of the run statistics, and the last run's choices
are kept for the node's status, ``/safesage/stats`` and the stats panel (:func:`report`).
"""
from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass, field

import torch

from ..attention.errors import is_oom
from ..facts import compiler
from ..ui import run_stats
from . import targets
from .probe import reference, rel_error, sample_rows

log = logging.getLogger("SafeSage")

STATS = run_stats.Section("quality", ("probes", "report_probes", "inconclusive", "host_reads", "plan_changes",
                                        "blocks_moved", "moved_calls", "moved_fallbacks", "exact_calls",
                                        "forwards_without_step"))
PLANNED, PROBE, REPORT, CHOSEN, EXACT = "planned", "probe", "report", "chosen", "exact"
RUNS_KEPT = 4
#: how a run's choices are shown (``/safesage/stats`` ``quality.last_run``)
_LAST: dict = {}
_LAST_LOCK = threading.Lock()
_GUARDS: "weakref.WeakSet[QualityGuard]" = weakref.WeakSet()


@dataclass
class _Pending:
    block: int
    klass: str
    family: str
    error: torch.Tensor | None
    candidates: dict                 # family -> 0-d tensor or None
    probe: bool                      # step 1 (choose) or the report step (report only)
    order: list                      # the families it may move to, fastest first
    ceiling: float | None = None     # the planned kernel's targets.family_ceiling (decide's ceiling)


@dataclass
class RunState:
    run: int
    schedule: list | None = None     # the run's sigmas (host floats), when ComfyUI hands them
    last_sigma: float | None = None
    step: int = 0                    # 1-based
    mode: str = PLANNED
    ordinal: int = 0                 # attention calls so far in this forward (blocks without an index)
    pending: list = field(default_factory=list)
    seen: set = field(default_factory=set)        # (block, klass) measured at the current step
    choices: dict = field(default_factory=dict)   # (block, klass) -> (family, alternatives...) from step 2 on
    decided: bool = False
    fell: dict = field(default_factory=dict)      # (block, klass) -> what runs a moved block now (runs_now)


class QualityGuard:
    """Per SafeSage node (shared by its per-GPU SafeAttentions); see the module docstring."""

    def __init__(self, quality: str = targets.DEFAULT_QUALITY, probe_step: int = 0, exact_steps: int = 0):
        self.quality = quality
        self.probe_step = int(probe_step)
        self.exact_steps = int(exact_steps)
        self.measuring = quality != "faults only" or self.probe_step > 0
        self.active = self.measuring or self.exact_steps > 0
        self._runs: dict[int, RunState] = {}
        self._lock = threading.Lock()
        self._local = threading.local()     # .st: the calling thread's run once a forward of it started
        if self.active:
            _GUARDS.add(self)

    # ---------------------------------------------------------------- the run
    def state(self) -> RunState | None:
        """The calling thread's run, when a forward of it has started (hot path: one thread-local
        read; set by :meth:`forward_start`, cleared by :meth:`run_end`)."""
        return getattr(self._local, "st", None)

    def forward_start(self, transformer_options: dict | None) -> None:
        """A diffusion-model forward begins (eager: patch.py's APPLY_MODEL wrapper): which step it is,
        and -- after a measured step -- the choices, in one host read."""
        rid = compiler.run_id()
        st = self._runs.get(rid)
        if st is None:
            st = RunState(rid)
            with self._lock:
                self._runs[rid] = st
                run_stats.trim(self._runs, RUNS_KEPT)
        self._local.st = st
        st.ordinal = 0
        to = transformer_options or {}
        sigma, sched = to.get("sigmas"), to.get("sample_sigmas") if st.schedule is None else None
        values = self._read(st, sigma, sched)
        s = values.get("sigma")
        if sched is not None and values.get("schedule"):
            st.schedule = values["schedule"]
        if s is None:
            st.step, st.mode = 0, PLANNED           # no step known: faults only for this forward
            run_stats.once(("quality-no-step",), logging.WARNING,
                           "SafeSage: the quality guard found no sampling step in this forward (no "
                           "transformer_options['sigmas']); it is off for such forwards")
            STATS.bump("forwards_without_step")
            return
        new_step = st.last_sigma is None or s != st.last_sigma
        if new_step:
            st.step = self._step_of(st, s)
            st.last_sigma = s
            st.seen = set()
        st.mode = self._mode(st)

    def _step_of(self, st: RunState, sigma: float) -> int:
        if st.schedule:
            i = min(range(len(st.schedule)), key=lambda j: abs(st.schedule[j] - sigma))
            return i + 1
        return st.step + 1

    def _mode(self, st: RunState) -> str:
        steps = len(st.schedule) - 1 if st.schedule else 0
        n = self.exact_steps
        if n and (st.step <= n or (steps and st.step > steps - n)):
            return EXACT
        if not self.measuring:
            return PLANNED
        if st.step == n + 1:            # the first step that runs guarded kernels
            return PROBE if self.quality != "faults only" else (REPORT if self.probe_step == st.step else PLANNED)
        if st.step == self.probe_step:
            return REPORT
        return CHOSEN if st.choices else PLANNED

    def run_end(self) -> None:
        """The sampling run ended: read what is pending (one host read), then forget the run."""
        rid = compiler.run_id()
        st = self._runs.get(rid)
        self._local.st = None
        if st is None:
            return
        try:
            if st.pending:
                self._read(st, None, None)
        finally:
            with self._lock:
                self._runs.pop(rid, None)

    def _read(self, st: RunState, sigma, schedule) -> dict:
        """One host read of the step's sigma, the schedule (once per run) and the pending errors."""
        parts: list = []
        if isinstance(sigma, torch.Tensor) and sigma.numel():
            parts.append(("sigma", sigma.reshape(-1)[:1].float()))
        if isinstance(schedule, torch.Tensor) and schedule.numel():
            parts.append(("schedule", schedule.reshape(-1).float()))
        pend = st.pending
        st.pending = []
        for i, pb in enumerate(pend):
            if pb.error is not None:
                parts.append((("e", i, None), pb.error.reshape(1)))
            for fam, t in pb.candidates.items():
                if t is not None:
                    parts.append((("e", i, fam), t.reshape(1)))
        out: dict = {}
        if not parts:
            return out
        by_dev: dict = {}
        for key, t in parts:
            by_dev.setdefault(t.device, []).append((key, t))
        for dev, items in by_dev.items():
            flat = torch.cat([t.to(torch.float32) for _, t in items]).tolist()   # the one read per device
            if dev.type != "cpu":
                STATS.bump("host_reads")
            pos = 0
            for key, t in items:
                n = t.numel()
                out[key] = flat[pos:pos + n]
                pos += n
        if "sigma" in out:
            out["sigma"] = out["sigma"][0]
        if pend:
            self._conclude(st, pend, out)
        return out

    # ---------------------------------------------------------------- measuring
    def count_call(self, transformer_options) -> None:
        """A call of this forward that no guarded kernel takes, passed on without being read: it
        still counts in the n-th-call numbering of blocks (:meth:`block_of`)."""
        st = self.state()
        if st is not None and st.mode is not PLANNED:
            self.block_of(st, transformer_options)

    def block_of(self, st: RunState, transformer_options) -> int:
        """The block a call belongs to: ComfyUI's ``block_index`` (SafeSage fills it in for H3,
        blocks.py), else the n-th attention call of this forward (counted in a forward whose mode
        uses blocks: not in a PLANNED one, where every call runs its plan as it is)."""
        bi = transformer_options.get("block_index") if isinstance(transformer_options, dict) else None
        o = st.ordinal
        st.ordinal = o + 1
        return bi if type(bi) is int else o

    def measure(self, att, st: RunState, block: int, klass: str, n, func, plan, out: torch.Tensor) -> None:
        """Step 1 (or the report step): the block's error on sampled rows, and at step 1 the
        candidates' errors on the same rows. Pending on the device until the step ends; an
        out-of-memory makes this block's verdict inconclusive (it keeps its plan)."""
        key = (block, klass)
        if key in st.seen:
            return
        st.seen.add(key)
        try:
            with compiler.paused():
                budget = att.probe_budget(n.q.device)
                rows = sample_rows(n.q.shape[2], n.q.device, block)
                q_rows = n.q.index_select(2, rows)
                ref = reference(att.comfy_runs(func) if func is not None else None, q_rows, n.k, n.v, n.scale, budget)
                err = rel_error(out.index_select(2, rows), ref)
                cands: dict = {}
                order = att.quality_order(func) if st.mode == PROBE else []
                for fam in order:
                    if fam in (plan.kernel, targets.COMFY):
                        continue
                    got = att.run_family_rows(fam, n, q_rows)
                    cands[fam] = rel_error(got, ref) if got is not None else None
        except Exception as e:
            if not is_oom(e):
                raise
            STATS.bump("inconclusive")
            run_stats.once(("quality-oom", plan.kernel), logging.WARNING,
                           "SafeSage: no memory to measure block %d's attention error (%s); it keeps its plan",
                           block, e)
            # listed in the report as inconclusive (targets.decide keeps it as planned)
            st.pending.append(_Pending(block, klass, plan.kernel, None, {}, st.mode == PROBE, []))
            return
        STATS.bump("probes" if st.mode == PROBE else "report_probes")
        kern = att.kernels.get(plan.kernel)
        tol = getattr(kern, "tolerance", None)
        ceiling = targets.family_ceiling(tol, getattr(kern, "benign_error", None)) if tol is not None else None
        st.pending.append(_Pending(block, klass, plan.kernel, err, cands, st.mode == PROBE, order, ceiling))

    def _conclude(self, st: RunState, pend: list, values: dict) -> None:
        """The measured step's errors are on the host: choose (step 1) or report (a later step)."""
        def measured(items):
            out = []
            for i, pb in items:
                e = values.get(("e", i, None))
                cands = {f: (values[("e", i, f)][0] if ("e", i, f) in values else None) for f in pb.candidates}
                out.append(targets.BlockErrors(pb.block, pb.klass, pb.family, e[0] if e else None, cands))
            return out
        probed = [(i, pb) for i, pb in enumerate(pend) if pb.probe]
        later = [(i, pb) for i, pb in enumerate(pend) if not pb.probe]
        if probed and not st.decided:
            ceilings = {pb.family: pb.ceiling for _, pb in probed if pb.ceiling is not None}
            choices = targets.decide(measured(probed), self.quality, probed[0][1].order, ceilings)
            # (block, class) -> the families it runs, in order: the choice, then the others under its
            # target (the override takes the first that can run the call; ComfyUI's own after them)
            st.choices = {(c.block, c.klass): (c.family,) + tuple(c.alternatives) for c in choices if c.moved}
            st.decided = True
            moved = sum(c.moved for c in choices)
            if moved:
                STATS.bump("plan_changes")
                STATS.bump("blocks_moved", moved)
            lines = targets.summary_lines(choices)
            _publish("choices", {"quality": self.quality, "blocks": [_entry(c) for c in choices], "lines": lines})
            log.info("SafeSage quality guard (%s): %s", self.quality, "; ".join(lines))
        if later:
            _publish("later", {"step": st.step, "blocks": [
                {"block": m.block, "family": m.planned, "error": _r(m.error)} for m in measured(later)]})


def run_ended() -> None:
    """The calling thread's sampling run ended (patch.py's OUTER_SAMPLE wrapper, before the run id
    moves on): every guard with state for it reads what is pending and forgets the run; then what
    this run published goes to the frontend as one ``safesage.quality`` event (:func:`_send_outcome`)."""
    try:
        for g in list(_GUARDS):
            g.run_end()
    finally:
        _send_outcome()


def _r(x):
    return None if x is None else round(float(x), 5)


def _entry(c: targets.Choice) -> dict:
    """One (block, class of call) of a run: what was planned and its error, the target, what runs
    from step 2 on (``family``) and its error, whether it moved, why, the candidates' errors, and
    ``alternatives``: the other families under the target it runs, in order, where ``family``
    cannot (failed its check, switched off; ``quality.moved_fallbacks`` counts those calls)."""
    return {"block": c.block, "family": c.family, "error": _r(c.error), "planned": c.planned,
            "planned_error": _r(c.planned_error), "target": _r(c.target), "moved": c.moved, "why": c.why,
            "candidates": {f: _r(e) for f, e in c.candidates.items()}, "call_class": c.klass,
            "alternatives": list(c.alternatives), "runs_now": c.family}


def runs_now(st: RunState, block: int, klass: str, family: str) -> None:
    """A moved block's calls run ``family`` instead of the family chosen for them (it failed its
    first-call check or was switched off; the override's fallback): the last run's report says so
    (``runs_now``), once per change (st.fell)."""
    key = (block, klass)
    if st.fell.get(key) == family:
        return
    st.fell[key] = family
    with _LAST_LOCK:
        for e in (_LAST.get("choices") or {}).get("blocks", []):
            if e["block"] == block and e.get("call_class") == klass:
                e["runs_now"] = family
        run_stats.set_info("quality_last_run", dict(_LAST))


_unsent = False          # published since the last event (under _LAST_LOCK)


def _publish(kind: str, value: dict) -> None:
    global _unsent
    if kind == "choices":
        from .outcome import summary
        line = summary(value.get("blocks", []))
    with _LAST_LOCK:
        if kind == "choices":
            _LAST.pop("later", None)          # a later step's report belongs to the run it was measured in
            _LAST["summary"] = line
        _LAST[kind] = value
        _unsent = True
        run_stats.set_info("quality_last_run", dict(_LAST))


def _send_outcome() -> None:
    """One ``safesage.quality`` event with :func:`report` (per-block choices, the one-line
    summary) when this run published something; nothing without a ComfyUI server (ui/events.py)."""
    global _unsent
    with _LAST_LOCK:
        if not _unsent:
            return
        _unsent = False
    from ..ui import events
    events.send(events.QUALITY, report())


def report() -> dict:
    """The last run's per-block choices, its one-line ``summary`` (and a later step's report), as
    ``/safesage/stats`` (``quality_last_run``) and the ``safesage.quality`` event show them."""
    with _LAST_LOCK:
        return dict(_LAST)
