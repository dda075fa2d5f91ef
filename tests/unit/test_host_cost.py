"""bench/cost/host_cost.py's plumbing on the CPU (issue #39 point 2): its ratios are computed from its arms
(a fake arm twice as slow reads ~2; the e2e ratio is the steps' medians from step 2 on), and the
``--cpu --tiny`` smoke runs in-process through ComfyUI's ModelPatcher, SafeSage's node entry point and
the tests' fake kernel families, writing every field; the GPU-only parts skip, saying why. Timings
here are never checked for speed.

Needs ComfyUI (.ci/run puts COMFYUI_PATH on PYTHONPATH); skipped, with the reason, without it."""
from __future__ import annotations

import importlib.util
import json
import os
import statistics
import sys
import time

import pytest

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
if importlib.util.find_spec("comfy") is None:
    if not COMFYUI_PATH or not os.path.isfile(os.path.join(COMFYUI_PATH, "comfy", "model_patcher.py")):
        _reason = "ComfyUI is not importable and COMFYUI_PATH names no tree (bash .ci/run sets it)"
        print(f"\n[test_host_cost] skipped: {_reason}")
        pytest.skip(_reason, allow_module_level=True)
    sys.path.insert(0, COMFYUI_PATH)          # a test may; bench/ never does (test_bench_imports)
import comfy.cli_args  # noqa: E402

comfy.cli_args.args.cpu = True     # before comfy.model_management is imported (here or by the pack's routes)
from bench.cost import host_cost, host_cost_e2e, host_cost_timing  # noqa: E402


def busy(us: float):
    def f():
        end = time.perf_counter() + us / 1e6
        while time.perf_counter() < end:
            pass
    return f


class _FakeNs:
    """A perf_counter_ns that only the fake arms move: the ratio then depends on the plumbing alone, not on
    how busy this machine's CPU is (a real busy-wait pair read 5.7 instead of 2 on a loaded CI machine)."""

    def __init__(self):
        self.ns = 0

    def __call__(self):
        return self.ns

    def arm(self, us: float):
        def f():
            self.ns += int(us * 1e3)
        return f


def test_a_fake_arm_twice_as_slow_reads_two(monkeypatch):
    import torch
    clock = _FakeNs()
    monkeypatch.setattr(host_cost_timing.time, "perf_counter_ns", clock)
    arms = host_cost_timing.host_arms({"slow": clock.arm(400), "fast": clock.arm(200)}, calls=5,
                                      dev=torch.device("cpu"), min_reps=7, max_reps=7, deadline=0.0)
    assert arms["slow"]["rounds_us"] == [400.0] * 7 and arms["fast"]["rounds_us"] == [200.0] * 7, arms
    r = host_cost_timing.ratio_of(arms["slow"]["rounds_us"], arms["fast"]["rounds_us"])
    assert r["ratio"] == 2.0, r
    assert r["rounds"] == 7 and r["per_round"][0] <= r["ratio"] <= r["per_round"][1]
    assert r["ratio"] == round(statistics.median(arms["slow"]["rounds_us"]) /
                               statistics.median(arms["fast"]["rounds_us"]), 4)
    assert arms["fast"]["gpu_us_per_call"] is None, "no device time on the CPU"


def test_host_rounds_run_until_their_deadline():
    import torch
    t0 = time.perf_counter()
    arms = host_cost_timing.host_arms({"a": busy(50), "b": busy(50)}, calls=4, dev=torch.device("cpu"), min_reps=2,
                                      max_reps=10_000, deadline=time.perf_counter() + 0.3)
    took = time.perf_counter() - t0
    assert 0.3 <= took < 3.0 and arms["a"]["host_us"]["n"] > 2, (took, arms["a"]["host_us"])


def test_interleave_alternates_and_stops_at_the_deadline_after_the_minimum():
    order, t = [], [0.0]

    def arm(name):
        def f():
            order.append(name)
            t[0] += 1.0
            return t[0]
        return f
    out = host_cost_timing.interleave({"a": arm("a"), "b": arm("b")}, min_reps=3, max_reps=50, deadline=4.5,
                                      clock=lambda: t[0])
    assert order == ["a", "b"] * 3, "ABAB..., and the minimum is run although the deadline passed at round 3"
    assert len(out["a"]) == len(out["b"]) == 3


def test_e2e_ratio_is_the_median_step_from_step_2_and_step_1_is_apart():
    runs = {"node": [[10.0, 2.0, 2.0, 2.0], [12.0, 2.2, 2.2, 2.2]],
            "plain": [[5.0, 1.0, 1.0, 1.0], [5.0, 1.1, 1.1, 1.1]]}
    s = host_cost_e2e.e2e_summary(runs, "node", "plain")
    assert s["ratio"] == 2.0 and s["per_pair"] == [2.0, 2.0] and s["pairs"] == 2
    assert s["step1_ms"]["node"]["median"] == 11.0 and s["step1_extra_ms"] == 6.0
    assert s["steps_from_2_ms"]["plain"]["n"] == 6
    assert s["per_step_ratio"] == [2.2, 2.0, 2.0, 2.0], "per step index: the median over runs, node / plain"


def test_legacy_hop_change_needs_both_tags():
    row = lambda us: {"host_us": {"median": us}}  # noqa: E731
    assert host_cost.hop_change({"after": {"legacy_hop_on_legacy_stream": row(1.0)}}) is None
    ch = host_cost.hop_change({"before": {"legacy_hop_on_legacy_stream": row(8.0),
                                          "torch.cuda.current_stream": row(4.0), "pid": 1},
                               "after": {"legacy_hop_on_legacy_stream": row(1.0), "torch.cuda.current_stream": row(2.0),
                                         "pid": 2}})
    assert ch["after_over_before"] == {"legacy_hop_on_legacy_stream": 0.125, "torch.cuda.current_stream": 0.5}
    assert ch["normalised_by_current_stream"] == {"legacy_hop_on_legacy_stream": 0.25}, "the host's drift taken out"
    assert "two processes" in ch["note"]


def test_cpu_tiny_smoke_writes_every_field_from_its_arms(tmp_path, fq):
    """With the tests' fake families installed (a CPU "sage" and "ck" family), the guarded section
    times each; the e2e runs ComfyUI's ModelPatcher patched by the node's entry point."""
    out = tmp_path / "host_cost_cpu.json"
    res = host_cost.main(["--cpu", "--tiny", "--out", str(out)])
    d = json.loads(out.read_text())
    assert d["command"].startswith("python3 -m bench.cost.host_cost") and d["device"] == "cpu" and d["tiny"]
    tl = d["runs"][-1]["timeline"]
    assert tl and all(len(m) == 2 for m in tl) and tl[-1][1].startswith("wrote")
    assert "method" in d and "host_time" in d["method"]

    e = d["e2e"]
    assert e["runs_per_arm"] >= 2 and e["blocks"] == 2 and e["steps_per_run"] == 3
    rest = {k: [t for r in v for t in r[1:]] for k, v in e["runs_ms"].items()}
    assert d["e2e_small_over_plain"] == e["e2e_small_over_plain"] == pytest.approx(
        statistics.median(rest["node"]) / statistics.median(rest["plain"]), abs=2e-3)
    assert e["step1_ms"]["node"]["n"] == e["runs_per_arm"]
    assert e["ran"]["forwards"] == e["runs_per_arm"] * 3, "the node's APPLY_MODEL wrapper saw every step"
    assert e["ran"]["attention_calls"] == e["runs_per_arm"] * 3 * 2, "each block's call reached the override"
    assert any("kernel policy 'auto'" in line for line in e["node_status"]), "the node's defaults"

    g = d["guarded"]["families"]
    assert set(g) >= {fq.SAGE, fq.KITCHEN}, g.keys()
    for fam in (fq.SAGE, fq.KITCHEN):
        row = g[fam]
        assert row["plans"] and all(p[1] == fam for p in row["plans"]), row["plans"]
        assert row["guarded_over_kernel_host"] == host_cost_timing.ratio_of(row["guarded"]["rounds_us"],
                                                                            row["kernel"]["rounds_us"])["ratio"]
        assert d["guarded_over_kernel_host"][fam] == row["guarded_over_kernel_host"]
        assert row["guard_us"] == round(row["guarded"]["host_us"]["median"] - row["kernel"]["host_us"]["median"], 2)
        assert "skipped" in row["kernel_gpu_ms"], "the 38k GPU time needs a GPU"
        assert "adapter" in row["kernel_call"]

    p = d["passthrough"]
    arms = p["arms"]
    assert p["sdpa_policy"]["ratio"] == host_cost_timing.ratio_of(arms["handed_on_sdpa_policy"]["rounds_us"],
                                                                  arms["comfy"]["rounds_us"])["ratio"]
    assert d["passthrough_over_comfy_host"] == max(p["sdpa_policy"]["ratio"], p["masked_defaults"]["ratio"])
    assert p["ran"]["fallbacks"] > 0, "the masked calls were handed on"

    assert "CUDA" in d["skipped"]["legacy_hop"] and "legacy_hop" not in d
    assert res["e2e_small_over_plain"] == d["e2e_small_over_plain"]

    # a later --legacy-hop run keeps what the file holds (here it skips too: no GPU)
    host_cost.main(["--cpu", "--legacy-hop", "--tag", "before", "--out", str(out)])
    d2 = json.loads(out.read_text())
    assert d2["e2e"] == e and d2["sections_run"] == ["legacy_hop"] and "legacy_hop" in d2["skipped"]
    assert [r["sections"] for r in d2["runs"]] == [list(host_cost.SECTIONS), ["legacy_hop"]]
    assert d2["runs"][0]["timeline"] == tl, "the first process's timeline is kept"


def test_host_seconds_shrink_when_the_run_is_behind_its_budget():
    from types import SimpleNamespace
    a = SimpleNamespace(budget_s=110.0, host_s=3.0, host_min_s=1.0)
    clock = SimpleNamespace(now=lambda: 10.0)
    b = host_cost_timing.HostBudget(a, clock, measurements=5)
    assert b.deadline() - time.perf_counter() == pytest.approx(3.0, abs=0.05), "on time: --host-s"
    clock.now = lambda: 110.0 - host_cost_timing.RESERVE_S - 6.0    # 6 s left for the 4 measurements left
    assert b.deadline() - time.perf_counter() == pytest.approx(1.5, abs=0.05)
    clock.now = lambda: 200.0                                        # past the budget: the floor
    assert b.deadline() - time.perf_counter() == pytest.approx(1.0, abs=0.05)
