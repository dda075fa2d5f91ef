"""bench/length/max_length.py (issue #40): the search over H3's frame grid with fake probes, what a bench.repro
row's outcome means there (on committed rows), the ratio fields, the JSON merge, the WxHxL sizes of
bench/repro, Preflight's per-arm prediction (the length model) and its check against the measured lengths,
and a whole call with the servers replaced by a fake worker (each arm starting at its predicted length, the hold, the output check without
it, unverified lengths, the in-limit error measured then reused, a second budget merged in)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.length import max_length_search as ms
from bench.repro import arms

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
GiB = 2 ** 30


@pytest.fixture(scope="module")
def grid():
    from safe_ops.ui.preflight import grid_lengths
    return grid_lengths(3600)


def _threshold(limit, fail=ms.OOM, faults=()):
    calls = []

    def probe(n):
        calls.append(n)
        return {"outcome": ms.FAULT if n in faults else (ms.COMPLETED if n <= limit else fail)}
    return probe, calls


# ------------------------------------------------------------------------------------ the grid
def test_grid_is_h3s_17k_plus_5_frames(grid):
    from safe_ops.models.h3.dims import h3_frame_count
    assert grid[:3] == [5, 22, 39] and grid[-1] == 3592 and len(grid) == 212
    assert all(n % 17 == 5 and h3_frame_count(n) == n for n in grid)
    assert [h3_frame_count(n - 1) for n in grid[1:]] == grid[1:]          # every length snaps up onto it


def test_token_count_is_comfyuis_own_at_1280x720():
    # bench/length/max_length counts with SafeSage's copy (its process must not import ComfyUI, which would
    # take GPU memory next to the hold); the copy must be ComfyUI's own count on the 17k+5 grid
    cli = pytest.importorskip("comfy.cli_args", reason="no ComfyUI on PYTHONPATH")
    cli.args.cpu = True                        # before comfy.model_management is imported
    pytest.importorskip("comfy.ldm.minimax.model", reason="this ComfyUI has no MiniMax H3")
    import comfy_extras.nodes_minimax_h3 as nodes
    from safe_ops.models.h3.dims import comfy_h3_tokens, h3_tokens
    for n in (124, 362, 515, 634, 1008):
        assert nodes.align_frame_count(n) == n
        assert h3_tokens(1280, 720, n).total == comfy_h3_tokens(1280, 720, n).total
    # 720/16 = 45 latent rows, padded to 46 for the 2x2 patch: 23 x 40 tokens a latent frame
    assert h3_tokens(1280, 720, 362).total == 107 * 920 + 2 * 603 + 256 == 99_902


# ------------------------------------------------------------------------------------ the search
@pytest.mark.parametrize("start", [124, 515, 634, 1008, 1994])
def test_monotone_threshold_found_exactly_from_any_start(grid, start):
    probe, calls = _threshold(600)
    r = ms.search(probe, grid, start, limit=20)
    assert calls[0] == start and r["start_frames"] == start
    assert (r["max_frames"], r["fail_above_frames"], r["resolved"], r["stop"]) == (600, 617, True, "resolved")
    assert r["fail_above_outcome"] == ms.OOM and r["non_monotone"] == []
    assert len(calls) == len(set(calls)) <= 12


def test_first_probe_is_preflights_length_snapped_down_onto_the_grid(grid):
    probe, calls = _threshold(600)
    ms.search(probe, grid, 640, limit=1)
    assert calls == [634]


def test_probe_limit_stops_an_unresolved_bracket(grid):
    probe, calls = _threshold(600)
    r = ms.search(probe, grid, 124, limit=2, grow=1.25)
    assert calls == [124, 158] and r["stop"] == "probe limit" and not r["resolved"]
    assert r["max_frames"] == 158 and r["fail_above_frames"] is None


def test_geometric_steps_up_and_down(grid):
    up, calls_up = _threshold(3592)
    ms.search(up, grid, 124, limit=4, grow=2.0)
    assert calls_up == [124, 260, 532, 1076]
    down, calls_down = _threshold(4)
    r = ms.search(down, grid, 1076, limit=10, shrink=2.0)
    assert calls_down == [1076, 532, 260, 124, 56, 22, 5]
    assert r["max_frames"] is None and r["resolved"] and r["fail_above_frames"] == 5


def test_a_fault_bounds_the_bracket_like_an_oom_and_says_so(grid):
    # a fault below the real limit (600): the bisection cannot see past it, the JSON says it was a fault
    probe, calls = _threshold(600, faults={532})
    r = ms.search(probe, grid, 532, limit=20)
    assert calls[0] == 532 and r["max_frames"] == 515 and r["fail_above_frames"] == 532
    assert r["fail_above_outcome"] == ms.FAULT and r["resolved"]


def test_non_monotone_failures_below_a_completed_length_are_listed(grid):
    probes = [{"frames": 515, "outcome": ms.FAULT}, {"frames": 600, "outcome": ms.COMPLETED},
              {"frames": 634, "outcome": ms.OOM}, {"frames": 617, "outcome": ms.UNFINISHED}]
    b = ms.bracket(probes, grid)
    assert b["max_frames"] == 600 and b["fail_above_frames"] == 634 and b["non_monotone"] == [515]
    assert not b["resolved"]                                  # 617 was not finished: still open
    assert ms.next_length(probes, grid, 515, 1.25, 1.25) == 617


def test_a_length_the_deadline_cut_is_not_probed_again(grid):
    calls = []

    def probe(n):
        calls.append(n)
        return {"outcome": ms.UNFINISHED}
    r = ms.search(probe, grid, 515, limit=5)
    assert calls == [515] and r["stop"] == "deadline" and r["max_frames"] is None


def test_deadline_stops_before_a_probe(grid):
    probe, calls = _threshold(600)
    budget = iter([True, False])
    r = ms.search(probe, grid, 515, limit=9, may_probe=lambda: next(budget))
    assert calls == [515] and r["stop"] == "deadline"


# ------------------------------------------------------------------------------------ outcomes
def _row(path, size, arm):
    doc = json.loads((RESULTS / path).read_text())
    return next(r for r in doc["runs"] if r["size"] == size and r["arm"] == arm)


def test_outcomes_of_committed_rows():
    assert ms.classify(_row("repro_sage22_sm120_h200.json", "169k", "sage"))[0] == ms.OOM     # exit 1
    assert ms.classify(_row("repro_server_sage22_sm120_h200.json", "169k", "sage"))[0] == ms.OOM  # server alive
    out, detail = ms.classify(_row("repro_h200.json", "169k", "sage"))
    assert out == ms.FAULT and "SIGABRT" in detail and "illegal memory access" in detail
    assert ms.classify(_row("repro_h200.json", "169k", "safesage")) == (ms.COMPLETED, "completed")


def test_outcomes_of_other_endings():
    t = {"outcome": "timeout after 150 s (phase: sampling)", "error": None}
    assert ms.classify(t)[0] == ms.FAULT and ms.classify(t, timeout_cut=True)[0] == ms.UNFINISHED
    py = {"outcome": "Python error in the prompt, server alive (phase: sampling)", "error": "ValueError: bad"}
    assert ms.classify(py) == (ms.FAULT, "Python error in the prompt, server alive (phase: sampling): ValueError: bad")
    cuda = {"outcome": "Python error, exit 1 (phase: sampling)", "error": "torch.AcceleratorError: CUDA error: out of memory"}
    assert ms.classify(cuda)[0] == ms.OOM                     # ComfyUI's is_oom takes it as an OOM too
    assert ms.classify({"outcome": "prompt rejected", "error": "prompt rejected: {}"})[0] == ms.ERROR


def test_judge_longest_first_wrong_then_correct():
    probes = [{"frames": n, "outcome": o} for n, o in ((260, ms.COMPLETED), (328, ms.COMPLETED),
                                                       (413, ms.COMPLETED), (515, ms.OOM))]
    rel = {413: 0.5, 328: 0.03, 260: 0.9}
    asked = []

    def ref(n):
        asked.append(n)
        return rel[n], None
    ms.judge(probes, ref, in_limit=0.02, factor=2.0)
    assert asked == [413, 328]                         # 260 not needed once 328 is correct
    assert [p["outcome"] for p in probes] == [ms.COMPLETED, ms.COMPLETED, ms.WRONG, ms.OOM]
    assert probes[1]["verified"] is True and "verified" not in probes[0]
    s = ms.arm_summary({"probes": probes}, [5, 260, 328, 413, 515], lambda n: n * 10)
    assert (s["max_frames"], s["fail_above_frames"], s["fail_above_outcome"], s["verified"]) == (328, 413, ms.WRONG, True)
    assert s["max_tokens"] == 3280 and s["fail_above_tokens"] == 4130


def test_judge_unverifiable_reference_goes_shorter():
    probes = [{"frames": 413, "outcome": ms.COMPLETED}, {"frames": 328, "outcome": ms.COMPLETED}]
    ms.judge(probes, lambda n: (None, "reference OOM") if n == 413 else (0.01, None), 0.02, 2.0)
    assert probes[0]["verified"] is False and probes[0]["unverified"] == "reference OOM" and probes[1]["verified"]
    s = ms.arm_summary({"probes": probes}, [328, 413], lambda n: n)
    assert (s["max_frames"], s["verified"], s["max_frames_verified"]) == (413, False, 328)


# ------------------------------------------------------------------------------------ ratios, merge
def _arm(mx, fail=None, verified=True):
    return {"max_tokens": mx, "fail_above_tokens": fail, "max_frames": mx and 1, "verified": verified}


def test_ratio_fields():
    r = ms.ratios({"safesage": _arm(200_000, 210_000), "sage": _arm(90_000, 100_000),
                   "pytorch": _arm(150_000, 160_000, verified=False)})
    assert r["safesage_over_unguarded_sage"] == 2.222 and r["best_other"] == "pytorch"
    assert r["safesage_over_best_other"] == 1.333
    assert r["safesage_over_unguarded_sage_bounds"] == [2.0, 2.333]
    assert r["goal"] == {"safesage_ge_2x_unguarded_sage": True, "safesage_ge_best_other": True}
    assert r["unverified_arms"] == ["pytorch"]
    short = ms.ratios({"safesage": _arm(150_000), "sage": _arm(90_000), "pytorch": _arm(160_000)})
    assert short["goal"] == {"safesage_ge_2x_unguarded_sage": False, "safesage_ge_best_other": False}
    none = ms.ratios({"safesage": _arm(150_000), "sage": _arm(None, 20_000)})
    assert none["safesage_over_unguarded_sage"] is None and "completed none" in none["safesage_over_unguarded_sage_note"]
    assert none["goal"]["safesage_ge_2x_unguarded_sage"] is True


def test_merge_adds_a_budget_and_refuses_another_setup():
    base = {k: 1 for k in ms.IDENTITY}
    a = dict(base, budgets={"24": {"x": 1}}, calls=[{"c": 1}], in_limit={"value": 0.04})
    b = dict(base, budgets={"32": {"x": 2}}, calls=[{"c": 2}], repo_rev="new")
    m = ms.merge(a, b)
    assert m["budgets"]["24"] == {"x": 1} and m["budgets"]["32"]["x"] == 2 and m["calls"] == [{"c": 1}, {"c": 2}]
    assert m["in_limit"] == {"value": 0.04} and m["repo_rev"] == "new"
    assert ms.merge(m, dict(b, budgets={"24": {"x": 3}}))["budgets"]["24"]["x"] == 3
    with pytest.raises(ValueError, match="another setup"):
        ms.merge(a, dict(b, width=2))
    assert ms.budget_key(24.0) == "24" and ms.budget_key(0.5) == "0.5"


# ------------------------------------------------------------------------------------ sizes
def test_sizes_by_name_or_dimensions():
    assert arms.parse_size("169k") == (1664, 960, 362, 256) and arms.SIZES["tiny"] == (64, 64, 22, 16)
    assert arms.parse_size("1280x720x243") == (1280, 720, 243, 256)
    assert arms.parse_size("64x64x56x16") == (64, 64, 56, 16)
    assert arms.parse_size(arms.size_name(1280, 720, 515)) == (1280, 720, 515, 256)
    assert arms.size_name(64, 64, 56, 16) == "64x64x56x16"
    for bad in ("1280x720", "1280x720x0", "axbxc", "1x2x3x4x5", "200k"):
        with pytest.raises(ValueError):
            arms.parse_size(bad)
    assert arms.size_dict("1280x720x243") == {"width": 1280, "height": 720, "length": 243, "text_len": 256}
    assert not arms.is_size("200k") and arms.is_size("38k")


# ------------------------------------------------------------------------------------ Preflight
def _rt():
    from safe_ops.facts.devices import Runtime, sage_family_for
    return Runtime("2.11", "13.0", "NVIDIA H100 80GB HBM3", (12, 0), "2.2.0", sage_family_for("2.2.0", (12, 0)),
                   None, "cudaMallocAsync", True, "0.30.0")


def test_preflights_prediction_is_the_length_models_per_arm():
    # bench.length.max_length records Preflight's longest length per arm (safe_ops.ui.length_model.longest, the
    # emulated arch's scenario) and starts each arm's search there; sage 1.0.6 is predicted as unguarded sage
    import argparse
    from bench.length import max_length
    from safe_ops.models.h3.dims import h3_tokens
    from safe_ops.ui import length_model as lm
    from safe_ops.ui import preflight as pf
    a = argparse.Namespace(emulate_arch="sm120", preflight_sage="2.2.0", width=1280, height=720, text_tokens=256,
                           max_frames=600)
    got = max_length.preflight_fit(a, 24.0, "NVIDIA H100 80GB HBM3")
    assert got["function"] == "safe_ops.ui.length_model.longest" and got["family"] == "sage2_sm120_fp8pv"
    sc = pf.scenarios_for(_rt(), 24 * GiB)[0]
    for arm, model_arm in (("safesage", "safesage"), ("sage", "sage"), ("pytorch", "pytorch"), ("sage1", "sage")):
        lg = lm.longest(model_arm, 24 * GiB, 1280, 720, scenario=sc, count=h3_tokens, max_length=600)
        row = got["arms"][arm]
        assert (row["max_frames"], row["max_tokens"], row["capped_by_max_frames"]) == (lg.frames, lg.tokens, lg.capped)
    assert got["arms"]["safesage"]["capped_by_max_frames"] and not got["arms"]["sage"]["capped_by_max_frames"]


def test_preflight_over_measured_per_arm():
    pf = {"arms": {"safesage": {"max_tokens": 220}, "sage": {"max_tokens": 100}, "pytorch": {"max_tokens": None}}}
    got = ms.preflight_vs_measured(pf, {"safesage": {"max_tokens": 200}, "sage": {"max_tokens": 125},
                                        "pytorch": {"max_tokens": 90}})
    assert got == {"preflight_over_measured": {"safesage": 1.1, "sage": 0.8}, "within_15pct": {"safesage": True,
                                                                                                 "sage": False}}
    assert ms.preflight_vs_measured({"max_tokens": 5}, {"safesage": {"max_tokens": 5}}) == {}


# ------------------------------------------------------------------------------------ a whole call
class FakeHold:
    held = False

    def __init__(self, free_gib, log):
        FakeHold.held = True
        self.bytes, self.total = int((80 - free_gib) * GiB), 80 * GiB

    def stop(self):
        FakeHold.held = False


#: the longest frames each arm completes under the hold (fake); without it the reference OOMs past 560
UNDER_HOLD = {"safesage": 583, "sage": 413, "pytorch": 481}


def _fake_row(rows_seen):
    import torch

    def run_row(*, comfy, ckpt, arm, size, work, steps, seed, cpu, emulate_arch, timeout, **kw):
        w, h, n, t = arms.parse_size(size)
        rows_seen.append((arm, size, FakeHold.held))
        log = Path(work) / f"{size}_{arm}.log"
        log.write_text("fake\n")
        ok = n <= (UNDER_HOLD[arm] if FakeHold.held else 560) if size != "38k" else True
        row = {"rc": 0 if ok else "execution_error", "wall_s": 1.0, "log": str(log), "latent": None,
               "worker": {"packed_tokens": n, "versions": {"sageattention": "2.2.0"}}}
        if not ok:
            row.update(outcome="Python error in the prompt, server alive (phase: sampling)",
                       error="torch.OutOfMemoryError: Allocation on device 0 would exceed allowed memory. (out of memory)")
            return row
        g = torch.Generator().manual_seed(n)
        base = torch.randn(1000, generator=g)
        noise = {"pytorch": 0.0, "safesage": 0.03, "sage": 0.04 if n < 400 else 0.5}[arm] if size != "38k" else \
            {"pytorch": 0.0, "sage": 0.04}[arm]
        lat = Path(work) / f"{size}_{arm}.pt"
        torch.save({"video": base + noise * torch.randn(1000, generator=g), "audio": torch.ones(3)}, lat)
        row.update(outcome="completed", error=None, latent=str(lat), worker=dict(row["worker"], memory={
            "torch_peak_allocated_gib": 1.0, "nvml_peak_process_gib": 2.0}))
        return row
    return run_row


def test_a_whole_call_with_fake_servers(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from bench.length import max_length
    from bench.repro import driver, worker
    seen = []
    monkeypatch.setattr(worker, "run_row", _fake_row(seen))
    monkeypatch.setattr(driver, "Ballast", FakeHold)
    ckpt = tmp_path / "h3.safetensors"
    ckpt.write_bytes(b"x" * 100)
    out = tmp_path / "max_length.json"
    common = ["--comfy", str(tmp_path), "--ckpt", str(ckpt), "--max-frames", "600", "--work", str(tmp_path / "w"),
              "--out", str(out), "--emulate-arch", "sm120", "--probe-limit", "6", "--grow", "1.2"]
    doc = max_length.main(common + ["--budget-gib", "22"])
    b = doc["budgets"]["22"]
    # the in-limit pair ran first, without the hold; every probe under it; the references after it
    assert seen[:2] == [("sage", "38k", False), ("pytorch", "38k", False)]
    assert doc["in_limit"]["value"] == pytest.approx(0.04, rel=0.15) and "measured" in doc["in_limit"]["source"]
    assert b["driver_cuda_initialized"] is False
    for arm, r in b["arms"].items():            # each arm starts at its predicted length
        assert r["probes"][0]["frames"] == b["preflight"]["arms"][arm]["max_frames"] and r["start_source"] == "Preflight"
        assert all(p["tokens"] > 0 and p["wall_s"] == 1.0 for p in r["probes"])
    assert all(held for arm, size, held in seen[2:2 + sum(len(r["probes"]) for r in b["arms"].values())])
    s, g, p = (b["arms"][k] for k in ("safesage", "sage", "pytorch"))
    # safesage completes 583 under the hold; its reference (no hold) OOMs past 560: unverified
    assert (s["max_frames"], s["verified"], s["resolved"]) == (583, False, True)
    assert "did not complete" in next(q for q in s["probes"] if q["frames"] == 583)["unverified"]
    assert s["max_frames_verified"] is not None and s["max_frames_verified"] < 583
    # sage completes up to 413 but its output is wrong from 400 frames: its longest correct is below
    assert any(q["outcome"] == ms.WRONG for q in g["probes"]) and g["max_frames"] < 400 and g["verified"]
    assert (p["max_frames"], p["verified"]) == (481, True) and p["probes"][0]["rel_l2_vs_reference"] == 0.0
    assert b["safesage_over_unguarded_sage"] == round(s["max_tokens"] / g["max_tokens"], 3)
    assert b["best_other"] == "pytorch" and b["unverified_arms"] == ["safesage"]
    for arm, r in b["arms"].items():
        assert b["preflight"]["preflight_over_measured"][arm] == \
            round(b["preflight"]["arms"][arm]["max_tokens"] / r["max_tokens"], 3)
    on_disk = json.loads(out.read_text())
    assert on_disk["budgets"]["22"]["arms"]["safesage"]["max_frames"] == 583 and len(on_disk["calls"]) == 1
    # a second budget merges in; the in-limit error and the references come from the first call
    n_refs = len([x for x in seen if x[0] == "pytorch" and not x[2] and x[1] != "38k"])
    seen.clear()
    doc2 = max_length.main(common + ["--budget-gib", "24", "--start-frames", "sage=328"])
    assert sorted(doc2["budgets"]) == ["22", "24"] and len(doc2["calls"]) == 2
    assert doc2["in_limit"]["reused_from_an_earlier_call"] and ("sage", "38k", False) not in seen
    assert "measured" in doc2["in_limit"]["source"]
    b24 = doc2["budgets"]["24"]
    assert b24["preflight"]["arms"]["safesage"]["capped_by_max_frames"]
    assert b24["arms"]["sage"]["start_source"] == "--start-frames"
    assert b24["arms"]["sage"]["probes"][0]["frames"] == 328
    cached = [k for k, v in b24["references"].items() if v.get("cached")]
    assert cached and n_refs > 0
    with pytest.raises(ValueError, match="another setup"):
        max_length.main(common + ["--budget-gib", "24", "--width", "1344"])


def test_one_budget_split_over_two_calls_merges_per_arm(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from bench.length import max_length
    from bench.repro import driver, worker
    monkeypatch.setattr(worker, "run_row", _fake_row([]))
    monkeypatch.setattr(driver, "Ballast", FakeHold)
    ckpt = tmp_path / "h3.safetensors"
    ckpt.write_bytes(b"x" * 100)
    common = ["--comfy", str(tmp_path), "--ckpt", str(ckpt), "--max-frames", "600", "--work", str(tmp_path / "w"),
              "--out", str(tmp_path / "m.json"), "--probe-limit", "6", "--grow", "1.2", "--budget-gib", "22",
              "--in-limit-error", "0.04", "--start-frames", "pytorch=413", "--start-note", "committed rows"]
    first = max_length.main(common + ["--arms", "safesage", "sage"])["budgets"]["22"]
    assert sorted(first["arms"]) == ["safesage", "sage"] and first["best_other"] == "sage"
    b = max_length.main(common + ["--arms", "pytorch"])["budgets"]["22"]
    assert list(b["arms"]) == ["safesage", "sage", "pytorch"] and len(b["commands"]) == 2
    assert b["arms"]["pytorch"]["start_source"] == "--start-frames" and b["start_frames"]["note"] == "committed rows"
    assert b["best_other"] == "pytorch"                      # the summary is over all three arms again
    s, p = b["arms"]["safesage"]["max_tokens"], b["arms"]["pytorch"]["max_tokens"]
    assert b["safesage_over_best_other"] == round(s / p, 3)
    assert b["preflight"]["preflight_over_measured"]["safesage"] == \
        round(b["preflight"]["arms"]["safesage"]["max_tokens"] / s, 3)
    assert set(b["preflight"]["preflight_over_measured"]) == {"safesage", "sage", "pytorch"}


def test_merge_budget_drops_a_stale_summary_while_an_arm_is_unjudged():
    old = {"command": "a", "arms": {"safesage": _arm(200), "sage": _arm(100)}, "best_other": "sage",
           "safesage_over_unguarded_sage": 2.0, "goal": {}, "preflight": {"max_tokens": 400, "gap_over_10pct": True}}
    live = {"command": "b", "arms": {"pytorch": {"probes": []}}}
    m = ms.merge_budget(old, live)
    assert "safesage_over_unguarded_sage" not in m and "best_other" not in m and "goal" not in m
    assert m["preflight"] == {"max_tokens": 400} and m["commands"] == ["a", "b"]
    old["preflight"]["arms"] = {"safesage": {"max_tokens": 400}}
    done = ms.merge_budget(old, {"command": "b", "arms": {"pytorch": _arm(300)}})
    assert done["best_other"] == "pytorch" and done["preflight"]["preflight_over_measured"] == {"safesage": 2.0}
    assert "gap_over_10pct" not in done["preflight"]


def test_on_a_gpu_preflights_prediction_is_asked_in_a_child_that_sees_no_gpu(tmp_path, monkeypatch):
    """Call.preflight off the CPU smoke: a child ``--preflight-only`` run with CUDA_VISIBLE_DEVICES empty
    (the node code it runs opens a CUDA context where it can, which the driver must not hold before the
    hold is sized), whose answer is the in-process one."""
    import subprocess as sp

    from bench.length import max_length
    argv = ["--comfy", "x", "--ckpt", "x", "--budget-gib", "24", "--out", str(tmp_path / "o.json")]
    a = max_length.parser().parse_args(argv)
    seen = {}
    real_run = sp.run

    def run(cmd, **kw):
        seen["cmd"], seen["visible"] = cmd, kw["env"].get("CUDA_VISIBLE_DEVICES")
        return real_run(cmd, **kw)
    monkeypatch.setattr(max_length.subprocess, "run", run)
    fake_call = type("C", (), {"a": a, "argv": argv, "gpu": "NVIDIA H100 80GB HBM3"})()
    got = max_length.Call.preflight(fake_call, 24.0)
    assert seen["visible"] == "" and "--preflight-only" in seen["cmd"]
    assert got == max_length.preflight_fit(a, 24.0, "NVIDIA H100 80GB HBM3")
    # Preflight's SafeSage length at 24 GiB was the grid's top, 3,592 frames, before issue 47; now 753
    assert got["arms"]["safesage"]["max_frames"] == 753


def test_preflights_max_length_is_the_preflight_nodes_length_maximum():
    """The node lists its inputs without importing safe_ops (it is listed even when safe_ops fails to
    import), so its ``length`` maximum is written there: it must be preflight.MAX_LENGTH."""
    import re

    from safe_ops.ui import preflight as pf
    src = (Path(__file__).resolve().parents[2] / "nodes" / "safe_sage.py").read_text()
    m = re.search(r'io\.Int\.Input\("length",[^)]*max=(\d+)', src)
    assert m and int(m.group(1)) == pf.MAX_LENGTH
