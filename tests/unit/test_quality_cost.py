"""bench/quality/quality_cost.py: the guard's step-1 cost as a share of the sampling time in the graph's own
steps, 20 and 2 (issue 46 goal 7; first issue #37 point 4)."""
import copy
import json
import os
import shlex

import pytest

from bench.quality import quality_cost

RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "results")


def _row(arm, steps, later=(), blocks=50):
    return {"arm": arm, "rc": 0, "worker": {
        "s_per_step": steps, "blocks": blocks, "packed_tokens": 37966, "versions": {"gpu": "GPU X"},
        "later_prompts": [{"prompt": i + 2, "outcome": "completed", "s_per_step": s} for i, s in enumerate(later)],
        "memory": {"torch_peak_allocated_gib": 4.5}}}


def _doc():
    return {"command": "python -m bench.repro all ...", "repo_rev": "abc1234", "steps": 3, "runs": [
        _row("safesage_faults", [30.0, 7.0, 7.0], [[7.1, 7.0, 7.0]]),
        _row("safesage_refonly", [9.0, 7.0, 7.0], [[7.31, 7.0, 7.0]]),
        _row("safesage", [40.0, 7.0, 7.0], [[7.73, 7.0, 7.0]]),
    ]}


def test_shares_per_prompt_in_the_graphs_steps_20_and_2():
    c = quality_cost.path_cost(_doc())
    later = c["per_prompt"][1]
    # 0.63 s extra over N x 7.0 s: the graph's 3 steps 0.03, 20 steps 0.0045, 2 steps 0.045
    assert later["probe_share"] == {"graph_steps": 3, "graph": pytest.approx(0.03), "20_steps": pytest.approx(0.0045),
                                    "2_steps": pytest.approx(0.045)}
    assert later["reference_share"]["20_steps"] == pytest.approx(0.21 / 140, abs=1e-5)
    first = c["per_prompt"][0]
    assert first["server_prompt"] == "first" and later["server_prompt"] == "later"
    assert first["probe_share"]["2_steps"] == pytest.approx(10 / 14, abs=1e-5)          # (40 - 30) / (2 x 7)
    assert c["first_prompt"]["probe_share"] == first["probe_share"]
    assert c["later_prompt"]["probe_share"] == later["probe_share"] and c["later_prompt"]["prompt"] == 2
    assert quality_cost.FIRST_PROMPT in first["includes"] and later["includes"] == []
    assert c["reference_share"] == pytest.approx(0.333) and c["candidates_share"] == pytest.approx(0.667)
    assert c["probe_ms_per_block"] == pytest.approx(12.6)         # 0.63 s over 50 blocks
    assert c["graph_steps"] == 3 and c["median_step_from_step2_s"] == 7.0
    assert c["remembered_prompt"].startswith("not measured")


def test_the_30_step_figure_is_kept_only_under_a_key_that_says_so():
    c = quality_cost.path_cost(_doc())
    assert c["probe_overhead_fraction_30_steps_before"] == pytest.approx(0.003)       # 0.63 / (30 x 7)
    assert c["probe_overhead_fraction_first_prompt_30_steps_before"] == pytest.approx(0.04762)
    assert c["per_prompt"][1]["reference_fraction_30_steps_before"] == pytest.approx(0.001)
    text = json.dumps(c)
    assert '"probe_overhead_fraction"' not in text and '"reference_fraction"' not in text


def test_later_prompt_targets_per_schedule():
    # 0.63 s: 0.45 % of 20 steps (met), 4.5 % of 2 steps (missed)
    assert quality_cost.path_cost(_doc())["target_met"] == {"later_prompt_20_steps": True,
                                                            "later_prompt_2_steps": False}
    d = _doc()
    d["runs"][2]["worker"]["later_prompts"][0]["s_per_step"] = [7.2, 7.0, 7.0]     # 0.1 s: 0.71 % of 2 steps
    assert quality_cost.path_cost(d)["target_met"] == {"later_prompt_20_steps": True, "later_prompt_2_steps": True}
    d["runs"][2]["worker"]["later_prompts"][0]["s_per_step"] = [7.9, 7.0, 7.0]     # 0.8 s: 0.57 % of 20 steps
    assert quality_cost.path_cost(d)["target_met"]["later_prompt_20_steps"] is False


def test_one_prompt_per_server_names_the_later_prompt_not_measured():
    d = _doc()
    d["runs"][2]["worker"]["later_prompts"][0]["outcome"] = "error"      # a failed later prompt is not a prompt
    c = quality_cost.path_cost(d)
    assert c["prompts"] == 1 and c["later_prompt"] == quality_cost.NOT_MEASURED_LATER
    assert c["target_met"] == {"later_prompt_20_steps": None, "later_prompt_2_steps": None}
    assert c["probe_overhead_fraction_30_steps_before"] == pytest.approx(0.04762)
    ex = quality_cost.exclusions({"p": c})
    assert any(e.startswith("p: later prompt not measured") for e in ex)
    assert any(e.startswith("p: remembered prompt not measured") for e in ex)


def _with_probe_counts(d, counts):
    """The guarded row as bench.repro --prompts N records it: the guard's cumulative probes after each prompt."""
    w = d["runs"][2]["worker"]
    w["safesage_quality_first_prompt"] = {"quality": {"probes": counts[0]}}
    for p, n in zip(w["later_prompts"], counts[1:]):
        p["safesage_quality"] = {"quality": {"probes": n}}
    return d


def test_a_later_prompt_that_ran_no_probe_is_the_remembered_prompt():
    d = _doc()
    for r, s in zip(d["runs"], ([7.12, 7.0, 7.0], [7.1, 7.0, 7.0], [7.13, 7.0, 7.0])):
        r["worker"]["later_prompts"].append({"prompt": 3, "outcome": "completed", "s_per_step": s})
    c = quality_cost.path_cost(_with_probe_counts(copy.deepcopy(d), [50, 100, 100]))     # prompt 3: no probe
    assert [e["server_prompt"] for e in c["per_prompt"]] == ["first", "later", "remembered"]
    assert [e["guard_probes"] for e in c["per_prompt"]] == [50, 50, 0]
    assert c["remembered_prompt"]["prompt"] == 3
    assert c["remembered_prompt"]["probe_share"]["20_steps"] == pytest.approx(0.01 / 140, abs=1e-5)
    assert c["later_prompt"]["prompt"] == 2                 # the figures stay the last prompt that probed
    assert c["probe_ms_per_block"] == pytest.approx(12.6)
    assert not any("remembered prompt not measured" in e for e in quality_cost.exclusions({"p": c}))
    # every later prompt remembered: the later prompt is the one not measured
    c = quality_cost.path_cost(_with_probe_counts(copy.deepcopy(d), [50, 50, 50]))
    assert c["later_prompt"].startswith("not measured") and c["remembered_prompt"]["prompt"] == 3
    assert c["target_met"] == {"later_prompt_20_steps": None, "later_prompt_2_steps": None}
    # no counts recorded (rows before issue 46): every later prompt probed
    assert [e["server_prompt"] for e in quality_cost.path_cost(d)["per_prompt"]] == ["first", "later", "later"]


def test_a_labelled_one_time_cost_is_kept_and_named():
    c = quality_cost.path_cost(_doc(), {1: ["the PTX JIT"]})
    assert c["first_prompt"]["includes"] == [quality_cost.FIRST_PROMPT, "the PTX JIT"]
    assert c["first_prompt"]["probe_share"]["20_steps"] == pytest.approx(10 / 140, abs=1e-5)    # kept
    assert "p: prompt 1 includes the PTX JIT" in quality_cost.exclusions({"p": c})
    with pytest.raises(SystemExit, match=r"prompt\(s\) \[3\]"):
        quality_cost.path_cost(_doc(), {3: ["x"]})


def test_emulated_dispatch_on_another_card_is_named():
    d = _doc()
    d["runs"][2]["worker"].update(emulated_arch="sm120", real_arch=["sm90"])
    c = quality_cost.path_cost(d)
    assert c["timed_on"].startswith("GPU X (sm90) speeds with sm120 dispatch emulated")
    assert any("sm120 dispatch emulated" in e for e in quality_cost.exclusions({"p": c}))
    d["runs"][2]["worker"]["real_arch"] = ["sm120"]
    assert quality_cost.path_cost(d)["timed_on"] is None


def test_rows_of_different_step_counts_have_no_one_schedule():
    d = _doc()
    d["runs"][0]["worker"]["later_prompts"][0]["s_per_step"] = [7.1, 7.0]
    with pytest.raises(SystemExit, match="different step counts"):
        quality_cost.path_cost(d)
    d = _doc()
    d["steps"] = 2
    with pytest.raises(SystemExit, match="the result says 2"):
        quality_cost.path_cost(d)


def test_missing_arm_says_which_rows_it_has():
    d = _doc()
    d["runs"] = d["runs"][:2]
    with pytest.raises(SystemExit, match="safesage_faults, safesage_refonly"):
        quality_cost.path_cost(d)


def test_cli_writes_each_path_the_targets_and_the_exclusions(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_doc()))
    d = _doc()
    d["runs"][2]["worker"]["later_prompts"][0]["s_per_step"] = [8.26, 7.0, 7.0]     # 1.16 s: 0.83 % of 20 steps
    b.write_text(json.dumps(d))
    out = tmp_path / "o.json"
    quality_cost.main([str(a), str(b), "--path", "p1", "--path", "p2", "--out", str(out),
                       "--includes", "p2:1=the PTX JIT"])
    doc = json.loads(out.read_text())
    assert doc["summary"]["p2"]["later_prompt"]["probe_share"]["20_steps"] == pytest.approx(0.00829, abs=1e-5)
    assert doc["target_met"] == {"later_prompt_20_steps": False, "later_prompt_2_steps": False}
    assert doc["targets"]["later_prompt_2_steps"] == "<= 0.01" and "not measured" in doc["targets"]["remembered_prompt"]
    assert doc["probe_overhead_fraction_30_steps_before"] == pytest.approx(0.00552) and "probe_overhead_fraction" not in doc
    assert "p2: prompt 1 includes the PTX JIT" in doc["exclusions"]
    assert doc["command"].startswith("python3 -m bench.quality.quality_cost ") and set(doc["paths"]) == {"p1", "p2"}
    with pytest.raises(SystemExit, match="PATH:PROMPT"):
        quality_cost.main([str(a), "--path", "p1", "--out", str(out), "--includes", "p9:1=x"])


def _legacy():
    raw = {"steps": 3, "plan": ["38k:safesage", "38k:safesage_faults", "38k:safesage"], "runs": [
        _row("safesage", [9.0, 7.0, 7.0]), _row("safesage_faults", [8.0, 7.0, 7.0]),
        _row("safesage", [8.5, 7.0, 7.0])]}
    return {"probe_overhead_fraction": 0.0048, "probe_overhead_fraction_runs": [0.0048, 0.0024],
            "formula": "... / (30 x median step ...)", "probe_overhead_fraction_before": 0.0059,
            "probe_overhead_fraction_before_source": "x.json",
            "synthetic": {"probe_ms": 1.0, "probe_overhead_fraction": 0.001}, "raw": raw}


def test_annotate_adds_the_shares_to_an_older_json_and_renames_its_30_step_keys():
    doc = quality_cost.annotate(_legacy(), {"2:safesage": ["the PTX JIT"]}, [])
    by = {p["guarded_row"]: p for p in doc["pairs"]}
    assert by["0:safesage"]["probe_share"]["20_steps"] == pytest.approx(1 / 140, abs=1e-5)   # 1 s / (20 x 7)
    assert by["2:safesage"]["probe_share"]["2_steps"] == pytest.approx(0.5 / 14, abs=1e-5)
    assert quality_cost.FIRST_ROW in by["0:safesage"]["includes"]             # the plan's first row
    assert quality_cost.FIRST_ROW not in by["2:safesage"]["includes"] and "the PTX JIT" in by["2:safesage"]["includes"]
    assert doc["summary"]["first_prompt"]["probe_share_range"]["2_steps"] == [pytest.approx(0.03571, abs=1e-5),
                                                                              pytest.approx(0.07143, abs=1e-5)]
    assert doc["summary"]["later_prompt"] == quality_cost.NOT_MEASURED_LATER
    assert doc["probe_overhead_fraction_30_steps_before"] == 0.0048 and "probe_overhead_fraction" not in doc
    assert doc["probe_overhead_fraction_runs_30_steps_before"] == [0.0048, 0.0024]
    assert doc["earlier_run"] == {"source": "x.json", "probe_overhead_fraction_30_steps_before": 0.0059}
    assert doc["synthetic"] == {"probe_ms": 1.0, "probe_overhead_fraction_30_steps_before": 0.001}
    with pytest.raises(SystemExit, match="raw rows are"):
        quality_cost.annotate(_legacy(), {"5:safesage": ["x"]}, [])


def _committed(name):
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


@pytest.mark.parametrize("name", ["quality_guard_cost_38k_h100.json", "quality_guard_cost_169k_h100.json"])
def test_the_committed_cost_json_is_what_its_command_makes_from_its_rows(name, tmp_path, monkeypatch):
    """The committed figures come from the committed rows by the tool as it is now (no hand edit, no
    stale formula): its recorded command, run again, gives the same summary and per-prompt figures."""
    doc = _committed(name)
    argv = shlex.split(doc["command"])[3:]
    argv[argv.index("--out") + 1] = str(tmp_path / "o.json")
    monkeypatch.chdir(os.path.join(RESULTS, "..", ".."))
    quality_cost.main(argv)
    again = json.loads((tmp_path / "o.json").read_text())
    for key in ("summary", "target_met", "exclusions", "probe_overhead_fraction_30_steps_before"):
        assert again[key] == doc[key], key
    for path, p in doc["paths"].items():
        assert again["paths"][path]["per_prompt"] == p["per_prompt"]


def test_the_committed_figures_did_not_move():
    """The regenerated JSONs keep the measured numbers: the old 30-step figures are those committed
    before issue 46 (0.31 % / 0.35 % from the 2nd prompt, 0.12 % at 169k), now under their own keys."""
    # the 38k figures of that run are kept under "before" (its doc) since the drifting-checkpoint run replaced them
    d38 = _committed("quality_guard_cost_38k_h100.json")["before"]["doc"]
    assert d38["paths"]["sage22_sm120"]["probe_overhead_fraction_30_steps_before"] == 0.0031
    assert d38["paths"]["sage22_sm89"]["probe_overhead_fraction_30_steps_before"] == 0.0035
    assert d38["paths"]["sage22_sm120"]["per_prompt"][1]["step1_s"] == {
        "safesage_faults": 7.412, "safesage_refonly": 7.621, "safesage": 8.093}
    assert _committed("quality_guard_cost_169k_h100.json")["probe_overhead_fraction_30_steps_before"] == 0.00118
    legacy = _committed("quality_guard_cost_38k_h200.json")
    assert legacy["probe_overhead_fraction_runs_30_steps_before"] == [0.00349, 0.00262]
    assert legacy["raw"]["runs"][0]["worker"]["s_per_step"] == [8.713, 6.4, 6.419, 6.388]


@pytest.mark.parametrize("name", ["quality_guard_cost_38k_h200.json", "quality_guard_cost_169k_h200.json",
                                  "quality_guard_cost_38k_sm120_h100.json"])
def test_an_annotated_older_json_is_what_its_command_makes_from_its_raw_rows(name, tmp_path):
    doc = _committed(name)
    argv = shlex.split(doc["annotated_by"])[3:]
    copy = tmp_path / name
    copy.write_text(json.dumps(doc))
    argv[argv.index("--annotate") + 1] = str(copy)
    quality_cost.main(argv)
    again = json.loads(copy.read_text())
    for key in ("pairs", "summary", "target_met", "probe_overhead_fraction_30_steps_before"):
        assert again[key] == doc[key], key
    assert "probe_overhead_fraction" not in doc
