"""The quality guard's speed budget, its safety rule, remembered errors, towers and skipped probes
(issue #46), on the CPU with the fake families of fake_quality_families.py.

The fakes get speeds through the speed table's published rows for the CPU "arch" and random-input
errors (``KernelFamily.benign_error``) through speed_budget.prior_error, both patched per test:
fake_sage 100 TFLOP/s / 0.04, fake_kitchen at ``KITCHEN_SPEED`` / 0.017 -- the shape of sage 2's fp8 PV
beside comfy-kitchen on sm_120 (560 vs 536 TFLOP/s; 0.0397 vs 0.0173). ComfyUI's function is named
``attention_sage``: under ``kernel=auto`` SafeSage reads it as ComfyUI started with --use-sage-attention.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from test_quality_guard import (BENIGN, H, NB, OUTLIERS, SDPA, blocks, end_run,  # noqa: E402
                                           fake_sage_out, schedule, stats)


def attention_sage(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                   **kw):
    """Stands for ComfyUI's attention_sage (its name says sage): what --use-sage-attention hands the override."""
    return SDPA(q, k, v, scale=kw.get("scale"))


@pytest.fixture
def speeds(fresh, monkeypatch):
    """Published speed rows for the fakes on the CPU, their random-input errors; returns a setter."""
    from safe_ops.attention import speed_budget
    from safe_ops.facts import speed_table
    from safe_ops.quality import memory
    fq = fresh
    memory.forget()
    rows = {"fake_sage": 100.0, "fake_kitchen": 98.0}

    def published():
        return tuple({"arch": "cpu", "family": f, "tflops": t, "gpu": "test", "version": "test", "source": "test"}
                     for f, t in rows.items() if t is not None)
    monkeypatch.setattr(speed_table, "_published", published)
    prior = {fq.SAGE: 0.04, fq.KITCHEN: 0.017}
    monkeypatch.setattr(speed_budget, "prior_error", lambda name: prior.get(name))
    monkeypatch.setattr(fq, "KITCHEN_ERROR", 0.006)
    yield rows
    memory.forget()


def make(quality="balanced", kernel="auto"):
    from safe_ops.attention.override import SafeAttention
    from safe_ops.facts.devices import Runtime
    from safe_ops.policy import Policy
    rt = Runtime("test", None, None, None, None, None, "test", None, None, None)
    return SafeAttention(Policy(kernel=kernel, quality=quality), rt=rt)


def forward(att, data, sched, step, tower=None):
    att.quality.forward_start({"sigmas": sched[step - 1:step].clone(), "sample_sigmas": sched},
                              att.kernel_sites())
    outs = []
    for b, (q, k, v) in enumerate(data):
        if tower is not None:
            from safe_ops.attention.call_forms import BASE_KEY
            tq, tk, tv = tower[b]
            att(attention_sage, tq, tk, tv, H, skip_reshape=True, skip_output_reshape=True,
                transformer_options={"block_index": b, BASE_KEY: None})
            to = {"block_index": b, BASE_KEY: b}
        else:
            to = {"block_index": b}
        outs.append(att(attention_sage, q, k, v, H, skip_reshape=True, skip_output_reshape=True,
                        transformer_options=to))
    return outs


class Patcher:
    """What the guard reads of ComfyUI's sampling ModelPatcher: its base model and patches_uuid."""
    def __init__(self, model, uuid):
        self.model, self.patches_uuid = model, uuid


def sample(att, data, steps, patcher=None, tower=None):
    from safe_ops.quality import guard
    guard.run_started(patcher)
    sched = schedule(steps)
    outs = [forward(att, data, sched, s, tower) for s in range(1, steps + 1)]
    end_run()
    return outs


def last():
    return stats()["quality_last_run"]["choices"]


def by_block():
    return {c["block"]: c for c in last()["blocks"]}


def rel(a, b):
    return float((a - b).norm() / b.norm())


# ------------------------------------------------------------------------------------------------ targets
def errors(planned_err, cands, costs, floor=0.0, block=0, planned="sage"):
    from safe_ops.quality.targets import BlockErrors
    return BlockErrors(block, "k", planned, planned_err, dict(cands), dict(costs), floor)


def test_budget_takes_the_least_error_family_whose_cost_is_known_and_within():
    from safe_ops.quality.targets import decide
    costs = {"sage": 1.0, "ck": 1.04, "slow": 1.3, "unknown": None}
    m = [errors(0.040, {"ck": 0.017, "slow": 0.005, "unknown": 0.001}, costs, block=b) for b in range(4)]
    ch = decide(m, "balanced", ["sage", "ck", "slow", "unknown"], {"sage": 0.12}, budget=1.05)
    assert [c.family for c in ch] == ["ck"] * 4, ch
    assert all(c.rule == "budget" and c.cost == 1.04 for c in ch), ch
    ch = decide(m, "strict", ["sage", "ck", "slow", "unknown"], {"sage": 0.12}, budget=1.5)
    assert [c.family for c in ch] == ["slow"] * 4, ch        # 1.3 within strict's 1.5; "unknown" never
    ch = decide(m, "balanced", ["sage", "ck"], {"sage": 0.12}, budget=1.0)
    assert [c.family for c in ch] == ["sage"] * 4, ch         # no budget: ck's 1.04 is over it


def test_a_gain_inside_the_reference_noise_or_under_min_gain_moves_nothing():
    from safe_ops.quality.targets import MIN_GAIN, decide
    costs = {"sage": 1.0, "ck": 1.0}
    # 10 % less error: under the minimum gain
    m = [errors(0.020, {"ck": 0.020 * (MIN_GAIN + 0.1)}, costs, block=b) for b in range(3)]
    assert [c.family for c in decide(m, "balanced", ["sage", "ck"], {}, 1.05)] == ["sage"] * 3
    # both at the bf16 reference's own error: no gain net of it, whatever the ratio
    m = [errors(0.0030, {"ck": 0.0012}, costs, floor=0.0023, block=b) for b in range(3)]
    assert [c.family for c in decide(m, "balanced", ["sage", "ck"], {}, 1.05)] == ["sage"] * 3
    # the same errors against an exact (fp32) reference: a real gain
    m = [errors(0.0030, {"ck": 0.0012}, costs, floor=0.0, block=b) for b in range(3)]
    assert [c.family for c in decide(m, "balanced", ["sage", "ck"], {}, 1.05)] == ["ck"] * 3


def test_safety_rule_moves_over_the_ceiling_whatever_the_budget_to_the_cheapest_under_it():
    from safe_ops.quality.targets import decide, family_ceiling
    # a family whose 2 x random-input error (0.08) passes its fault tolerance (0.05): the ceiling is 0.05
    ceiling = family_ceiling(0.05, 0.04)
    assert ceiling == 0.05
    costs = {"sage": 1.0, "cheap": 1.3, "dear": 2.0, "unknown": None}
    # every block drifts alike (the median is the drift): only the ceiling can move them
    m = [errors(0.07, {"dear": 0.01, "cheap": 0.03, "unknown": 0.0}, costs, block=b) for b in range(4)]
    ch = decide(m, "balanced", ["sage", "unknown", "dear", "cheap"], {"sage": ceiling}, budget=1.05)
    assert [c.family for c in ch] == ["cheap"] * 4, ch      # cheapest known cost first, over the budget
    assert all(c.rule == "target" and c.alternatives == ("dear", "unknown") for c in ch), ch
    # 0.045: under the capped ceiling -- stays
    m = [errors(0.045, {"cheap": 0.03}, costs, block=b) for b in range(4)]
    assert [c.family for c in decide(m, "balanced", ["sage", "cheap"], {"sage": ceiling}, 1.05)] == ["sage"] * 4


# ------------------------------------------------------------------------------------------------ the guard
def test_planned_within_the_budget_from_step_1_and_per_block_at_step_2(speeds, fresh, monkeypatch):
    fq = fresh
    data = blocks()
    att = make()
    outs = sample(att, data, 3)
    exact = [SDPA(q, k, v) for q, k, v in data]
    # step 1: every block on fake_kitchen (0.017 < 0.04 on random inputs, 98 vs 100 TFLOP/s: 1.02x)
    assert all(abs(rel(outs[0][b], exact[b]) - fq.KITCHEN_ERROR) < 1e-3 for b in range(NB))
    ch = by_block()
    assert all(c["planned"] == fq.KITCHEN and not c["moved"] for c in ch.values()), ch
    assert last()["budget"] == 1.05 and last()["source"] == "measured", last()
    # fake_kitchen's cost 1.02 is in the report; the candidates were measured: fake_sage on every block
    assert all(c["cost"] == pytest.approx(100 / 98, rel=1e-3) for c in ch.values()), ch
    assert all(fq.SAGE in c["candidates"] for c in ch.values()), ch


def test_per_block_the_least_error_within_the_budget_runs(speeds, fresh, monkeypatch):
    fq = fresh
    monkeypatch.setattr(fq, "KITCHEN_ERROR", 0.03)   # kitchen worse than fake_sage on benign blocks, better on outliers
    data = blocks()
    att = make()
    outs = sample(att, data, 3)
    ch = by_block()
    for b in BENIGN:
        assert ch[b]["family"] == fq.SAGE and ch[b]["rule"] == "budget", ch[b]
    for b in OUTLIERS:
        assert ch[b]["family"] == fq.KITCHEN and not ch[b]["moved"], ch[b]
    exact = [SDPA(q, k, v) for q, k, v in data]
    for b in BENIGN:                                   # step 2 runs fake_sage there
        assert rel(outs[1][b], exact[b]) < 0.02, b


def test_without_a_known_speed_nothing_moves_for_the_budget(speeds, fresh):
    fq = fresh
    speeds["fake_kitchen"] = None                      # no row: unknown cost, never within a budget
    att = make()
    sample(att, blocks(), 3)
    ch = by_block()
    assert all(c["planned"] == fq.SAGE for c in ch.values()), ch
    assert all(c["rule"] != "budget" for c in ch.values()), ch


def test_kernel_sage_and_faults_only_keep_the_policy_plan(speeds, fresh):
    fq = fresh
    att = make(kernel="sage")
    sample(att, blocks(), 3)
    assert all(c["planned"] == fq.SAGE and c["rule"] != "budget" for c in by_block().values())
    att = make(quality="faults only")
    data = blocks()
    outs = sample(att, data, 2)
    assert all(rel(outs[0][b], fake_sage_out(fq, *data[b])) < 1e-4 for b in range(NB))   # sage, as planned
    assert stats()["quality"]["probes"] == NB        # only the balanced run above measured


def test_a_later_prompt_on_the_same_model_runs_remembered_choices_from_step_1(speeds, fresh, monkeypatch):
    fq = fresh
    from safe_ops.quality import memory
    monkeypatch.setattr(fq, "KITCHEN_ERROR", 0.03)
    data = blocks()
    att = make()
    model = torch.nn.Linear(1, 1)                      # stands for the base model (weakly referenced)
    sample(att, data, 3, Patcher(model, "u1"))
    probes = stats()["quality"]["probes"]
    assert probes == NB and memory.entries() == NB
    moved = {b for b, c in by_block().items() if c["moved"]}
    assert moved == set(BENIGN)
    outs = sample(att, data, 3, Patcher(model, "u1"))  # the same model and patches: no probe
    q = stats()["quality"]
    assert q["probes"] == probes and q["recalled_blocks"] == NB, q
    assert last()["source"] == "remembered"
    # the remembered run states the budget it decided under, the predicted cost and the speeds' provenance
    assert last()["budget"] > 1.0 and last()["cost"]["budget"] is not None, last()
    assert set(last()["speeds"]) == {"fake_sage", "fake_kitchen"} and "test" in last()["speeds"]["fake_kitchen"]
    assert "errors remembered" in stats()["quality_last_run"]["summary"] and "budget" in stats()["quality_last_run"]["summary"]
    exact = [SDPA(*d) for d in data]
    for b in BENIGN:                                   # step 1 already runs the choice (fake_sage)
        assert rel(outs[0][b], exact[b]) < 0.02, b
    # a LoRA after the node: another patches_uuid -> measured again
    sample(att, data, 3, Patcher(model, "u2"))
    assert stats()["quality"]["probes"] == 2 * NB
    # forgotten: measured again
    assert memory.forget() == NB
    sample(att, data, 3, Patcher(model, "u2"))
    assert stats()["quality"]["probes"] == 3 * NB


def test_a_one_step_graph_skips_the_probe(speeds, fresh):
    fq = fresh
    att = make()
    sample(att, blocks(), 1)
    q = stats()["quality"]
    assert q["probes"] == 0 and q["probes_skipped"] == 1, q


def test_another_towers_calls_under_the_base_index_are_not_measured(speeds, fresh, monkeypatch):
    fq = fresh
    monkeypatch.setattr(fq, "KITCHEN_ERROR", 0.03)
    data = blocks()
    # a second tower whose every block is an outlier, run before each base block under its index
    tower = [(q.clone(), k.clone(), v.clone()) for q, k, v in data]
    for q, k, v in tower:
        q[..., :2] *= 64
        k[..., :2] *= 64
    att = make()
    sample(att, data, 3, tower=tower)
    ch = by_block()
    assert sorted(ch) == list(range(NB))
    for b in BENIGN:                                   # measured on the base block's rows: benign
        assert ch[b]["family"] == fq.SAGE, ch[b]
    assert stats()["quality"]["probes"] == NB
