"""The quality guard's outcome where the user looks (issue #36 point 5), on the CPU, no ComfyUI:

* quality/outcome.py's one-line summary of a run's per-block choices;
* ui/events.py: an event handed to ComfyUI's ``PromptServer.instance.send_sync`` (a stand-in
  ``server`` module here), as plain JSON, to the prompt's client; nothing without a server; an
  error sending contained and logged once;
* guard.py: one ``safesage.quality`` event per sampling run at its end, carrying what
  ``/safesage/stats`` holds in ``quality_last_run`` (the blocks and the summary).

The guard runs are those of test_quality_guard.py (its fake families, blocks and helpers).
"""
from __future__ import annotations

import logging
import sys
import types

import pytest

pytest.importorskip("torch")

from safe_ops.quality.outcome import summary  # noqa: E402
from safe_ops.ui import events  # noqa: E402
from test_quality_guard import NB, OUTLIERS, blocks, forward, make, sample, schedule, stats  # noqa: E402,F401


def entry(block, planned="sage2", error=0.01, family=None, target=0.045, after=None, rule=None):
    fam = family or planned
    return {"block": block, "planned": planned, "planned_error": error, "family": fam, "target": target,
            "moved": fam != planned, "error": after if fam != planned else error,
            "rule": rule if rule is not None else ("target" if fam != planned else "")}


def test_summary_runs_of_moved_blocks_one_line_before_and_after():
    blocks_ = [entry(b) for b in range(40)] + [entry(40 + i, error=0.051 + 0.001 * i, family="ck_int8",
                                                     after=0.016 + 0.001 * i) for i in range(10)]
    assert summary(blocks_) == "last run: blocks 40-49 → ck_int8, 0.051-0.060 over 0.045 → 0.016-0.025"


def test_summary_splits_by_family_rule_and_gaps_names_comfys_own():
    blocks_ = [entry(0), entry(1, error=0.2, family="sdpa", target=0.013), entry(3, error=0.06, family="ck_int8"),
               entry(4, error=0.07, family="ck_int8", target=0.05), entry(5, error=0.08, family="ck_int8"),
               entry(7, error=0.09, family="ck_int8"),
               entry(8, error=0.04, family="ck_int8", after=0.017, rule="budget"),
               entry(9, error=0.04, family="ck_int8", after=0.018, rule="budget")]
    assert summary(blocks_) == ("last run: block 1 → sdpa (ComfyUI's own), 0.200 over 0.013; "
                                "blocks 3-5 → ck_int8, 0.060-0.080 over 0.045-0.050; block 7 → ck_int8, 0.090 over 0.045; "
                                "blocks 8-9 → ck_int8, 0.040 → 0.017-0.018 within the speed budget")


def test_summary_says_the_budget_its_predicted_cost_and_remembered_errors():
    blocks_ = [entry(b, family="ck_int8", error=0.04, after=0.017, rule="budget") for b in range(3)]
    run = {"budget": 1.05, "cost": {"budget": 1.0448, "safety": None}, "source": "remembered"}
    assert summary(blocks_, run) == ("last run: blocks 0-2 → ck_int8, 0.040 → 0.017 within the speed budget; "
                                     "predicted attention time 1.04x the fastest kernel's (budget 1.05x); "
                                     "errors remembered from an earlier prompt")
    # no budget (kernel sage, faults only, or an unknown speed): nothing said of it
    assert summary(blocks_, {"budget": 1.0, "cost": {"budget": 1.0}}).endswith("within the speed budget")


def test_summary_without_moves_and_with_inconclusive_blocks():
    assert summary([entry(b) for b in range(6)]) == "last run: no block moved (6 within target)"
    # two classes of call in one block count as one block
    assert summary([entry(0), entry(0), entry(1, error=None)]) == \
        "last run: no block moved (1 within target); 1 block inconclusive"
    assert summary([entry(0, error=None), entry(1, target=None)]) == "last run: no block moved; 2 blocks inconclusive"
    assert summary([entry(2, error=0.3, family="ck"), entry(5, error=None)]) == \
        "last run: block 2 → ck, 0.300 over 0.045; 1 block inconclusive"


class FakeServer:
    def __init__(self, client_id=None, fail=None):
        self.client_id, self.fail, self.sent = client_id, fail, []

    def send_sync(self, event, data, sid=None):
        if self.fail:
            raise self.fail
        self.sent.append((event, data, sid))


@pytest.fixture
def server(monkeypatch):
    """ComfyUI's ``server`` module as main.py leaves it imported: ``PromptServer.instance``."""
    def install(**kw):
        ps = FakeServer(**kw)
        monkeypatch.setitem(sys.modules, "server", types.SimpleNamespace(PromptServer=types.SimpleNamespace(instance=ps)))
        return ps
    return install


def test_no_server_nothing_sent(monkeypatch):
    monkeypatch.delitem(sys.modules, "server", raising=False)
    assert events.server() is None and events.send(events.QUALITY, {"a": 1}) is False
    monkeypatch.setitem(sys.modules, "server", types.SimpleNamespace(PromptServer=types.SimpleNamespace(instance=None)))
    assert events.send(events.QUALITY, {"a": 1}) is False          # ComfyUI imported, no server started


def test_send_plain_json_to_the_prompts_client(server):
    ps = server(client_id="abc")
    class Odd:
        def __str__(self):
            return "odd"
    data = {"x": float("nan"), "y": (1, 2.5, float("inf")), 3: {"z": Odd()}, "ok": True}
    assert events.send(events.QUALITY, data) is True
    assert ps.sent == [("safesage.quality", {"x": None, "y": [1, 2.5, None], "3": {"z": "odd"}, "ok": True}, "abc")]
    ps = server(client_id=None)
    events.send("e", {})
    assert ps.sent == [("e", {}, None)]                            # no prompt's client known: every client


def test_an_error_sending_is_contained_and_logged_once(server, caplog):
    from safe_ops.ui import run_stats
    run_stats.reset()
    server(fail=RuntimeError("socket gone"))
    with caplog.at_level(logging.WARNING, logger="SafeSage"):
        assert events.send(events.QUALITY, {}) is False
        assert events.send(events.QUALITY, {}) is False
    said = [r.getMessage() for r in caplog.records if "could not send safesage.quality" in r.getMessage()]
    assert len(said) == 1 and "socket gone" in said[0], said


def test_one_event_per_run_with_the_blocks_and_summary(fresh, server):
    fq_, data = fresh, blocks()
    ps = server(client_id="client-1")
    att = make(quality="balanced")
    for run in range(2):
        sample(att, data, 3)
        assert len(ps.sent) == run + 1, ps.sent                   # one per run, at its end
        event, payload, sid = ps.sent[-1]
        assert event == "safesage.quality" and sid == "client-1"
        last = stats()["quality_last_run"]
        # what /safesage/stats holds for this node ("" : no node), also at its top level (the latest run)
        assert payload == events.plain(last["nodes"][""]) == events.plain({k: v for k, v in last.items() if k != "nodes"})
        by = {e["block"]: e for e in payload["choices"]["blocks"]}
        assert sorted(by) == list(range(NB))
        for b in OUTLIERS:
            e = by[b]
            assert (e["planned"], e["family"], e["moved"]) == (fq_.SAGE, fq_.KITCHEN, True), e
            assert e["planned_error"] > e["target"] >= e["error"] and "over target" in e["why"], e
            assert e["call_class"] and e["candidates"][fq_.KITCHEN] == e["error"] and e["alternatives"] == [], e
        lo = min(by[b]["planned_error"] for b in OUTLIERS)
        hi = max(by[b]["planned_error"] for b in OUTLIERS)
        assert payload["summary"] == last["summary"] == (
            f"last run: blocks {OUTLIERS[0]}-{OUTLIERS[-1]} → {fq_.KITCHEN}, {lo:.3f}-{hi:.3f} over "
            f"{by[OUTLIERS[0]]['target']:.3f} → {by[OUTLIERS[0]]['error']:.3f}"), payload["summary"]


def test_each_node_shows_its_own_run_and_a_run_that_measured_nothing_replaces_it(fresh, server):
    """Two SafeSage nodes (two guards): each node's report is its own run's; a node whose next run
    measured nothing (one step: no step after the probe) says so instead of showing the older one."""
    ps = server(client_id="c")
    a, b = make(quality="balanced"), make(quality="balanced")
    a.quality.node, b.quality.node = "12", "7:3"                 # 7:3 -- a node inside subgraph node 7
    sample(a, blocks(), 3)
    sample(b, blocks()[:4], 3)                                  # b's blocks are all benign
    nodes = stats()["quality_last_run"]["nodes"]
    assert "→" in nodes["12"]["summary"] and nodes["7:3"]["summary"] == "last run: no block moved (4 within target)"
    assert [p["node"] for _, p, _ in ps.sent] == ["12", "7:3"]
    sample(a, blocks(), 1)                                      # nothing measured
    nodes = stats()["quality_last_run"]["nodes"]
    assert nodes["12"]["summary"].startswith("last run: nothing measured") and "choices" not in nodes["12"], nodes
    assert nodes["7:3"]["summary"] == "last run: no block moved (4 within target)"
    assert ps.sent[-1][1]["node"] == "12" and ps.sent[-1][1]["summary"] == nodes["12"]["summary"]


def test_no_event_for_a_run_that_measured_nothing(fresh, server):
    ps = server()
    sample(make(quality="balanced"), blocks(), 2)
    assert len(ps.sent) == 1
    sample(make(quality="faults only"), blocks(), 2)
    assert len(ps.sent) == 1, ps.sent[1:]


def test_a_failing_server_never_fails_the_run(fresh, server):
    server(fail=TypeError("not serialisable"))
    sample(make(quality="balanced"), blocks(), 2)                  # guard.run_ended does not raise
    assert stats()["quality_last_run"]["summary"].startswith(f"last run: blocks {OUTLIERS[0]}-{OUTLIERS[-1]} → ")


def test_a_fault_in_the_events_own_code_is_counted_by_the_run_wrappers_boundary(fresh, server, monkeypatch):
    """Not swallowed in ui/events.py: it reaches patch.py's sampling-run wrapper, which counts it as an
    internal error and returns the run's result."""
    from safe_ops import patch
    ps = server()
    monkeypatch.setattr(events, "plain", lambda data: 1 / 0)
    att, data, sched = make(quality="balanced"), blocks(), schedule(2)
    forward(att, data, sched, 1)
    forward(att, data, sched, 2)
    assert patch._run_wrapper(lambda *a, **k: "the run's result") == "the run's result"
    assert ps.sent == [] and stats().get("internal_errors") == 1, stats().get("fallback_reasons")
