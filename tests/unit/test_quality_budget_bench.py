"""bench.quality.quality_budget (issue 46 goal 8): its arms and JSON on the CPU with the fake families
(fake_quality_families.py; speeds and random-input errors as test_quality_budget.py's ``speeds``
fixture gives them: fake_sage 100 TFLOP/s / 0.04, fake_kitchen 98 / 0.017), end to end through
``--cpu --tiny``, and the pure assembly (prices, targets, misses, merge) on hand-made numbers."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from bench.quality import quality_budget as qb  # noqa: E402
from test_quality_budget import speeds  # noqa: E402,F401 (the fixture)


@pytest.fixture
def smoke(speeds, fresh, tmp_path):            # noqa: F811
    out = tmp_path / "qb.json"
    assert qb.main(["--cpu", "--tiny", "--reps", "1", "--path", "cpu_fake", "--out", str(out)]) == 0
    with open(out) as f:
        return fresh, json.load(f)


def test_cpu_smoke_runs_every_layout_and_arm(smoke):
    fq, doc = smoke
    assert sorted(doc["layouts"]) == sorted(qb.LAYOUTS)
    nb = qb.TINY["blocks"]
    for name, lay in doc["layouts"].items():
        arms = lay["paths"]["cpu_fake"]["arms"]
        assert set(arms) == set(qb.ARMS), name
        assert arms["sage2_sm80_only"]["skipped"] == "sage2_sm80: not installed here"
        for arm in ("sage_only", "kitchen_only", "sdpa_only", "guard_first", "guard_remembered"):
            assert 0 <= arms[arm]["final_error"] < 1, (name, arm)
            assert sum(arms[arm]["families"].values()) == nb, (name, arm)
        assert arms["sage_only"]["families"] == {fq.SAGE: nb}
        assert arms["kitchen_only"]["families"] == {fq.KITCHEN: nb}
    assert doc["paths"]["cpu_fake"]["budget"] == 1.05 and doc["label"] == qb.LABEL


def test_the_first_prompt_measures_the_remembered_one_runs_its_choices_from_step_1(smoke):
    fq, doc = smoke
    nb = qb.TINY["blocks"]
    for name, lay in doc["layouts"].items():
        arms = lay["paths"]["cpu_fake"]["arms"]
        first, rem = arms["guard_first"], arms["guard_remembered"]
        assert first["source"] == "measured" and first["probes"] == [nb], (name, first["probes"])
        assert rem["source"] == "remembered" and rem["probes"] == [0, 0], (name, rem["probes"])
        assert rem["recalled_blocks"] == [nb, nb]
        # step 1 of the first prompt ran the budget's plan (fake_kitchen: less random-input error, 1.02x)
        assert first["step1_families"] == {fq.KITCHEN: nb}, name
        # the remembered prompt's step 1 already runs the first prompt's choices: the same output
        assert rem["step1_final_error"] == first["final_error"] == rem["final_error"], name
        assert rem["families"] == first["families"], name


def test_predicted_cost_is_relative_to_sage_with_provenance_and_the_measured_ratio_beside_it(smoke):
    fq, doc = smoke
    res = doc["layouts"]["default"]["paths"]["cpu_fake"]
    arms = res["arms"]
    assert res["prices"][fq.SAGE]["ratio"] == 1.0
    assert res["prices"][fq.KITCHEN]["ratio"] == pytest.approx(100 / 98, abs=1e-4)
    assert res["prices"]["sdpa"]["ratio"] is None                # no speed row for it: unknown
    sage = arms["sage_only"]["predicted_attention_cost"]
    assert sage["value"] == 1.0 and sage["label"] == qb.LABEL and sage["unknown_blocks"] == 0
    assert any("fake_sage 100 TFLOP/s" in s for s in sage["inputs"]), sage
    assert arms["kitchen_only"]["predicted_attention_cost"]["value"] == pytest.approx(100 / 98, abs=1e-4)
    assert arms["sdpa_only"]["predicted_attention_cost"]["value"] is None
    assert arms["sdpa_only"]["predicted_attention_cost"]["unknown_blocks"] == qb.TINY["blocks"]
    assert arms["sage_only"]["step_ratio_measured"] == 1.0
    assert arms["guard_remembered"]["step_ratio_measured"] > 0
    t = res["target"]
    assert t["applies"] and t["best_single"] in ("sage_only", "kitchen_only")
    assert t["bound"] == pytest.approx(qb.ERROR_FACTOR * t["best_single_error"], abs=1e-5)


# ------------------------------------------------------------------------------ pure assembly
PRICES = {"sage": {"ratio": 1.0, "speed": "sage 560"}, "ck": {"ratio": 1.045, "speed": "ck 536"},
          "sm80": {"ratio": None, "speed": None}, "sdpa": {"ratio": 2.7, "speed": "sdpa 207"}}


def test_predicted_averages_blocks_and_an_unknown_block_makes_it_unknown():
    p = qb.predicted(["sage", "ck", "ck", "sage"], PRICES)
    assert p["value"] == pytest.approx(1.0225) and p["range"] == [1.0, 1.045] and p["inputs"] == ["ck 536", "sage 560"]
    p = qb.predicted(["sage", "sm80"], PRICES)
    assert p["value"] is None and p["unknown_blocks"] == 1 and p["range"] == [1.0, 1.0]


def _arm(err, cost):
    return {"final_error": err, "predicted_attention_cost": {"value": cost}}


def test_target_against_the_best_single_kernel_within_the_budget():
    arms = {"sage_only": _arm(0.055, 1.0), "kitchen_only": _arm(0.041, 1.045), "sdpa_only": _arm(0.03, 2.7),
            "sage2_sm80_only": _arm(0.02, None), "guard_remembered": _arm(0.049, 1.045)}
    t = qb.target(arms, 1.05)
    assert t["best_single"] == "kitchen_only" and t["bound"] == pytest.approx(0.0492)   # not sdpa (2.7), not sm80
    assert t["met"] and t["sage2_sm80_only_error"] == 0.02
    arms["guard_remembered"] = _arm(0.050, 1.045)
    assert not qb.target(arms, 1.05)["met"]                    # over 1.2 x 0.041
    arms["guard_remembered"] = _arm(0.030, 1.06)
    t = qb.target(arms, 1.05)
    assert t["error_met"] and not t["cost_met"] and not t["met"]
    t = qb.target({a: _arm(0.05, None) for a in ("sage_only", "kitchen_only", "guard_remembered")}, 1.05)
    assert not t["applies"]                                   # sm_89: no known cost, no target


def test_merge_joins_paths_and_lists_every_miss():
    def doc(path, t, sd):
        return {"paths": {path: {"gpu": "G", "budget": 1.05}}, "layouts": {"majority_informative": {
            "factors": [1, 8], "paths": {path: {"arms": {"sdpa_only": {"final_error": sd}}, "target": t}}}}}
    missed = {"applies": True, "met": False, "guard_remembered_error": 0.06, "bound": 0.05, "best_single": "sage_only",
              "guard_remembered_cost": 1.0, "budget": 1.05}
    out = qb.merge([doc("sage22_sm120", missed, 0.05), doc("sage22_sm89", {"applies": False}, 0.12)], "abc")
    assert sorted(out["layouts"]["majority_informative"]["paths"]) == ["sage22_sm120", "sage22_sm89"]
    assert out["gpu"] == "G" and out["repo_rev"] == "abc"
    assert len(out["misses"]) == 2
    assert out["misses"][0].startswith("majority_informative / sage22_sm120: remembered guard 0.06")
    assert out["misses"][1] == "majority_informative / sage22_sm89: sdpa_only final error 0.12, not under 0.1"
