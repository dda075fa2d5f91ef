"""bench.quality.latent_errors: each arm's final-latent error per prompt from a bench.repro result, and the
earlier JSON kept whole under ``before`` (hand-made results; no torch)."""
from __future__ import annotations

import json

from bench.quality import latent_errors as le

RESULT = {"command": "python -m bench.repro all --comfy /tmp/comfy/c0dd --ckpt X --plan 38k:pytorch 38k:safesage",
          "runs": [
              {"size": "38k", "arm": "pytorch", "outcome": "completed", "rel_l2_vs_pytorch": 0.0,
               "worker": {"s_per_step": [9.0, 7.5], "later_prompts": [
                   {"prompt": 2, "outcome": "completed", "s_per_step": [7.7, 7.5], "rel_l2_vs_pytorch": 0.0}]}},
              {"size": "38k", "arm": "safesage", "outcome": "completed", "rel_l2_vs_pytorch": 0.12,
               "rel_l2_vs_unguarded": 0.01,
               "worker": {"s_per_step": [9.9, 6.5], "safesage_quality_first_prompt": {"quality": {"probes": 50,
                          "recalled_blocks": 0, "blocks_moved": 8}},
                          "later_prompts": [{"prompt": 2, "outcome": "completed", "s_per_step": [6.6, 6.5],
                                             "rel_l2_vs_pytorch": 0.123, "rel_l2_vs_unguarded": 0.02,
                                             "safesage_quality": {"quality": {"probes": 50, "recalled_blocks": 50}}}]}},
          ]}


def test_rows_per_arm_and_prompt_name_their_tree_and_the_guards_counts():
    rows = le.arm_rows(RESULT, "r.json")
    assert sorted(rows) == ["38k:pytorch", "38k:safesage"]
    g = rows["38k:safesage"]
    assert g["comfy"] == "/tmp/comfy/c0dd" and g["source"] == "r.json"
    assert [p["prompt"] for p in g["prompts"]] == [1, 2]
    assert g["prompts"][0]["rel_l2_vs_pytorch"] == 0.12 and g["prompts"][0]["probes"] == 50
    assert g["prompts"][1] == {"prompt": 2, "outcome": "completed", "s_per_step": [6.6, 6.5], "rel_l2_vs_pytorch": 0.123,
                               "rel_l2_vs_unguarded": 0.02, "probes": 50, "recalled_blocks": 50, "blocks_moved": None}
    assert "probes" not in rows["38k:pytorch"]["prompts"][1]        # no guard there


def test_into_adds_the_errors_and_keeps_the_earlier_json_whole_under_before(tmp_path):
    res, into, old = tmp_path / "r.json", tmp_path / "cost.json", tmp_path / "old.json"
    res.write_text(json.dumps(RESULT))
    into.write_text(json.dumps({"summary": {"x": 1}}))
    old.write_text(json.dumps({"summary": {"x": 0}, "probe_overhead_fraction_30_steps_before": 0.004}))
    assert le.main([str(res), "--into", str(into), "--before", str(old), "--before-source", "cost.json at abc"]) == 0
    doc = json.loads(into.read_text())
    assert doc["summary"] == {"x": 1}
    assert doc["before"] == {"source": "cost.json at abc", "doc": json.loads(old.read_text())}
    assert doc["final_latent_error"]["arms"]["38k:safesage"]["prompts"][1]["rel_l2_vs_pytorch"] == 0.123
    assert doc["final_latent_error"]["command"].startswith("python3 -m bench.quality.latent_errors ")
