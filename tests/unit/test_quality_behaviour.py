"""The quality guard's mechanisms that a mutation review found no test holding (issue 45, row 6),
tested by what a user of the node sees -- which kernel each attention call ran (its output, the
fake families' launch counts), which calls ran ComfyUI's own attention, and the run's report in
the statistics -- so that the tests outlive a rewrite of targets.py's rule and guard.py's state:

a. a moved block's fallback order (``Choice.alternatives``): the first family that can run the
   block's calls runs them, the next one under the block's target only where it cannot -- and for a
   block moved within the speed budget (``kernel=auto``), the next least-error family within it;
b. attention calls handed on unread still count in the call-order numbering of blocks (a model
   without ``block_index``): a mask, full precision, a head size no family runs, a form SafeSage
   does not read;
c. the step of a model evaluation comes from the schedule (``sample_sigmas``), not from counting
   sigma changes: a sampler's extra evaluations (DPM2's midpoints, Heun's corrector) shift neither
   ``exact_steps`` nor the measured or reported step, and a midpoint between two scheduled sigmas
   belongs to its own step (guard._step_of);
d. a run that ended leaves nothing behind on its thread: calls after it run as planned, the next
   run measures again (also under the same run id), and a run whose start the guard did not see
   recalls nothing of the previous run's model;

and further mechanisms found unheld while mutating guard.py / override.py by hand: a block's
calls of different classes are measured and moved apart; a forward without a sampling step in
the middle of a run runs as planned. tests/unit/MUTATIONS.md lists each mutation and its test.

Fakes: fake_quality_families.py (fake_sage quantises q/k per token: its error grows with a few
scaled-up q/k channels; fake_kitchen-kind families add a fixed relative error), the helpers of
test_quality_guard.py / test_quality_mechanisms.py. Every threshold here sits between values a
factor of several apart (outlier blocks ~0.06-0.15 rel. L2 on fake_sage, benign ~0.008; the
fake_kitchen-kind families' own errors 0.002 / 0.006 / 0.012 are told apart to 1e-3), so no
CPU's rounding decides a test.
"""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from test_quality_guard import _armed, _with_families, extra_families  # noqa: E402,F401 (a fixture)
from test_quality_guard import choices, end_run, fake_sage_out, rel, stats  # noqa: E402
from test_quality_mechanisms import H, call_blocks, comfy_fn, make, make_blocks, schedule  # noqa: E402

SDPA = torch.nn.functional.scaled_dot_product_attention
NB, SEQ, OUTLIERS = 6, 256, (4, 5)
BENIGN = tuple(b for b in range(NB) if b not in OUTLIERS)


def evaluate(att, sigma, sched, calls):
    """One model evaluation at ``sigma`` (a float, on the schedule or between two of its sigmas) of a
    sampler over ``sched``, as ComfyUI hands it (``sigmas`` / ``sample_sigmas``), through patch.py's
    APPLY_MODEL wrapper's forward start; ``calls``: a list of (q, k, v) blocks (with their
    ``block_index``) or a callable that makes the forward's attention calls."""
    att.quality.forward_start({"sigmas": torch.tensor([float(sigma)]), "sample_sigmas": sched})
    return calls(att) if callable(calls) else call_blocks(att, calls)


def quality():
    return stats()["quality"]


def kitchen_like(out, q, k, v, error):
    """``out`` is a fake_kitchen-kind family's output on (q, k, v): exact attention plus noise of
    relative size ``error`` (each such family here has its own)."""
    return abs(rel(out, SDPA(q, k, v)) - error) < 1e-3


# ------------------------------------------------------------------------------------------------ a. alternatives
# The moved-to families, fastest first: fake_kitchen_b (0.002 on every call), fake_kitchen_c (0.012),
# fake_kitchen (its KITCHEN_ERROR, 0.006): all three under the outliers' target (~0.035), so the
# outliers move to fake_kitchen_b, then fake_kitchen_c, then fake_kitchen.
B_ERR, C_ERR = 0.002, 0.012


def _three_under_target(fq, b_error, c_error=C_ERR):
    att = _with_families(fq, ("fake_kitchen_b", b_error), ("fake_kitchen_c", lambda: c_error))
    assert att.quality_order(None) == [fq.SAGE, "fake_kitchen_b", "fake_kitchen_c", fq.KITCHEN]
    return att


def test_a_moved_block_runs_the_first_family_under_its_target_not_a_later_one(fresh, extra_families):
    """Nothing fails: from step 2 the outliers run fake_kitchen_b (the first under their target) and
    no other moved-to family is launched after step 1's candidate measurement."""
    fq, data = fresh, make_blocks(NB, SEQ, OUTLIERS)
    att = _three_under_target(fq, lambda: B_ERR)
    sched = schedule(3)
    outs = [evaluate(att, sched[0], sched, data)]
    after_step_1 = dict(fq.LAUNCHES)
    outs += [evaluate(att, sched[s], sched, data) for s in (1, 2)]
    end_run()
    assert all(choices()[b]["moved"] for b in OUTLIERS) and not any(choices()[b]["moved"] for b in BENIGN)
    for step in (1, 2):
        for b in OUTLIERS:
            assert kitchen_like(outs[step][b], *data[b], B_ERR), (step, b, rel(outs[step][b], SDPA(*data[b])))
        for b in BENIGN:
            assert rel(outs[step][b], fake_sage_out(fq, *data[b])) < 1e-4, (step, b)
    assert fq.LAUNCHES["fake_kitchen_b"] - after_step_1["fake_kitchen_b"] == 2 * len(OUTLIERS)
    assert fq.LAUNCHES["fake_kitchen_c"] == after_step_1["fake_kitchen_c"], fq.LAUNCHES
    assert fq.LAUNCHES[fq.KITCHEN] == after_step_1[fq.KITCHEN], fq.LAUNCHES


@pytest.mark.parametrize("failure", ["fails its first-call check", "is switched off"])
def test_a_moved_block_whose_family_cannot_run_runs_the_next_under_its_target(fresh, extra_families, failure):
    """fake_kitchen_b, chosen for the outliers, cannot run them from step 2 (its first moved call fails
    its first-call check, or raises an ImportError: a build that cannot run here, switched off): that
    call is recomputed by ComfyUI's own, and every later moved call runs the second family under the
    target, fake_kitchen_c -- not the third (fake_kitchen), which is not launched again."""
    fq, data = fresh, make_blocks(NB, SEQ, OUTLIERS)
    state, err = _armed(B_ERR)
    att = _three_under_target(fq, err)
    sched = schedule(3)
    outs = [evaluate(att, sched[0], sched, data)]
    after_step_1 = dict(fq.LAUNCHES)
    state["armed"] = 0.9 if failure == "fails its first-call check" else ImportError("fake_kitchen_b: no build here")
    outs += [evaluate(att, sched[s], sched, data) for s in (1, 2)]
    end_run()
    assert all(choices()[b]["family"] == "fake_kitchen_b" for b in OUTLIERS), choices()
    first, second = OUTLIERS
    assert torch.equal(outs[1][first], comfy_fn(*data[first], H))          # the failed call: ComfyUI's own
    for step, b in ((1, second), (2, first), (2, second)):
        assert kitchen_like(outs[step][b], *data[b], C_ERR), (step, b, rel(outs[step][b], SDPA(*data[b])))
    assert fq.LAUNCHES["fake_kitchen_b"] - after_step_1["fake_kitchen_b"] == 1
    assert fq.LAUNCHES["fake_kitchen_c"] - after_step_1["fake_kitchen_c"] == 3
    assert fq.LAUNCHES[fq.KITCHEN] == after_step_1[fq.KITCHEN], fq.LAUNCHES


def test_a_moved_block_never_falls_back_to_a_family_over_its_target(fresh, extra_families, monkeypatch):
    """Only fake_kitchen_b is under the outliers' target (fake_kitchen_c and fake_kitchen measure 0.2 on
    their rows, under their first-call tolerance 0.5 but over the target): when fake_kitchen_b fails its
    check, the outliers run ComfyUI's own attention, not a faster family over their target."""
    fq, data = fresh, make_blocks(NB, SEQ, OUTLIERS)
    monkeypatch.setattr(fq, "KITCHEN_ERROR", 0.2)
    state, err = _armed(B_ERR)
    att = _three_under_target(fq, err, c_error=0.2)
    outs, after_step_1 = _failing_from_step_2(fq, att, state, data)
    ch = choices()
    assert all(ch[b]["family"] == "fake_kitchen_b" and ch[b]["candidates"]["fake_kitchen_c"] > ch[b]["target"]
               for b in OUTLIERS), ch
    for step in (1, 2):
        for b in OUTLIERS:
            assert torch.equal(outs[step][b], comfy_fn(*data[b], H)), (step, b)
    assert fq.LAUNCHES["fake_kitchen_c"] == after_step_1["fake_kitchen_c"], fq.LAUNCHES
    assert fq.LAUNCHES[fq.KITCHEN] == after_step_1[fq.KITCHEN], fq.LAUNCHES


# The speed budget's order (kernel=auto): every block moves to the least-error family within the budget,
# fake_kitchen_b (0.002); its alternatives are the other families within the budget with less error than
# the block's planned one, least error first: fake_kitchen (0.006), then fake_kitchen_c (0.012, under the
# outliers' fake_sage error only).
def attention_sage(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                   **kw):
    """Stands for ComfyUI's attention_sage: under ``kernel=auto`` SafeSage reads it as ComfyUI started
    with --use-sage-attention, and plans fake_sage."""
    return SDPA(q, k, v, scale=kw.get("scale"))


@pytest.fixture
def all_within_budget(fresh, extra_families, monkeypatch):
    """Published speeds for the CPU putting fake_kitchen_b, fake_kitchen_c and fake_kitchen within
    ``balanced``'s budget (1.05x) of fake_sage; only fake_sage's random-input error known, so fake_sage
    stays planned until step 1 has measured the blocks."""
    from safe_ops.attention import speed_budget
    from safe_ops.facts import speed_table
    from safe_ops.quality import memory
    fq = fresh
    memory.forget()
    rows = {fq.SAGE: 100.0, "fake_kitchen_b": 99.0, "fake_kitchen_c": 99.0, fq.KITCHEN: 99.0}
    monkeypatch.setattr(speed_table, "_published", lambda: tuple(
        {"arch": "cpu", "family": f, "tflops": t, "gpu": "test", "version": "test", "source": "test"}
        for f, t in rows.items()))
    monkeypatch.setattr(speed_budget, "prior_error", lambda name: 0.04 if name == fq.SAGE else None)
    yield fq
    memory.forget()


def _three_within_budget(fq, b_error):
    from safe_ops.attention.override import SafeAttention
    from safe_ops.facts.devices import Runtime
    from safe_ops.families import envelope, registry
    from safe_ops.policy import Policy
    fams = [fq.make_family(registry.KIT, name, "ck", 0, error=err)
            for name, err in (("fake_kitchen_b", b_error), ("fake_kitchen_c", lambda: C_ERR))]
    for f in fams:
        envelope.register(f.envelope)
    rt = Runtime("test", None, None, None, None, None, "test", None, None, None)
    base = registry.installed_kernels(rt)
    return SafeAttention(Policy(kernel="auto", quality="balanced"), rt=rt,
                         kernels=base[:1] + [f.kernel() for f in fams] + base[1:])


def test_a_block_moved_within_the_speed_budget_falls_back_to_the_next_least_error_family(all_within_budget):
    """fake_kitchen_b, chosen for every block within the speed budget, fails its first-call check from
    step 2: that call is recomputed by ComfyUI's own, and the outliers' later calls run the next
    least-error family within the budget, fake_kitchen (0.006) -- not fake_kitchen_c (0.012), which is
    not launched again after step 1."""
    fq, data = all_within_budget, make_blocks(NB, SEQ, OUTLIERS)
    state, err = _armed(B_ERR)
    att = _three_within_budget(fq, err)

    def calls(att):
        return [att(attention_sage, q, k, v, H, skip_reshape=True, skip_output_reshape=True,
                    transformer_options={"block_index": b}) for b, (q, k, v) in enumerate(data)]

    outs, after_step_1 = _failing_from_step_2(fq, att, state, calls)
    ch = choices()
    assert all(c["planned"] == fq.SAGE and c["family"] == "fake_kitchen_b" and c["rule"] == "budget"
               for c in ch.values()), ch
    assert all(ch[b]["candidates"]["fake_kitchen_c"] < ch[b]["planned_error"] for b in OUTLIERS), ch
    assert torch.equal(outs[1][0], SDPA(*data[0]))              # the failed call: ComfyUI's own
    for step in (1, 2):
        for b in OUTLIERS:
            assert kitchen_like(outs[step][b], *data[b], fq.KITCHEN_ERROR), (step, b, rel(outs[step][b], SDPA(*data[b])))
    assert fq.LAUNCHES["fake_kitchen_c"] == after_step_1["fake_kitchen_c"], fq.LAUNCHES


# ------------------------------------------------------------------------------------------------ b. unread calls
def _unread(kind):
    """An attention call of ``kind`` that no guarded fake family takes: (q, k, v), extra kwargs."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, H, 64, 32, generator=g) for _ in range(3))
    if kind == "masked":                 # no fake family takes a mask: handed on unread
        return (q, k, v), {"mask": torch.zeros(64, 64)}
    if kind == "full precision":         # the model asks for it: handed on unread
        return (q, k, v), {"low_precision_attention": False}
    if kind == "head size":              # no family runs head size 24: read once, then handed on unread
        return tuple(torch.randn(1, H, 64, 24, generator=g) for _ in range(3)), {}
    assert kind == "v head size"         # v's head size differs from q's: a form SafeSage does not read
    return (q, k, torch.randn(1, H, 64, 16, generator=g)), {}


def _with_an_unread_call(data, kind, at):
    """A forward of a model without ``block_index``: the blocks' calls, and ``kind``'s call at
    position ``at``; returns the guarded blocks' outputs in block order."""
    (q, k, v), kw = _unread(kind)

    def calls(att):
        outs = []
        for b, (qq, kk, vv) in enumerate(data):
            if b == at:
                att(comfy_fn, q, k, v, H, skip_reshape=True, skip_output_reshape=True, transformer_options={}, **kw)
            outs.append(att(comfy_fn, qq, kk, vv, H, skip_reshape=True, skip_output_reshape=True,
                            transformer_options={}))
        return outs
    return calls


@pytest.mark.parametrize("kind", ["masked", "full precision", "head size", "v head size"])
def test_calls_handed_on_unread_count_in_the_call_order_numbering(fresh, kind):
    """A model without ``block_index`` makes one call no guarded kernel takes (``kind``) between blocks 2
    and 3 of 6, at every step: the blocks are the 1st-3rd and 5th-7th attention calls of each forward.
    The run's report names them 0-2 and 4-6 (the outliers 5 and 6), and from step 2 the outliers'
    calls -- not their neighbours' -- run the move: also where the unread call was read in full at
    step 1 (a new signature) and handed on by the fast path from step 2 on (``head size``), and where
    it is a form SafeSage does not read at all (``v head size``: handed on at every step)."""
    fq, data = fresh, make_blocks(NB, SEQ, OUTLIERS)
    att = make(quality="balanced")
    calls = _with_an_unread_call(data, kind, at=3)
    sched = schedule(3)
    outs = [evaluate(att, sched[s], sched, calls) for s in range(3)]
    end_run()
    ch = choices()
    position = {b: b + (b >= 3) for b in range(NB)}                # block -> its call's place in the forward
    assert sorted(ch) == sorted(position.values()), sorted(ch)
    assert sorted(p for p, c in ch.items() if c["moved"]) == [position[b] for b in OUTLIERS], ch
    for step in (1, 2):
        for b in OUTLIERS:
            assert kitchen_like(outs[step][b], *data[b], fq.KITCHEN_ERROR), (step, b)
        for b in BENIGN:
            assert rel(outs[step][b], fake_sage_out(fq, *data[b])) < 1e-4, (step, b)


# ------------------------------------------------------------------------------------------------ c. steps
def dpm2(sched):
    """ComfyUI's sample_dpm_2 over ``sched`` (k_diffusion/sampling.py): each step evaluates the model at
    its sigma and at the geometric midpoint towards the next (not a schedule sigma), the last step (to
    sigma 0) once. Yields (step, sigma, on_schedule)."""
    for i in range(len(sched) - 1):
        a, b = float(sched[i]), float(sched[i + 1])
        yield i + 1, a, True
        if b > 0:
            yield i + 1, math.exp((math.log(a) + math.log(b)) / 2), False


def _failing_from_step_2(fq, att, state, data):
    """A 3-step run whose armed family fails its check from step 2 on: the outputs per step and the
    launches counted after step 1."""
    sched = schedule(3)
    outs = [evaluate(att, sched[0], sched, data)]
    after_step_1 = dict(fq.LAUNCHES)
    state["armed"] = 0.9
    outs += [evaluate(att, sched[s], sched, data) for s in (1, 2)]
    end_run()
    return outs, after_step_1


def _outliers_moved(fq, data, outs):
    return all(kitchen_like(outs[b], *data[b], fq.KITCHEN_ERROR) for b in OUTLIERS) and all(
        rel(outs[b], fake_sage_out(fq, *data[b])) < 1e-4 for b in BENIGN)


def _as_planned(fq, data, outs):
    return all(rel(outs[b], fake_sage_out(fq, *data[b])) < 1e-4 for b in range(NB))


def _comfys_own(data, outs):
    return all(torch.equal(outs[b], SDPA(*data[b])) for b in range(NB))


def test_extra_evaluations_between_schedule_sigmas_do_not_shift_exact_steps_at_the_schedules_sigmas(fresh):
    """A 5-step DPM2 run (9 evaluations) with ``exact_steps`` 1: the evaluations at the schedule's sigmas
    run as their step says -- step 1 and step 5 ComfyUI's own, step 2 (the first guarded step) measured
    and run as planned, steps 3-4 the outliers moved. Numbered by sigma changes instead, the midpoints
    would count as steps: step 2's evaluation would be step 3 (the moves) and steps 3-5 exact."""
    fq, data = fresh, make_blocks(NB, SEQ, OUTLIERS)
    att = make(quality="balanced", exact_steps=1)
    sched = schedule(5)
    at = {}                                    # step -> outputs of its evaluation at its schedule sigma
    for step, sigma, on_schedule in dpm2(sched):
        outs = evaluate(att, sigma, sched, data)
        if on_schedule:
            at[step] = outs
    end_run()
    assert _comfys_own(data, at[1]) and _comfys_own(data, at[5])
    assert _as_planned(fq, data, at[2])
    assert _outliers_moved(fq, data, at[3]) and _outliers_moved(fq, data, at[4])
    assert sorted(b for b, c in choices().items() if c["moved"]) == list(OUTLIERS), choices()


def test_extra_evaluations_between_schedule_sigmas_do_not_shift_the_report_step(fresh):
    """``quality_probe_step`` 3 on a 5-step DPM2 run: the report is measured on the inputs of step 3's
    evaluation at its schedule sigma. Block 0 has outlier channels there (and only there), so the report
    shows it over the run's benign level; numbered by sigma changes, step 3 would be step 2's
    evaluation, where block 0 is benign."""
    fq = fresh
    data = make_blocks(NB, SEQ, OUTLIERS)
    step3 = list(data)
    step3[0] = make_blocks(1, SEQ, (0,), seed=5)[0]
    att = make(quality="balanced", probe_step=3)
    sched = schedule(5)
    for step, sigma, on_schedule in dpm2(sched):
        evaluate(att, sigma, sched, step3 if (step, on_schedule) == (3, True) else data)
    end_run()
    later = {e["block"]: e for e in stats()["quality_last_run"]["later"]["blocks"]}
    assert sorted(later) == list(range(NB)), later
    benign = max(later[b]["error"] for b in BENIGN if b != 0)
    assert later[0]["family"] == fq.SAGE and later[0]["error"] > 4 * benign, later


def heun(sched):
    """ComfyUI's sample_heun over ``sched``: each step evaluates the model at its sigma and again (the
    corrector) at the next schedule sigma, the last step (to sigma 0) once. Yields (step, sigma)."""
    for i in range(len(sched) - 1):
        yield i + 1, float(sched[i])
        if float(sched[i + 1]) > 0:
            yield i + 1, float(sched[i + 1])


def test_a_sigma_evaluated_twice_is_measured_once(fresh):
    """A 5-step Heun run (every sigma but the first and the last evaluated twice in a row) with
    ``quality_probe_step`` 3: every block is measured once at step 1 and reported once at step 3, not
    once per evaluation; the outliers move and stay moved through the report step."""
    fq, data = fresh, make_blocks(NB, SEQ, OUTLIERS)
    att = make(quality="balanced", probe_step=3)
    sched = schedule(5)
    last = None
    for _, sigma in heun(sched):
        last = evaluate(att, sigma, sched, data)
    end_run()
    assert quality()["probes"] == NB and quality()["report_probes"] == NB, quality()
    assert len(stats()["quality_last_run"]["later"]["blocks"]) == NB
    assert _outliers_moved(fq, data, last)


def test_a_midpoint_evaluation_belongs_to_its_own_step_exact_steps(fresh):
    """``exact_steps`` 1 on a 5-step DPM2 run: both evaluations of step 1 run ComfyUI's own, step 2's
    (the first guarded step) are measured once, step 4's midpoint runs the moves like step 4."""
    fq, data = fresh, make_blocks(NB, SEQ, OUTLIERS)
    att = make(quality="balanced", exact_steps=1)
    sched = schedule(5)
    mid = {}
    for step, sigma, on_schedule in dpm2(sched):
        outs = evaluate(att, sigma, sched, data)
        if not on_schedule:
            mid[step] = outs
    end_run()
    assert quality()["probes"] == NB, quality()
    assert _comfys_own(data, mid[1]), "step 1's midpoint evaluation did not run ComfyUI's own attention"
    assert _outliers_moved(fq, data, mid[3]) and _outliers_moved(fq, data, mid[4])


def test_a_midpoint_evaluation_belongs_to_its_own_step_report_step(fresh):
    """``quality_probe_step`` 3 on a 5-step DPM2 run: the report step is measured once, at step 3."""
    data = make_blocks(NB, SEQ, OUTLIERS)
    att = make(quality="balanced", probe_step=3)
    sched = schedule(5)
    measured_at = []
    for step, sigma, on_schedule in dpm2(sched):
        before = quality()["report_probes"]
        evaluate(att, sigma, sched, data)
        if quality()["report_probes"] != before:
            measured_at.append((step, on_schedule))
    end_run()
    assert measured_at == [(3, True)], measured_at


# ------------------------------------------------------------------------------------------------ d. run end
def test_calls_after_a_run_ended_run_as_planned(fresh):
    """After a run whose outliers moved has ended, the model's calls outside a sampling run (the model
    called without ComfyUI's sampler: no forward start) run as planned: no move, no measurement."""
    fq, data = fresh, make_blocks(NB, SEQ, OUTLIERS)
    att = make(quality="balanced")
    sched = schedule(2)
    for s in range(2):
        evaluate(att, sched[s], sched, data)
    end_run()
    assert sorted(b for b, c in choices().items() if c["moved"]) == list(OUTLIERS)
    before, launches = quality(), dict(fq.LAUNCHES)
    outs = call_blocks(att, data)
    assert _as_planned(fq, data, outs)
    assert quality() == before, (before, quality())
    assert fq.LAUNCHES[fq.KITCHEN] == launches[fq.KITCHEN]


def test_calls_after_a_run_that_ended_on_its_measured_step_are_not_measured(fresh):
    """A 3-step run cancelled after its measured step 1 (its errors read at the run's end): the choices
    are made then, and calls after the run are not measured, run no candidate and no move.
    (A 1-step run is no such case: its probe is skipped, no guarded step follows it.)"""
    fq, data = fresh, make_blocks(NB, SEQ, OUTLIERS)
    att = make(quality="balanced")
    sched = schedule(3)
    evaluate(att, sched[0], sched, data)
    end_run()
    assert quality()["probes"] == NB and len(choices()) == NB
    launches = dict(fq.LAUNCHES)
    outs = call_blocks(att, data)
    assert _as_planned(fq, data, outs)
    assert quality()["probes"] == NB and fq.LAUNCHES[fq.KITCHEN] == launches[fq.KITCHEN], (quality(), fq.LAUNCHES)


def test_a_run_that_ended_is_forgotten_even_where_the_run_id_stays(fresh):
    """The run's end (quality.guard.run_ended, patch.py's OUTER_SAMPLE wrapper) forgets the run, also
    where the thread's run id does not move on after it (the wrapper's ``compiler.new_run`` failed,
    contained): the next run on the thread -- another latent, its outliers in blocks 0 and 1 -- measures
    again at its step 1, runs it as planned, and from step 2 moves its own outliers, not the first run's."""
    fq = fresh
    first_run, second_run = make_blocks(NB, SEQ, OUTLIERS), make_blocks(NB, SEQ, (0, 1), seed=3)
    from safe_ops.quality import guard
    att = make(quality="balanced")
    sched = schedule(3)
    for s in range(2):
        evaluate(att, sched[s], sched, first_run)
    guard.run_ended()                          # no compiler.new_run() after it
    assert quality()["probes"] == NB
    outs = [evaluate(att, sched[s], sched, second_run) for s in range(3)]
    assert quality()["probes"] == 2 * NB, quality()
    assert _as_planned(fq, second_run, outs[0])
    end_run()
    assert sorted(b for b, c in choices().items() if c["moved"]) == [0, 1], choices()
    for step in (1, 2):
        for b in range(NB):
            if b in (0, 1):
                assert kitchen_like(outs[step][b], *second_run[b], fq.KITCHEN_ERROR), (step, b)
            else:
                assert rel(outs[step][b], fake_sage_out(fq, *second_run[b])) < 1e-4, (step, b)


class _Patcher:
    """What the guard reads of ComfyUI's sampling ModelPatcher: its base model and patches_uuid."""
    def __init__(self, model, uuid):
        self.model, self.patches_uuid = model, uuid


def test_a_run_whose_start_was_not_seen_recalls_nothing_of_the_previous_runs_model(fresh):
    """Run 1 samples model A (patch.py's OUTER_SAMPLE wrapper: guard.run_started), whose errors are
    remembered for A. After it ended, a run of another SafeSage node's model B whose start the guard did
    not see (the wrapper's run_started failed, contained, or B is sampled outside ComfyUI's sampler) is
    not A's run: B's blocks are measured at its step 1, nothing is recalled from A's errors, and B's
    outliers (other blocks than A's) are the ones that move."""
    from safe_ops.quality import guard, memory
    fq = fresh
    memory.forget()
    model_a = torch.nn.Identity()              # a base model (weakly referenced by the memory)
    a_data, b_data = make_blocks(NB, SEQ, OUTLIERS), make_blocks(NB, SEQ, (0, 1), seed=3)
    att_a, att_b = make(quality="balanced"), make(quality="balanced")
    sched = schedule(3)
    try:
        guard.run_started(_Patcher(model_a, "a"))
        for s in range(2):
            evaluate(att_a, sched[s], sched, a_data)
        end_run()
        assert memory.entries() == NB and quality()["probes"] == NB, quality()
        outs = [evaluate(att_b, sched[s], sched, b_data) for s in range(3)]    # no run_started
        end_run()
        assert quality()["probes"] == 2 * NB and quality()["recalled_blocks"] == 0, quality()
        assert memory.entries() == NB              # nothing of B's remembered under A's key
        assert sorted(b for b, c in choices().items() if c["moved"]) == [0, 1], choices()
        assert _as_planned(fq, b_data, outs[0])
    finally:
        memory.forget()


# ------------------------------------------------------------------------------------------------ further
def test_a_blocks_calls_of_two_classes_are_measured_and_moved_apart(fresh):
    """Each of 6 blocks (``block_index``) makes a self-attention call (head size 32) and a cross-attention
    call (head size 64, 64 keys): two classes of call (a class buckets lengths by 4,096 tokens, so the
    head size tells these apart). Only block 2's cross-attention has outlier channels. Both
    classes of every block are measured at step 1 (12 entries in the report); from step 2 block 2's
    cross-attention calls move, its self-attention calls run as planned."""
    fq = fresh
    self_attn = make_blocks(NB, SEQ, ())
    g = torch.Generator().manual_seed(9)
    cross = []
    for b in range(NB):
        q = torch.randn(1, H, SEQ, 64, generator=g)
        k, v = (torch.randn(1, H, 64, 64, generator=g) for _ in range(2))
        if b == 2:
            q[..., :4] *= 64
            k[..., :4] *= 64
        cross.append((q, k, v))

    def calls(att):
        outs = []
        for b in range(NB):
            to = {"block_index": b}
            for q, k, v in (self_attn[b], cross[b]):
                outs.append(att(comfy_fn, q, k, v, H, skip_reshape=True, skip_output_reshape=True,
                                transformer_options=to))
        return outs

    att = make(quality="balanced")
    sched = schedule(2)
    outs = [evaluate(att, sched[s], sched, calls) for s in range(2)]
    end_run()
    entries = stats()["quality_last_run"]["choices"]["blocks"]
    assert len(entries) == 2 * NB and len({(e["block"], e["call_class"]) for e in entries}) == 2 * NB, entries
    assert len({e["call_class"] for e in entries}) == 2, entries
    assert [e["block"] for e in entries if e["moved"]] == [2], entries
    assert kitchen_like(outs[1][2 * 2 + 1], *cross[2], fq.KITCHEN_ERROR)          # block 2's cross-attention
    assert rel(outs[1][2 * 2], fake_sage_out(fq, *self_attn[2])) < 1e-4           # block 2's self-attention


def test_a_forward_without_a_step_in_the_middle_of_a_run_runs_as_planned(fresh):
    """A forward with no ``sigmas`` between steps 2 and 3 of a run whose outliers moved (a model
    evaluation the guard cannot place: it is off for it) runs every call as planned; step 3 runs the
    moves again."""
    fq, data = fresh, make_blocks(NB, SEQ, OUTLIERS)
    att = make(quality="balanced")
    sched = schedule(3)
    evaluate(att, sched[0], sched, data)
    assert _outliers_moved(fq, data, evaluate(att, sched[1], sched, data))
    att.quality.forward_start({"sample_sigmas": sched})           # no sigmas
    assert _as_planned(fq, data, call_blocks(att, data))
    assert _outliers_moved(fq, data, evaluate(att, sched[2], sched, data))
    end_run()
    assert quality()["forwards_without_step"] == 1
