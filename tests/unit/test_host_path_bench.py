"""bench/cost/host_path.py runs the pack's real override on the CPU and reports what issue #29 names
(its numbers are timings: checked here for shape, never for speed)."""
from bench.cost import host_path
from safe_ops.ui import run_stats


def test_measure_reports_each_form_and_the_headlines():
    run_stats.reset()
    m = host_path.measure("cpu", calls=20, rounds=1)
    assert set(m["rows"]) == {f"{q}:{f}" for q in ("faults only", "balanced", "balanced, blocks moved")
                              for f in ("3d", "4d_hnd_views")}
    row = m["rows"]["balanced:3d"]
    assert m["host_us_per_guarded_call"] == max(r["host_us_per_guarded_call"] for r in m["rows"].values())
    assert abs(row["host_us_per_guarded_call"] - (row["guarded_us"] - row["kernel_alone_us"])) <= 0.011
    assert m["hop"] is None and m["host_us_per_hop_call"] is None, "the hop needs a GPU"
    snap = run_stats.snapshot()
    assert snap["plan:direct"] > 0 and snap["fallbacks"] > 0, "the guarded calls ran the null kernel, the masked ones not"
    assert m["ran"]["plan:direct"] == snap["plan:direct"] and m["ran"]["fallbacks"] == snap["fallbacks"]
    run_stats.reset()
