"""bench/quality_cost.py: the guard's step-1 cost from bench.repro rows (issue #37 point 4)."""
import json

import pytest

from bench import quality_cost


def _row(arm, steps, later=(), blocks=50):
    return {"arm": arm, "rc": 0, "worker": {
        "s_per_step": steps, "blocks": blocks, "packed_tokens": 37966, "versions": {"gpu": "GPU X"},
        "later_prompts": [{"prompt": i + 2, "outcome": "completed", "s_per_step": s} for i, s in enumerate(later)],
        "memory": {"torch_peak_allocated_gib": 4.5}}}


def _doc():
    return {"command": "python -m bench.repro all ...", "repo_rev": "abc1234", "runs": [
        _row("safesage_faults", [30.0, 7.0, 7.0], [[7.1, 7.0, 7.0]]),
        _row("safesage_refonly", [9.0, 7.0, 7.0], [[7.31, 7.0, 7.0]]),
        _row("safesage", [40.0, 7.0, 7.0], [[7.73, 7.0, 7.0]]),
    ]}


def test_fraction_per_prompt_and_the_last_prompts_is_the_figure():
    c = quality_cost.path_cost(_doc())
    # (7.73 - 7.1) / (30 x 7.0) = 0.003; the first prompt (40 - 30) / 210 = 0.04762
    assert c["probe_overhead_fraction"] == pytest.approx(0.003)
    assert c["probe_overhead_fraction_first_prompt"] == pytest.approx(0.04762)
    assert c["per_prompt"][1]["reference_fraction"] == pytest.approx(0.001)
    assert c["reference_share"] == pytest.approx(0.333) and c["candidates_share"] == pytest.approx(0.667)
    assert c["probe_ms_per_block"] == pytest.approx(12.6)         # 0.63 s over 50 blocks
    assert c["prompts"] == 2 and c["median_step_from_step2_s"] == 7.0


def test_a_failed_later_prompt_is_not_a_prompt():
    d = _doc()
    d["runs"][2]["worker"]["later_prompts"][0]["outcome"] = "error"
    c = quality_cost.path_cost(d)
    assert c["prompts"] == 1 and c["probe_overhead_fraction"] == pytest.approx(0.04762)


def test_missing_arm_says_which_rows_it_has():
    d = _doc()
    d["runs"] = d["runs"][:2]
    with pytest.raises(SystemExit, match="safesage_faults, safesage_refonly"):
        quality_cost.path_cost(d)


def test_cli_writes_the_worst_path_and_the_target(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_doc()))
    d = _doc()
    d["runs"][2]["worker"]["later_prompts"][0]["s_per_step"] = [8.26, 7.0, 7.0]     # 0.0055: over
    b.write_text(json.dumps(d))
    out = tmp_path / "o.json"
    quality_cost.main([str(a), str(b), "--path", "p1", "--path", "p2", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["probe_overhead_fraction"] == pytest.approx(0.00552) and doc["target_met"] is False
    assert doc["command"].startswith("python3 -m bench.quality_cost ") and set(doc["paths"]) == {"p1", "p2"}
