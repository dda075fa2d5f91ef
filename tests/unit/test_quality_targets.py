"""safe_ops/quality/targets.py: the per-block choice, and the balanced target's constant held
between the committed H200 measurements (bench/results/quality_guard_*_h200.json)."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from safe_ops.policy import QUALITY as POLICY_QUALITY
from safe_ops.quality.targets import (BALANCED_FACTOR, COMFY, QUALITY, STRICT_ERROR, STRICT_FACTOR, BlockErrors,
                                      decide, target_for)

REPO = Path(__file__).resolve().parents[2]
K = ("bf16", 128)                    # a class of call
ORDER = ["sage_x", "ck_y"]           # the families a block may move to, fastest first


def blk(i, err, **cands):
    return BlockErrors(i, K, "sage_x", err, dict(cands))


def by_block(choices):
    return {c.block: c for c in choices}


def test_quality_names_match_the_policy():
    assert QUALITY == POLICY_QUALITY


def test_within_target_stays():
    # median 0.010 -> balanced target 0.044: 0.040 stays, as does everything below
    ch = by_block(decide([blk(0, 0.010), blk(1, 0.009), blk(2, 0.011), blk(3, 0.040, ck_y=0.001)], "balanced", ORDER))
    assert all(c.family == "sage_x" and not c.moved for c in ch.values())
    assert ch[3].target == pytest.approx(BALANCED_FACTOR * 0.0105)


def test_over_target_moves_to_the_first_candidate_under_it_in_order():
    ms = [blk(i, 0.010) for i in range(4)] + [blk(4, 0.060, ck_y=0.015, other=0.001)]
    ch = by_block(decide(ms, "balanced", ["sage_x", "other", "ck_y"]))
    assert ch[4].family == "other" and ch[4].moved and ch[4].error == 0.001 and ch[4].planned_error == 0.060
    ch = by_block(decide(ms, "balanced", ["sage_x", "ck_y", "other"]))
    assert ch[4].family == "ck_y" and ch[4].error == 0.015
    assert "over target" in ch[4].why
    assert sum(c.moved for c in ch.values()) == 1


def test_a_candidate_over_target_or_unrun_is_skipped():
    ms = [blk(i, 0.010) for i in range(4)] + [blk(4, 0.060, ck_y=0.200, other=None)]
    ch = by_block(decide(ms, "balanced", ["sage_x", "other", "ck_y"]))
    assert ch[4].family == COMFY and ch[4].moved and ch[4].error is None
    assert "could not run" in ch[4].why and "ck_y 0.200" in ch[4].why


@pytest.mark.parametrize("ck", [0.035, 0.060, 0.100])
def test_an_error_every_fast_kernel_shares_stays(ck):
    """Over its target (0.044) but the best other fast kernel measured the same rows within
    KERNEL_EXCESS of it, either way: the error is the block's (sage 1.0.6's early blocks at 8k), so
    the block stays; ``strict`` and the ceiling do not ask for this evidence."""
    ms = [blk(i, 0.010) for i in range(4)] + [blk(4, 0.060, ck_y=ck)]
    ch = by_block(decide(ms, "balanced", ["sage_x", "ck_y"]))
    assert not ch[4].moved and ch[4].family == "sage_x" and "the block's own error" in ch[4].why, ch[4]
    assert by_block(decide(ms, "strict", ["sage_x", "ck_y"]))[4].moved
    assert by_block(decide(ms, "balanced", ["sage_x", "ck_y"], ceilings={"sage_x": 0.05}))[4].moved


@pytest.mark.parametrize("ck,moves_to", [(0.030, "ck_y"), (0.200, COMFY)])
def test_a_kernel_clearly_worse_than_another_moves(ck, moves_to):
    """The best other kernel measured under planned / KERNEL_EXCESS (the planned kernel is at
    fault), or every other far worse (no evidence about the block): the target decides, as before."""
    ms = [blk(i, 0.010) for i in range(4)] + [blk(4, 0.060, ck_y=ck)]
    assert by_block(decide(ms, "balanced", ["sage_x", "ck_y"]))[4].family == moves_to


def test_no_candidate_goes_to_comfys_own():
    ms = [blk(i, 0.010) for i in range(4)] + [blk(4, 0.060)]
    ch = by_block(decide(ms, "balanced", ORDER))
    assert ch[4].family == COMFY and "no other candidate" in ch[4].why


def test_inconclusive_keeps_its_plan_and_does_not_set_the_median():
    ms = [blk(i, 0.010) for i in range(4)] + [blk(4, None, ck_y=0.001), blk(5, 0.060, ck_y=0.001)]
    ch = by_block(decide(ms, "balanced", ORDER))
    assert ch[4].family == "sage_x" and not ch[4].moved and "inconclusive" in ch[4].why
    assert ch[5].family == "ck_y"
    assert ch[5].target == pytest.approx(BALANCED_FACTOR * 0.010)


def test_strict_has_a_ceiling():
    # median 0.015: 2 x 0.015 = 0.030 > STRICT_ERROR -> the ceiling is the target
    ms = [blk(i, 0.015, ck_y=0.005) for i in range(4)] + [blk(4, 0.025, ck_y=0.005)]
    ch = by_block(decide(ms, "strict", ORDER))
    assert target_for("strict", 0.015) == STRICT_ERROR < STRICT_FACTOR * 0.015
    assert all(c.target == STRICT_ERROR for c in ch.values())
    assert ch[4].family == "ck_y" and all(ch[i].family == "sage_x" for i in range(4))
    # the same errors under balanced move nothing
    assert not any(c.moved for c in decide(ms, "balanced", ORDER))
    # a low median: strict's relative target is below the ceiling
    assert target_for("strict", 0.004) == pytest.approx(STRICT_FACTOR * 0.004)


def test_faults_only_has_no_target():
    ms = [blk(i, 0.010, ck_y=0.0) for i in range(4)] + [blk(4, 0.9, ck_y=0.0)]
    assert not any(c.moved for c in decide(ms, "faults only", ORDER))
    assert target_for("faults only", 0.01) is None


def test_medians_are_per_family_and_class():
    # another class with a 4x larger benign error is not moved by the first class's median
    other = [BlockErrors(i, ("fp16", 64), "sage_x", 0.040, {"ck_y": 0.001}) for i in range(4)]
    ch = decide([blk(i, 0.010, ck_y=0.001) for i in range(4)] + other, "balanced", ORDER)
    assert not any(c.moved for c in ch)


def test_summary_lines_group_consecutive_blocks():
    from safe_ops.quality.outcome import lines as summary_lines
    from safe_ops.quality.report import entry
    ms = [blk(i, 0.010) for i in range(4)] + [blk(4, 0.060, ck_y=0.002), blk(5, 0.070, ck_y=0.002)]
    lines = summary_lines([entry(c) for c in decide(ms, "balanced", ORDER)])
    assert lines[0].startswith("blocks 0-3: sage_x (")
    assert lines[1].startswith("blocks 4-5: ck_y -- sage_x 0.060-0.070 over target")


@pytest.mark.parametrize("name", ["quality_guard_sage22_h200.json", "quality_guard_sage106_h200.json"])
def test_balanced_factor_sits_between_the_committed_measurements(name):
    """For every committed guard run (3 seeds x each sage family): the benign blocks' sage error
    over the run's median stays below BALANCED_FACTOR and every outlier block's is above it; the
    guard moved 0 benign blocks and every outlier block, to an error at most its target."""
    data = json.loads((REPO / "bench" / "results" / name).read_text())
    assert data["balanced_factor"] == BALANCED_FACTOR
    runs = data["runs"]
    assert len({r["seed"] for r in runs}) >= 3
    for r in runs:
        blocks = r["blocks"]
        assert len(blocks) == 50 and r["sage_family"].startswith("sage")
        med = statistics.median(b["sage_error"] for b in blocks)
        benign = [b for b in blocks if b["outlier_factor"] == 1]
        outliers = [b for b in blocks if b["outlier_factor"] > 1]
        assert benign and outliers and {b["outlier_factor"] for b in outliers} >= {16, 32}
        where = (name, r["seed"], r["sage_family"])
        assert max(b["sage_error"] for b in benign) / med < BALANCED_FACTOR, where
        assert min(b["sage_error"] for b in outliers) / med > BALANCED_FACTOR, where
        assert not any(b["moved"] for b in benign) and all(b["family"] == r["sage_family"] for b in benign), where
        for b in outliers:
            assert b["moved"] and not b["family"].startswith("sage"), (where, b)
            assert b["error"] <= b["target"], (where, b)


# ---------------------------------------------------------------------------- the family's ceiling
def test_a_majority_of_drifting_blocks_moves_over_the_family_ceiling():
    """Issue #37's case: 20 blocks at 0.003 and 30 at 0.40 -- the median is the drift (target 1.76 by
    the relative rule alone: nothing moved). The planned family's ceiling (its fault tolerance, 0.05 for
    sage 1) moves every drifting block and keeps every benign one."""
    ms = [blk(i, 0.003, ck_y=0.002) for i in range(20)] + [blk(20 + i, 0.40, ck_y=0.004) for i in range(30)]
    ch = by_block(decide(ms, "balanced", ORDER, {"sage_x": 0.05}))
    assert sorted(b for b, c in ch.items() if c.moved) == list(range(20, 50))
    assert all(ch[b].family == "ck_y" and ch[b].target == 0.05 for b in range(20, 50))
    assert not any(ch[b].moved for b in range(20))


def test_without_ceilings_the_default_fault_tolerance_caps_the_target():
    from safe_ops.families.family import DEFAULT_TOLERANCE
    from safe_ops.quality.targets import DEFAULT_CEILING
    assert DEFAULT_CEILING == DEFAULT_TOLERANCE
    ms = [blk(i, 0.003) for i in range(20)] + [blk(20 + i, 0.40, ck_y=0.004) for i in range(30)]
    ch = by_block(decide(ms, "balanced", ORDER))
    assert sorted(b for b, c in ch.items() if c.moved) == list(range(20, 50))
    assert {ch[b].target for b in range(50)} == {DEFAULT_CEILING}


def test_the_ceiling_never_raises_a_target_and_strict_keeps_its_bound():
    ms = [blk(i, 0.010) for i in range(4)] + [blk(4, 0.043, ck_y=0.001)]
    relative = by_block(decide(ms, "balanced", ORDER, {"sage_x": 0.5}))
    assert relative[4].target == pytest.approx(BALANCED_FACTOR * 0.010) and not relative[4].moved
    capped = by_block(decide(ms, "balanced", ORDER, {"sage_x": 0.04}))
    assert capped[4].target == 0.04 and capped[4].moved and capped[4].family == "ck_y"
    strict = by_block(decide(ms, "strict", ORDER, {"sage_x": 0.5}))
    assert strict[4].target == STRICT_ERROR


@pytest.mark.parametrize("seed_majority", [0, 1, 2])
def test_sage106_drift_moves_when_it_is_the_majority(seed_majority):
    """Checked on a profile the ceiling was not fitted to: the committed sage 1.0.6 guard run's own per-block
    errors (bench/results/quality_guard_sage106_h200.json), its 10 drifting blocks repeated to outnumber
    its 40 benign ones 3:2 (the relative rule's median is then a drifting block's). With sage 1's tolerance
    as the ceiling every drifting block moves and no benign one does."""
    from safe_ops.families.sage1 import KERNEL_FAMILY as SAGE1_TRITON_FAMILY
    data = json.loads((REPO / "bench" / "results" / "quality_guard_sage106_h200.json").read_text())
    run = [r for r in data["runs"] if r["sage_family"] == "sage1_triton"][seed_majority]
    benign = [b["sage_error"] for b in run["blocks"] if b["outlier_factor"] == 1]
    drift = [b["sage_error"] for b in run["blocks"] if b["outlier_factor"] > 1]
    ms = [blk(i, e, ck_y=0.01) for i, e in enumerate(benign)]
    ms += [blk(len(ms) + i, e, ck_y=0.01) for i, e in enumerate(drift * 6)]
    assert statistics.median(m.error for m in ms) > SAGE1_TRITON_FAMILY.tolerance
    plain = decide(ms, "balanced", ORDER, {"sage_x": float("inf")})
    assert not any(c.moved for c in plain)                      # the relative rule alone: nothing moves
    ch = decide(ms, "balanced", ORDER, {"sage_x": SAGE1_TRITON_FAMILY.tolerance})
    assert [c.moved for c in ch] == [False] * len(benign) + [True] * (6 * len(drift))


# ------------------------------------------- the target on committed measurements it was not fitted to
def test_committed_measurements_decided_again_move_no_benign_block_and_lose_no_drifting_move():
    """bench.quality.quality_decisions feeds the committed per-block errors (H200 38k: 3 seeds x sage 1.0.6 and
    sage 2.2's fp8-PV paths; H100 8k: five profiles x three sage paths) to today's decide(). No benign
    block moves anywhere (the 8k sage 1.0.6 runs moved 7 early blocks before KERNEL_EXCESS); every
    drifting block moves on the sets KERNEL_EXCESS was fitted on (H200 38k, the 8k default profile);
    on the others (majority, gradual, heads, keys) no drifting block the committed run moved stays."""
    from bench.quality import quality_decisions as qd
    for name in ("quality_guard_sage106_h200.json", "quality_guard_sage22_h200.json"):
        for run, r in qd.h200_runs(str(REPO / "bench" / "results" / name)).items():
            assert r["benign_moved"] == [] and r["drifting_kept"] == [], (name, run, r["lines"])
    path = REPO / "bench" / "results" / "quality_guard_profiles_before_h100.json"
    committed = json.loads(path.read_text())["profiles"]
    for profile, paths in qd.profiles(str(path)).items():
        for sage_path, r in paths.items():
            where = (profile, sage_path, r["lines"])
            assert r["benign_moved"] == [], where
            if profile == "default":
                assert r["drifting_kept"] == [], where
            cut = qd.GRADUAL_DRIFT_FROM if profile == "gradual" else 1.0
            before = {b["block"] for b in committed[profile][sage_path]["guard"]["blocks"]
                      if b["moved"] and b["factor"] > cut}
            assert before <= set(r["drifting_moved"]), where
    before = committed["default"]["sage106_sm89"]["guard"]["benign_moved"]
    assert before == 7, "the committed run this test was written against"


def test_a_majority_of_sage1_drifting_blocks_moves_over_twice_its_random_input_error():
    """The 8k majority profile (30 of 50 blocks drift, sage 1.0.6 at 0.019-0.045): the relative target
    is the drift and the fault tolerance (0.05) is above it, so nothing moved in the committed run.
    The ceiling of 2 x sage 1's random-input error (0.027) moves every drifting block over it, to
    comfy-kitchen (3.4x or more better on each), and no benign block."""
    from bench.quality import quality_decisions as qd
    path = REPO / "bench" / "results" / "quality_guard_profiles_before_h100.json"
    blocks = json.loads(path.read_text())["profiles"]["majority"]["sage106_sm89"]["guard"]["blocks"]
    r = qd.profiles(str(path))["majority"]["sage106_sm89"]
    over = {b["block"] for b in blocks if b["factor"] > 1 and b["planned_error"] > qd.ceiling_of("sage1_triton")}
    assert len(over) >= 15 and set(r["drifting_moved"]) == over and r["benign_moved"] == [], r["lines"]
    assert r["moved_to"] == ["ck_int8"]


def test_the_ceiling_is_the_repros_wrong_output_rule_on_each_familys_random_input_error():
    """family_ceiling = CEILING_FACTOR (the repro's WRONG_FACTOR) x benign_error, never over the fault
    tolerance; each family's benign_error is the committed stress measurement it cites."""
    from bench.repro.verdict import WRONG_FACTOR
    from safe_ops.families import registry
    from safe_ops.quality.targets import CEILING_FACTOR, family_ceiling
    assert CEILING_FACTOR == WRONG_FACTOR
    fams = registry.families()
    measured = {}
    for f in (REPO / "bench" / "results").glob("stress*_h200.json"):
        for r in json.loads(f.read_text())["guarded"]:
            fam = r["plan"].split(" on ")[1].split(" ")[0] if " on " in r["plan"] else None
            if fam and r.get("guarded_rel_err") is not None:
                measured.setdefault(fam, []).append(r["guarded_rel_err"])
    for name in ("sage1_triton", "sage2_fp8pv_perwarp", "sage2_sm80", "sage2_sm86_triton", "sage2_sm89_fp8pv"):
        assert fams[name].benign_error == pytest.approx(max(measured[name]), rel=0.01), name
    for name, fam in fams.items():
        ceiling = family_ceiling(fam.tolerance, fam.benign_error)
        if fam.benign_error is None:
            assert ceiling == fam.tolerance, name
        else:
            assert ceiling == min(fam.tolerance, CEILING_FACTOR * fam.benign_error) < fam.tolerance, name


def test_the_device_run_under_todays_targets_moved_what_the_offline_check_predicted():
    """quality_guard_profiles_h100.json is the GPU run of today's guard (node defaults, five profiles
    x three sage paths), measured after the target was fitted and checked offline on the run before
    it. On the device: no benign block moved; sage 1.0.6's majority moved its drifting blocks over
    the ceiling (18 of 30); each profile and path moved as many blocks as quality_decisions_offline.json
    predicted from the earlier run's errors; and today's decide() on this run's own errors gives
    exactly the device's moves (the guard decides as targets.decide does)."""
    from bench.quality import quality_decisions as qd
    path = REPO / "bench" / "results" / "quality_guard_profiles_h100.json"
    device = json.loads(path.read_text())["profiles"]
    offline = json.loads((REPO / "bench" / "results" / "quality_decisions_offline.json").read_text())
    predicted = offline["profiles_h100_8k"]["decisions"]
    assert offline["profiles_h100_8k"]["source"].endswith("quality_guard_profiles_before_h100.json")
    again = qd.profiles(str(path))
    assert set(device) == set(predicted) and len(device) == 5
    for profile, paths in device.items():
        for sage_path, r in paths.items():
            g = r["guard"]
            moved = {b["block"] for b in g["blocks"] if b["moved"]}
            assert g["benign_moved"] == 0, (profile, sage_path, g["lines"])
            p = predicted[profile][sage_path]
            assert len(moved) == len(p["drifting_moved"]) + len(p["benign_moved"]), (profile, sage_path)
            a = again[profile][sage_path]
            assert moved == set(a["drifting_moved"]) | set(a["benign_moved"]), (profile, sage_path)
    sage1 = device["majority"]["sage106_sm89"]["guard"]
    assert sage1["blocks_moved"] >= 15 and sage1["moved_to"] == ["ck_int8"]
    assert sage1["final_error"] < device["majority"]["sage106_sm89"]["arms"]["sage_only"]["final_error"]
