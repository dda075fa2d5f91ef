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

from ..attention.call_forms import BASE_KEY
from ..attention.errors import is_oom
from ..facts import compiler
from ..ui import run_stats
from . import memory, outcome, targets
from .report import entry, predicted_cost, publish, report, runs_now, send_outcome  # noqa: F401 (report, runs_now: the override's)
from .probe import reference, rel_error, sample_rows

log = logging.getLogger("SafeSage")

STATS = run_stats.Section("quality", ("probes", "report_probes", "inconclusive", "host_reads", "plan_changes",
                                        "blocks_moved", "moved_calls", "moved_fallbacks", "exact_calls",
                                        "forwards_without_step", "recalled_blocks", "probes_skipped"))
PLANNED, PROBE, REPORT, CHOSEN, EXACT = "planned", "probe", "report", "chosen", "exact"
RUNS_KEPT = 4
_GUARDS: "weakref.WeakSet[QualityGuard]" = weakref.WeakSet()
_RUN = threading.local()       # .key: the model the calling thread samples (memory.ModelKey), set per run


def run_started(model_patcher) -> None:
    """A sampling run of ``model_patcher`` starts on this thread (patch.py's OUTER_SAMPLE wrapper, from
    ComfyUI's CFGGuider): what the guard measured for that model is remembered under its key
    (memory.py). Host only."""
    _RUN.key = memory.model_key(model_patcher) if model_patcher is not None else None


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
    costs: dict = field(default_factory=dict)   # family -> predicted time vs the policy's plan (speed_budget)
    floor: float = 0.0               # the reference's own error in the call's dtype (targets.REFERENCE_FLOOR)
    budget: float = 1.0              # the speed budget it was measured under


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
    key: object = None               # memory.ModelKey of the sampled model (None: nothing remembered)
    site: object = None              # the kernel builds the errors were measured on (SafeAttention.kernel_sites)
    recalled: dict = field(default_factory=dict)  # klass -> blocks whose choices came from memory this run
    skipped: bool = False            # the probe was skipped (no guarded step after it): counted once
    report: list = field(default_factory=list)    # this run's choices (targets.Choice), measured or remembered
    sources: set = field(default_factory=set)     # where they came from: "measured", "remembered"
    budget: float = 1.0              # the speed budget the choices were made under
    speeds: dict = field(default_factory=dict)    # family -> its speed's provenance (speed_budget.speed_sources)
    published: bool = False          # a later step's report was published


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
        #: the model's blocks are marked by SafeSage (blocks.install_block_index): each forward starts
        #: with blocks.BASE_KEY unset (:meth:`forward_start`), and a call is block i only inside the base
        #: block i (another tower's calls, under the same index or none, are not measured)
        self.base_marked = False
        #: ComfyUI's id of the SafeSage node this guard belongs to (its report is that node's: report.py)
        self.node: str | None = None
        if self.active:
            _GUARDS.add(self)

    # ---------------------------------------------------------------- the run
    def state(self) -> RunState | None:
        """The calling thread's run, when a forward of it has started (hot path: one thread-local
        read; set by :meth:`forward_start`, cleared by :meth:`run_end`)."""
        return getattr(self._local, "st", None)

    def forward_start(self, transformer_options: dict | None, site: object = None) -> None:
        """A diffusion-model forward begins (eager: patch.py's APPLY_MODEL wrapper): which step it is,
        and -- after a measured step -- the choices, in one host read. ``site``: the kernel builds of
        the SafeAttention whose model runs (what remembered errors are keyed on)."""
        rid = compiler.run_id()
        st = self._runs.get(rid)
        if st is None:
            st = RunState(rid, key=getattr(_RUN, "key", None), site=site)
            with self._lock:
                self._runs[rid] = st
                run_stats.trim(self._runs, RUNS_KEPT)
        self._local.st = st
        st.ordinal = 0
        to = transformer_options or {}
        if self.base_marked and isinstance(transformer_options, dict):
            transformer_options[BASE_KEY] = None      # no base block runs yet (TokenRefiner, towers before it)
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
            if self.quality == "faults only":
                return REPORT if self.probe_step == st.step else PLANNED
            if steps and st.step >= steps - n and self.probe_step != st.step:
                if not st.skipped:
                    st.skipped = True
                    STATS.bump("probes_skipped")
                return PLANNED          # no guarded step follows it: a measurement could change nothing
            return PROBE
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
            if self.measuring and not st.report and not st.published:
                # nothing measured in this run: the node does not show an earlier run's outcome as this one's
                publish("none", {"reason": "nothing measured (no sampling step after the probe step)" if st.skipped
                                 else "nothing measured in this run"}, self.node, st.run)
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
        to = transformer_options if isinstance(transformer_options, dict) else {}
        bi = to.get("block_index")
        if BASE_KEY in to:          # SafeSage marks the base model's blocks (blocks.py): only their calls count
            base = to[BASE_KEY]
            return bi if type(bi) is int and base == bi else None
        o = st.ordinal
        st.ordinal = o + 1
        return bi if type(bi) is int else o

    def measure(self, att, st: RunState, block: int, klass: str, n, func, plan, out: torch.Tensor) -> None:
        """Step 1 (or the report step): the block's error on sampled rows, and at step 1 the
        candidates' errors on the same rows. Pending on the device until the step ends; an
        out-of-memory makes this block's verdict inconclusive (it keeps its plan)."""
        key = (block, klass)
        if block is None or key in st.seen:
            return                      # another tower's call (blocks.py), or measured already
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
        p = n.prepared
        if not st.speeds and att.speed_budget() > 1.0:
            st.speeds = att.speed_sources()
        st.pending.append(_Pending(block, klass, plan.kernel, err, cands, st.mode == PROBE, order,
                                   _ceiling(att, plan.kernel), att.speed_costs(p) if p is not None else {},
                                   targets.REFERENCE_FLOOR.get(str(n.q.dtype).replace("torch.", ""), 0.0),
                                   att.speed_budget()))

    def recalled(self, att, st: RunState, block, p, func) -> bool:
        """At the measured step of a run: whether ``block``'s calls of ``p``'s class have choices from
        errors an earlier run measured on this model (memory.py): then they run those choices from step
        1 and are not measured again. The class's remembered blocks are decided at its first call of the
        run (targets.decide with this run's budget, kernels and plans: host floats only)."""
        if block is None or st.key is None:
            return False
        blocks = st.recalled.get(p.klass)
        if blocks is None:
            blocks = st.recalled[p.klass] = self._decide_recalled(att, st, p, func)
        if block in blocks:
            st.seen.add((block, p.klass))
            return True
        return False

    def _decide_recalled(self, att, st: RunState, p, func) -> frozenset:
        mem = memory.recall(st.key, st.site, p.klass)
        if not mem:
            return frozenset()
        st.budget = att.speed_budget()
        if not st.speeds and st.budget > 1.0:
            st.speeds = att.speed_sources()
        planned = p.plan.kernel
        costs = att.speed_costs(p)
        floor = targets.REFERENCE_FLOOR.get(p.call.dtype, 0.0)
        measured = []
        for block, (was, errs) in sorted(mem.items()):
            ran = planned if errs.get(planned) is not None else was
            measured.append(targets.BlockErrors(block, p.klass, ran, errs.get(ran),
                                                {f: e for f, e in errs.items() if f != ran}, costs, floor))
        ceilings = {m.planned: _ceiling(att, m.planned) for m in measured}
        choices = targets.decide(measured, self.quality, att.quality_order(func),
                                 {f: c for f, c in ceilings.items() if c is not None}, st.budget)
        STATS.bump("recalled_blocks", len(choices))
        self._chose(st, choices, "remembered")
        return frozenset(mem)

    def _chose(self, st: RunState, choices: list, source: str) -> None:
        """This run's choices for the blocks in ``choices`` (measured now, or remembered): held from the
        next step (measured) or from now (remembered), counted and published."""
        # (block, class) -> the families it runs, in order: the choice, then the others under its
        # target (the override takes the first that can run the call; ComfyUI's own after them)
        st.choices.update({(c.block, c.klass): (c.family,) + tuple(c.alternatives) for c in choices if c.moved})
        moved = sum(c.moved for c in choices)
        if moved:
            STATS.bump("plan_changes")
            STATS.bump("blocks_moved", moved)
        st.report.extend(choices)
        st.sources.add(source)
        blocks = [entry(c) for c in st.report]
        lines = outcome.lines(blocks)
        publish("choices", {"quality": self.quality, "blocks": blocks, "lines": lines,
                            "source": "+".join(sorted(st.sources)), "budget": st.budget,
                            "cost": predicted_cost(st.report),
                            "speeds": {f: st.speeds[f] for f in sorted({c.family for c in st.report} |
                                                                       {c.planned for c in st.report})
                                       if f in st.speeds}}, self.node, st.run)
        log.info("SafeSage quality guard (%s, %s errors): %s", self.quality, source, "; ".join(lines))

    def _conclude(self, st: RunState, pend: list, values: dict) -> None:
        """The measured step's errors are on the host: choose (step 1) or report (a later step)."""
        def measured(items):
            out = []
            for i, pb in items:
                e = values.get(("e", i, None))
                cands = {f: (values[("e", i, f)][0] if ("e", i, f) in values else None) for f in pb.candidates}
                out.append(targets.BlockErrors(pb.block, pb.klass, pb.family, e[0] if e else None, cands,
                                               pb.costs, pb.floor))
            return out
        probed = [(i, pb) for i, pb in enumerate(pend) if pb.probe]
        later = [(i, pb) for i, pb in enumerate(pend) if not pb.probe]
        if probed and not st.decided:
            ceilings = {pb.family: pb.ceiling for _, pb in probed if pb.ceiling is not None}
            blocks = measured(probed)
            st.budget = probed[0][1].budget
            choices = targets.decide(blocks, self.quality, probed[0][1].order, ceilings, st.budget)
            st.decided = True
            for m in blocks:             # errors, not choices: a later run decides again with its own budget
                if m.error is not None:
                    memory.remember(st.key, st.site, m.block, m.klass, m.planned, {m.planned: m.error, **m.candidates})
            self._chose(st, choices, "measured")
        if later:
            st.published = True
            publish("later", {"step": st.step, "blocks": [
                {"block": m.block, "family": m.planned, "error": None if m.error is None else round(float(m.error), 5)} for m in measured(later)]},
                    self.node, st.run)


def run_ended() -> None:
    """The calling thread's sampling run ended (patch.py's OUTER_SAMPLE wrapper, before the run id
    moves on): every guard with state for it reads what is pending and forgets the run; then what
    this run published goes to the frontend as one ``safesage.quality`` event (report.send_outcome)."""
    try:
        for g in list(_GUARDS):
            g.run_end()
    finally:
        _RUN.key = None
        send_outcome()


def _ceiling(att, family: str) -> float | None:
    """``family``'s targets.family_ceiling on ``att``'s kernels (None: not installed there)."""
    kern = att.kernels.get(family)
    tol = getattr(kern, "tolerance", None)
    return targets.family_ceiling(tol, getattr(kern, "benign_error", None)) if tol is not None else None
