"""The quality guard (safe_ops/quality/) driven through SafeAttention on the CPU, no ComfyUI.

Two fake families (fake_quality_families.py, registered through SAFESAGE_EXTRA_FAMILIES): fake_sage
quantises q/k per token, so its error grows with a few scaled-up q/k channels; fake_kitchen adds a
known relative error KITCHEN_ERROR whatever the data. A stack of NB "blocks" (one attention call
each), blocks OUTLIERS with 2 of 32 q/k channels x32 / x64 (fake_sage ~0.05-0.07 rel. L2 there,
~0.008 on the benign blocks: 6x-9x the run's median, the benign ones within 1.1x of it). The
schedule is handed the way ComfyUI does (``sigmas`` / ``sample_sigmas`` in transformer_options),
and the run ends as patch.py's OUTER_SAMPLE wrapper ends it.
"""
from __future__ import annotations


import pytest

torch = pytest.importorskip("torch")

NB, OUTLIERS, BENIGN = 8, (6, 7), tuple(range(6))
B, H, S, D = 1, 4, 2048, 32
SDPA = torch.nn.functional.scaled_dot_product_attention


def blocks():
    g = torch.Generator().manual_seed(0)
    out = []
    for b in range(NB):
        q, k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(3))
        if b in OUTLIERS:
            f = 32 if b == OUTLIERS[0] else 64
            q[..., :2] *= f
            k[..., :2] *= f
        out.append((q, k, v))
    return out


COMFY_CALLS = []


def comfy_fn(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False, **kw):
    """ComfyUI's own attention (what SafeSage falls back to and measures against)."""
    COMFY_CALLS.append(q.shape[2])
    return SDPA(q, k, v, scale=kw.get("scale"))


def make(**policy):
    from safe_ops.attention.override import SafeAttention
    from safe_ops.facts.devices import Runtime
    from safe_ops.policy import Policy
    rt = Runtime("test", None, None, None, None, None, "test", None, None, None)    # a machine without CUDA
    return SafeAttention(Policy(kernel="sage", **policy), rt=rt)


def schedule(steps):
    return torch.linspace(1.0, 0.0, steps + 1)


def forward(att, data, sched, step, index=True):
    """One model forward at ``step`` (1-based): the APPLY_MODEL wrapper's forward_start, then
    one attention call per block."""
    att.quality.forward_start({"sigmas": sched[step - 1:step].clone(), "sample_sigmas": sched})
    outs = []
    for b, (q, k, v) in enumerate(data):
        to = {"block_index": b} if index else {}
        outs.append(att(comfy_fn, q, k, v, H, skip_reshape=True, skip_output_reshape=True, transformer_options=to))
    return outs


def end_run():
    from safe_ops.facts import compiler
    from safe_ops.quality import guard
    guard.run_ended()
    compiler.new_run()


def sample(att, data, steps, index=True):
    sched = schedule(steps)
    outs = [forward(att, data, sched, s, index) for s in range(1, steps + 1)]
    end_run()
    return outs


def stats():
    from safe_ops.ui import run_stats
    return run_stats.snapshot()


def choices():
    return {c["block"]: c for c in stats()["quality_last_run"]["choices"]["blocks"]}


def rel(a, b):
    return float((a - b).norm() / b.norm())


def fake_sage_out(fq, q, k, v):
    return SDPA(fq.quantise(q, fq.SAGE_LEVELS, -1), fq.quantise(k, fq.SAGE_LEVELS, -1), v)


# ------------------------------------------------------------------------------------------------
def test_outlier_blocks_move_to_kitchen_benign_stay_on_sage_choices_hold(fresh):
    fq, data = fresh, blocks()
    att = make(quality="balanced")
    assert att.quality_order(None) == [fq.SAGE, fq.KITCHEN]
    outs = sample(att, data, 3)
    ch = choices()
    assert sorted(ch) == list(range(NB))
    for b in OUTLIERS:
        assert ch[b]["family"] == fq.KITCHEN and ch[b]["moved"], ch[b]
        assert ch[b]["planned"] == fq.SAGE and ch[b]["planned_error"] > ch[b]["target"] >= ch[b]["error"], ch[b]
    for b in BENIGN:
        assert ch[b]["family"] == fq.SAGE and not ch[b]["moved"], ch[b]
        assert ch[b]["planned_error"] <= ch[b]["target"], ch[b]
    q = stats()["quality"]
    assert q["probes"] == NB and q["plan_changes"] == 1 and q["blocks_moved"] == len(OUTLIERS), q
    assert q["moved_calls"] == len(OUTLIERS) * 2, q            # steps 2 and 3
    # step 1 ran as planned and was not recomputed: one fake_sage launch per block, its output
    for b, (qq, k, v) in enumerate(data):
        exact = SDPA(qq, k, v)
        assert rel(outs[0][b], fake_sage_out(fq, qq, k, v)) < 1e-4, b
        for step in (1, 2):                                    # steps 2 and 3: the choice holds
            if b in OUTLIERS:
                assert abs(rel(outs[step][b], exact) - fq.KITCHEN_ERROR) < 1e-3, (b, step)
            else:
                assert rel(outs[step][b], fake_sage_out(fq, qq, k, v)) < 1e-4, (b, step)
    # the candidates ran on the sampled rows of every block at step 1 only
    assert fq.LAUNCHES[fq.SAGE] == NB + 2 * len(BENIGN), fq.LAUNCHES
    assert fq.LAUNCHES[fq.KITCHEN] == NB + 2 * len(OUTLIERS), fq.LAUNCHES


def test_a_new_run_measures_again(fresh):
    fq, data = fresh, blocks()
    att = make(quality="balanced")
    sample(att, data, 2)
    sample(att, data, 2)
    q = stats()["quality"]
    assert q["probes"] == 2 * NB and q["plan_changes"] == 2 and q["moved_calls"] == 2 * len(OUTLIERS), q
    # the second run's step 1 ran as planned again (fake_sage on every block)
    assert fq.LAUNCHES[fq.SAGE] == 2 * (NB + len(BENIGN)), fq.LAUNCHES


def test_no_candidate_under_target_goes_to_comfys_own(fresh, monkeypatch):
    fq, data = fresh, blocks()
    monkeypatch.setattr(fq, "KITCHEN_ERROR", 0.5)
    att = make(quality="balanced")
    outs = sample(att, data, 2)
    ch = choices()
    for b in OUTLIERS:
        assert ch[b]["family"] == "sdpa" and ch[b]["candidates"][fq.KITCHEN] > ch[b]["target"], ch[b]
        qq, k, v = data[b]
        assert torch.equal(outs[1][b], comfy_fn(qq, k, v, H)), b          # exactly ComfyUI's function's
    for b in BENIGN:
        assert ch[b]["family"] == fq.SAGE, ch[b]
    assert stats()["quality"]["moved_calls"] == len(OUTLIERS)


def test_faults_only_measures_and_moves_nothing(fresh):
    fq, data = fresh, blocks()
    att = make(quality="faults only")
    assert not att.quality.active
    outs = sample(att, data, 3)
    q = stats()["quality"]
    assert q["probes"] == 0 and q["report_probes"] == 0 and q["plan_changes"] == 0 and q["moved_calls"] == 0, q
    assert fq.LAUNCHES[fq.KITCHEN] == 0 and fq.LAUNCHES[fq.SAGE] == 3 * NB, fq.LAUNCHES
    qq, k, v = data[OUTLIERS[-1]]
    assert rel(outs[2][OUTLIERS[-1]], fake_sage_out(fq, qq, k, v)) < 1e-4


def test_exact_steps_run_comfys_own_first_and_last(fresh):
    fq, data = fresh, blocks()
    att = make(quality="faults only", exact_steps=1)
    COMFY_CALLS.clear()
    outs = sample(att, data, 4)
    q = stats()["quality"]
    assert q["exact_calls"] == 2 * NB, q
    assert fq.LAUNCHES[fq.SAGE] == 2 * NB, fq.LAUNCHES          # steps 2 and 3 only
    for step in (0, 3):
        for b, (qq, k, v) in enumerate(data):
            assert torch.equal(outs[step][b], SDPA(qq, k, v)), (step, b)
    for b, (qq, k, v) in enumerate(data):
        assert rel(outs[1][b], fake_sage_out(fq, qq, k, v)) < 1e-4


def test_with_exact_steps_the_first_guarded_step_measures(fresh):
    """exact_steps=1 on a 5-step run: step 1 ComfyUI's own, step 2 measures (as planned), steps 3-4 run the
    choices, step 5 ComfyUI's own again."""
    fq, data = fresh, blocks()
    att = make(exact_steps=1)
    outs = sample(att, data, 5)
    q = stats()["quality"]
    assert q["exact_calls"] == 2 * NB and q["probes"] == NB and q["plan_changes"] == 1, q
    assert q["moved_calls"] == 2 * len(OUTLIERS), q                 # steps 3 and 4
    for b in OUTLIERS:
        qq, k, v = data[b]
        assert rel(outs[1][b], fake_sage_out(fq, qq, k, v)) < 1e-4    # step 2: as planned
        assert abs(rel(outs[2][b], SDPA(qq, k, v)) - fq.KITCHEN_ERROR) < 1e-3


def test_a_later_probe_step_only_reports(fresh):
    fq, data = fresh, blocks()
    att = make(quality="balanced", probe_step=3)
    outs = sample(att, data, 4)
    q = stats()["quality"]
    assert q["probes"] == NB and q["report_probes"] == NB and q["plan_changes"] == 1, q
    assert q["moved_calls"] == 3 * len(OUTLIERS), q           # steps 2, 3 (the report step) and 4
    later = stats()["quality_last_run"]["later"]
    assert later["step"] == 3 and len(later["blocks"]) == NB
    fam = {e["block"]: e["family"] for e in later["blocks"]}
    assert all(fam[b] == fq.KITCHEN for b in OUTLIERS) and all(fam[b] == fq.SAGE for b in BENIGN), fam
    ch = choices()
    assert all(ch[b]["family"] == fq.KITCHEN for b in OUTLIERS), ch
    for b in OUTLIERS:
        qq, k, v = data[b]
        assert abs(rel(outs[2][b], SDPA(qq, k, v)) - fq.KITCHEN_ERROR) < 1e-3, b


def test_out_of_memory_in_the_probe_is_inconclusive_block_keeps_its_plan(fresh, monkeypatch):
    fq, data = fresh, blocks()
    from safe_ops.quality import guard
    real, seen = guard.reference, []

    def oom_on_last_block(fn, q_rows, k, v, scale, max_bytes):
        seen.append(1)
        if len(seen) == NB:                   # step 1's last block (an outlier)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (fake)")
        return real(fn, q_rows, k, v, scale, max_bytes)

    monkeypatch.setattr(guard, "reference", oom_on_last_block)
    att = make(quality="balanced")
    outs = sample(att, data, 2)                 # the call does not fail
    q = stats()["quality"]
    assert q["inconclusive"] == 1 and q["probes"] == NB - 1, q
    ch = choices()
    last = OUTLIERS[-1]
    assert ch[last]["family"] == fq.SAGE and not ch[last]["moved"] and "inconclusive" in ch[last]["why"], ch
    assert ch[OUTLIERS[0]]["family"] == fq.KITCHEN, ch            # the other outlier still moved
    qq, k, v = data[last]
    assert rel(outs[0][last], fake_sage_out(fq, qq, k, v)) < 1e-4
    assert rel(outs[1][last], fake_sage_out(fq, qq, k, v)) < 1e-4  # kept its plan at step 2


def test_out_of_memory_in_a_candidate_is_inconclusive(fresh, monkeypatch):
    fq, data = fresh, blocks()
    from safe_ops.attention.override import SafeAttention

    def oom(self, family, n, q_rows):
        raise torch.OutOfMemoryError("CUDA out of memory (fake)")

    monkeypatch.setattr(SafeAttention, "run_family_rows", oom)
    att = make(quality="balanced")
    outs = sample(att, data, 2)
    q = stats()["quality"]
    assert q["inconclusive"] == NB and q["probes"] == 0 and q["moved_calls"] == 0 and q["plan_changes"] == 0, q
    for b, (qq, k, v) in enumerate(data):
        assert rel(outs[1][b], fake_sage_out(fq, qq, k, v)) < 1e-4, b


def test_without_block_index_the_nth_call_of_the_forward_is_the_block(fresh):
    fq, data = fresh, blocks()
    att = make(quality="balanced")
    outs = sample(att, data, 3, index=False)
    ch = choices()
    assert sorted(b for b, c in ch.items() if c["moved"]) == list(OUTLIERS), ch
    assert stats()["quality"]["moved_calls"] == 2 * len(OUTLIERS)
    for step in (1, 2):                     # the ordinal restarts with each forward
        for b in OUTLIERS:
            qq, k, v = data[b]
            assert abs(rel(outs[step][b], SDPA(qq, k, v)) - fq.KITCHEN_ERROR) < 1e-3, (b, step)
        for b in BENIGN:
            qq, k, v = data[b]
            assert rel(outs[step][b], fake_sage_out(fq, qq, k, v)) < 1e-4, (b, step)


def test_the_forward_wrapper_reads_a_step_only_where_a_guarded_kernel_may_run(fresh):
    """patch.py's APPLY_MODEL wrapper starts the guard's forward (its one host read) for an override that
    may run a guarded kernel, and not for one whose every call is ComfyUI's own (kernel sdpa)."""
    from safe_ops import patch
    from safe_ops.attention.override import SafeAttention
    from safe_ops.facts.devices import Runtime
    from safe_ops.policy import Policy
    rt = Runtime("test", None, None, None, None, None, "test", None, None, None)
    sched = schedule(3)
    for policy, started in ((Policy(kernel="sage"), True), (Policy(kernel="sdpa"), False)):
        att = SafeAttention(policy, rt=rt)
        to = {patch.OVERRIDE_KEY: att, "sigmas": sched[:1].clone(), "sample_sigmas": sched}
        assert patch._forward_wrapper(lambda *a, **k: "out", None, transformer_options=to) == "out"
        st = att.quality.state()
        assert (st is not None and st.step == 1) is started, (policy.kernel, st)
        end_run()


# ------------------------------------------------------------------------------------------------
# A block moved to a family passes the same first-call check and kill switch as a planned one
# (issue 36 point 1): a family SafeSage has seen fail never runs again for that class of call.
def _with_families(fq, *extra):
    """A SafeAttention (kernel sage, balanced) over fake_sage, then ``extra`` -- (name, error())
    families of fake_kitchen's kind, registered for the test -- then fake_kitchen: the move order."""
    from safe_ops.attention.override import SafeAttention
    from safe_ops.facts.devices import Runtime
    from safe_ops.families import envelope, registry
    from safe_ops.policy import Policy
    fams = [fq.make_family(registry.KIT, name, "ck", 0, error=err) for name, err in extra]
    for f in fams:
        envelope.register(f.envelope)
    rt = Runtime("test", None, None, None, None, None, "test", None, None, None)
    base = registry.installed_kernels(rt)
    return SafeAttention(Policy(kernel="sage", quality="balanced"), rt=rt,
                         kernels=base[:1] + [f.kernel() for f in fams] + base[1:])


@pytest.fixture
def extra_families(fresh):
    yield
    from safe_ops.families import envelope
    for name in [n for n in fresh.LAUNCHES if n not in (fresh.SAGE, fresh.KITCHEN)]:
        envelope.FAMILIES.pop(name, None)
        fresh.LAUNCHES.pop(name, None)


def _armed(error):
    """An error() for a fake family: ``error`` until armed, then an ImportError (a build that cannot run
    here) or the armed value."""
    state = {"armed": None}

    def err():
        a = state["armed"]
        if a is None:
            return error
        if isinstance(a, BaseException):
            raise a
        return a
    return state, err


def test_moved_block_whose_family_fails_its_first_check_never_runs_it_again(fresh, monkeypatch):
    """fake_kitchen is accurate on step 1's sampled rows (the outliers move to it) and then returns
    noise over its tolerance on the full calls: the first moved call's check fails (ComfyUI's own
    recomputes it), and no later call of any moved block launches fake_kitchen -- before the fix
    the other moved block and every later step ran it unchecked (3 more launches here)."""
    fq, data = fresh, blocks()
    att = make(quality="balanced")
    sched = schedule(3)
    outs = [forward(att, data, sched, 1)]
    launched = fq.LAUNCHES[fq.KITCHEN]
    monkeypatch.setattr(fq, "KITCHEN_ERROR", 0.9)            # over fake_kitchen's tolerance 0.5 from now on
    outs += [forward(att, data, sched, s) for s in (2, 3)]
    end_run()
    assert choices()[OUTLIERS[0]]["family"] == fq.KITCHEN, choices()
    assert all(choices()[b]["runs_now"] == "sdpa" for b in OUTLIERS), choices()     # the report says what runs
    assert fq.LAUNCHES[fq.KITCHEN] - launched == 1, "only the first moved call ran it (and failed its check)"
    s = stats()
    assert s["probe_failures"] == 1 and s["quality"]["moved_fallbacks"] == 2 * len(OUTLIERS) - 1, s
    for step in (1, 2):
        for b in OUTLIERS:
            qq, k, v = data[b]
            assert torch.equal(outs[step][b], comfy_fn(qq, k, v, H)), (step, b)     # ComfyUI's own, exactly
        for b in BENIGN:
            qq, k, v = data[b]
            assert rel(outs[step][b], fake_sage_out(fq, qq, k, v)) < 1e-4, (step, b)


def test_moved_block_failed_family_is_no_candidate_in_the_next_run(fresh, monkeypatch):
    """The next run measures again, without the family that failed on this class of call: it is not
    run on the sampled rows, and the outliers go to ComfyUI's own."""
    fq, data = fresh, blocks()
    att = make(quality="balanced")
    sched = schedule(2)
    forward(att, data, sched, 1)
    monkeypatch.setattr(fq, "KITCHEN_ERROR", 0.9)
    forward(att, data, sched, 2)
    end_run()
    monkeypatch.setattr(fq, "KITCHEN_ERROR", 0.006)           # it would pass on the rows again
    launched = fq.LAUNCHES[fq.KITCHEN]
    outs = sample(att, data, 2)
    assert fq.LAUNCHES[fq.KITCHEN] == launched, "a failed family was measured as a candidate again"
    ch = choices()
    for b in OUTLIERS:
        assert ch[b]["family"] == "sdpa" and ch[b]["candidates"].get(fq.KITCHEN) is None, ch[b]
        qq, k, v = data[b]
        assert torch.equal(outs[1][b], comfy_fn(qq, k, v, H)), b


def test_moved_block_falls_back_to_the_next_family_under_its_target(fresh, extra_families):
    """Two families under the outliers' target: they move to the first (fake_kitchen_b); when it
    fails its first check they run the second (fake_kitchen), not ComfyUI's own; the fallback is
    counted, and fake_kitchen_b is not launched again."""
    fq, data = fresh, blocks()
    state, err = _armed(0.003)
    att = _with_families(fq, ("fake_kitchen_b", err))
    assert att.quality_order(None) == [fq.SAGE, "fake_kitchen_b", fq.KITCHEN]
    sched = schedule(3)
    outs = [forward(att, data, sched, 1)]
    launched = fq.LAUNCHES["fake_kitchen_b"]
    state["armed"] = 0.9                       # over its tolerance on the full calls from step 2 on
    outs += [forward(att, data, sched, s) for s in (2, 3)]
    end_run()
    ch = choices()
    assert all(ch[b]["family"] == "fake_kitchen_b" and ch[b]["runs_now"] == fq.KITCHEN for b in OUTLIERS), ch
    assert all(ch[b]["runs_now"] == ch[b]["family"] for b in BENIGN), ch
    assert fq.LAUNCHES["fake_kitchen_b"] - launched == 1
    assert stats()["quality"]["moved_fallbacks"] == 2 * len(OUTLIERS) - 1
    first, second = OUTLIERS
    qq, k, v = data[first]
    assert torch.equal(outs[1][first], comfy_fn(qq, k, v, H))          # the failed call: ComfyUI's own
    for step, b in ((1, second), (2, first), (2, second)):                # then fake_kitchen
        qq, k, v = data[b]
        assert abs(rel(outs[step][b], SDPA(qq, k, v)) - fq.KITCHEN_ERROR) < 1e-3, (step, b)


def test_moved_block_switched_off_family_is_not_run(fresh, extra_families):
    """The kill switch holds for a moved block too: the family the outliers move to raises an
    ImportError on the first moved call (a build that cannot run here: switched off for the process,
    that call recomputed by ComfyUI's own); no later moved call launches it."""
    fq, data = fresh, blocks()
    state, err = _armed(0.003)
    att = _with_families(fq, ("fake_kitchen_x", err))
    sched = schedule(3)
    outs = [forward(att, data, sched, 1)]
    launched = fq.LAUNCHES["fake_kitchen_x"]
    state["armed"] = ImportError("fake_kitchen_x: its extension cannot be loaded here (test)")
    outs += [forward(att, data, sched, s) for s in (2, 3)]
    end_run()
    assert all(choices()[b]["family"] == "fake_kitchen_x" for b in OUTLIERS), choices()
    assert fq.LAUNCHES["fake_kitchen_x"] - launched == 1
    assert "fake_kitchen_x" in att.broken, att.broken
    first, second = OUTLIERS
    qq, k, v = data[first]
    assert torch.equal(outs[1][first], comfy_fn(qq, k, v, H))
    for step, b in ((1, second), (2, first), (2, second)):
        qq, k, v = data[b]
        assert abs(rel(outs[step][b], SDPA(qq, k, v)) - fq.KITCHEN_ERROR) < 1e-3, (step, b)


@pytest.mark.parametrize("tolerance,benign_error", [(0.02, None), (0.5, 0.01)], ids=["tolerance", "2x_benign"])
def test_a_majority_of_drifting_blocks_moves_over_the_planned_familys_ceiling(fresh, extra_families, tolerance,
                                                                               benign_error):
    """5 of 8 blocks drift (the run's median is a drifting block's error: the relative target alone moves
    nothing). The planned kernel's family_ceiling caps the target (targets.decide's ceiling, handed in
    by the guard): its fault tolerance, or 2 x its random-input error where that is lower. Every
    drifting block moves to fake_kitchen, no benign one does."""
    from safe_ops.attention.override import SafeAttention
    from safe_ops.facts.devices import Runtime
    from safe_ops.families import envelope, registry
    from safe_ops.policy import Policy
    fq = fresh
    g = torch.Generator().manual_seed(3)
    drifting = (3, 4, 5, 6, 7)
    data = []
    for b in range(NB):
        q, k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(3))
        if b in drifting:
            q[..., :2] *= 32
            k[..., :2] *= 32
        data.append((q, k, v))
    strict_sage = fq.make_family(registry.KIT, "fake_sage_t", "sage", fq.SAGE_LEVELS, tolerance=tolerance,
                                 benign_error=benign_error)
    envelope.register(strict_sage.envelope)
    rt = Runtime("test", None, None, None, None, None, "test", None, None, None)
    kitchen = [kk for kk in registry.installed_kernels(rt) if kk.family == fq.KITCHEN]
    att = SafeAttention(Policy(kernel="sage", quality="balanced"), rt=rt, kernels=[strict_sage.kernel()] + kitchen)
    sample(att, data, 2)
    ch = choices()
    assert min(ch[b]["planned_error"] for b in drifting) > 0.02 > max(ch[b]["planned_error"] for b in range(3)), ch
    assert sorted(b for b, c in ch.items() if c["moved"]) == list(drifting), ch
    assert all(ch[b]["family"] == fq.KITCHEN and ch[b]["target"] == 0.02 for b in drifting), ch


def test_faults_only_with_probe_step_1_measures_the_reference_alone(fresh, monkeypatch):
    """bench.repro's ``safesage_refonly`` arm (quality "faults only", quality_probe_step 1): step 1
    measures every block against ComfyUI's own attention and runs no candidate family, so its cost
    beside the node's defaults splits the probe into reference and candidates; nothing moves."""
    fq, data = fresh, blocks()
    att = make(quality="faults only", probe_step=1)
    ran = []
    real = att.run_family_rows
    monkeypatch.setattr(att, "run_family_rows", lambda fam, n, q_rows: ran.append(fam) or real(fam, n, q_rows))
    sample(att, data, 3)
    q = stats()["quality"]
    assert q["report_probes"] == NB and q["probes"] == 0 and q["plan_changes"] == 0, q
    assert ran == [] and len(stats()["quality_last_run"]["later"]["blocks"]) == NB
    # the node's defaults on the same run do run the candidates (the arm it is compared with)
    att2 = make(quality="balanced")
    real2 = att2.run_family_rows
    monkeypatch.setattr(att2, "run_family_rows", lambda fam, n, q_rows: ran.append(fam) or real2(fam, n, q_rows))
    sample(att2, data, 3)
    assert fq.KITCHEN in ran
