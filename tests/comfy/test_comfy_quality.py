"""The quality guard through a real headless ComfyUI (H3 trees: 0dd9b154 and later; skipped on
0.3.75, which has no H3).

A server of its own, started with SAFESAGE_EXTRA_FAMILIES=fake_quality_families (the two fake CPU
families of tests/unit/fake_quality_families.py on its PYTHONPATH): fake_sage's error grows with
outlier q/k channels, fake_kitchen's is a fixed KITCHEN_ERROR. A tiny H3 with 6 DiT blocks whose
blocks 4 and 5 have k_norm weights x32 on 2 of 32 channels (tiny_models.py
``--outlier-blocks``), sampled for 3 steps through SafeSageAttention (kernel sage: the fake
families; ``auto`` would pick ComfyUI's own on this unmeasured CPU). The blocks are told apart by
SafeSage's ``patches_replace["dit"]`` hook (quality/blocks.py).

The outcome where the user looks (issue #36 point 5): ``/safesage/stats`` ``quality_last_run`` per
block, its one-line summary, and the one ``safesage.quality`` websocket event per sampling run
(read by a websocket client connected as the prompt's client, tools/harness/comfy_ws.py).
"""
from __future__ import annotations


import pytest

from tools.harness.comfy_graphs import h3_graph, stats_delta
from tools.harness.comfy_server import QUALITY_BLOCKS, QUALITY_FACTOR, QUALITY_OUTLIERS
from tools.harness.comfy_ws import WsListener

BLOCKS, OUTLIERS, FACTOR = QUALITY_BLOCKS, QUALITY_OUTLIERS, QUALITY_FACTOR
STEPS = 3
SAGE, KITCHEN, KITCHEN_ERROR = "fake_sage", "fake_kitchen", 0.006     # fake_quality_families.py
EVENT = "safesage.quality"


@pytest.fixture
def qserver(quality_server):
    """The session's fake-families server (tests/comfy/conftest.py), shared with the other quality tests."""
    return quality_server


def _run(server, unet, seed, quality, ws=None):
    """One prompt; with ``ws`` (a WsListener of the prompt's client) also the ``safesage.quality``
    events sent for it (ComfyUI sends ``execution_success`` after the run's end, on the same queue)."""
    before = server.safesage_stats()
    seen = len(ws.of_type(EVENT)) if ws is not None else 0
    entry = server.run(h3_graph(unet, seed, f"quality_{quality.replace(' ', '_')}_{seed}", steps=STEPS,
                                safesage={"kernel": "sage", "quality": quality}))
    if ws is None:
        return before, server.safesage_stats()
    pid = entry["prompt"][1]
    ws.wait_for(lambda m: m.get("type") == "execution_success" and (m.get("data") or {}).get("prompt_id") == pid,
                what=f"execution_success of {pid}")
    return before, server.safesage_stats(), [m["data"] for m in ws.of_type(EVENT)[seen:]]


def test_outlier_blocks_move_benign_stay_one_plan_change_per_run(qserver, seed_counter):
    server, unet = qserver
    with WsListener(server.url, server.client_id) as ws:
        for run in range(2):                             # each run measures at its own step 1
            before, after, sent = _run(server, unet, seed_counter(), "balanced", ws)
            q = (after["quality"], after.get("quality_last_run", {}).get("choices", {}).get("lines"))
            assert stats_delta(before, after, "quality.probes") == BLOCKS, q
            assert stats_delta(before, after, "quality.plan_changes") == 1, q
            assert stats_delta(before, after, "quality.blocks_moved") == len(OUTLIERS), q
            # KSampler euler, cfg 1: one forward per step; the moved blocks from step 2 on
            assert stats_delta(before, after, "quality.moved_calls") == len(OUTLIERS) * (STEPS - 1), q
            assert stats_delta(before, after, "forwards") == STEPS
            last = after["quality_last_run"]
            choices = last["choices"]
            assert choices["quality"] == "balanced"
            ch = {c["block"]: c for c in choices["blocks"]}
            assert sorted(ch) == list(range(BLOCKS)), choices
            for b in OUTLIERS:
                c = ch[b]
                # fake_kitchen's error (0.006) is under the target (4.4x fake_sage's median): it, not
                # ComfyUI's own, is what these blocks run from step 2
                assert (c["planned"], c["family"], c["moved"]) == (SAGE, KITCHEN, True), (b, choices)
                assert c["planned_error"] > c["target"] >= c["error"], (b, choices)
                assert abs(c["candidates"][KITCHEN] - KITCHEN_ERROR) < 1e-3 and c["error"] == c["candidates"][KITCHEN], c
                assert c["why"].startswith(f"{SAGE} ") and " over target " in c["why"], c
                assert c["call_class"] and c["alternatives"] == [], c      # no other family under the target
            for b in set(range(BLOCKS)) - set(OUTLIERS):
                c = ch[b]
                assert (c["planned"], c["family"], c["moved"]) == (SAGE, SAGE, False), (b, choices)
                assert c["error"] == c["planned_error"] <= c["target"] and "within target" in c["why"], c
            assert any(KITCHEN in line for line in choices["lines"]), choices["lines"]
            errs = [ch[b]["planned_error"] for b in OUTLIERS]
            assert last["summary"] == (f"last run: blocks {OUTLIERS[0]}-{OUTLIERS[-1]} → {KITCHEN}, "
                                       f"{min(errs):.3f}-{max(errs):.3f} over {ch[OUTLIERS[0]]['target']:.3f} "
                                       f"→ {ch[OUTLIERS[0]]['error']:.3f}"), last
            # one safesage.quality event for this run, carrying what /safesage/stats holds
            assert len(sent) == 1, sent
            assert sent[0]["summary"] == last["summary"] and sent[0]["choices"] == choices, (sent[0], last)
            # the outcome is the SafeSage node's own: ComfyUI's id of that node (h3_graph's "10")
            assert sent[0]["node"] == last["node"] == "10" and set(last["nodes"]) == {"10"}, last


def test_a_later_prompt_runs_the_remembered_choices_from_step_1_until_forgotten(qserver, seed_counter):
    """Issue #46 goal 3 through real ComfyUI: the second prompt on the same model (ComfyUI keeps the loaded
    UNet) measures nothing and runs the moved blocks' choices from step 1; POST /safesage/quality/forget
    makes the next prompt measure again."""
    server, unet = qserver

    def prompt(remember):
        before = server.safesage_stats()
        server.run(h3_graph(unet, seed_counter(), "quality_remembered", steps=STEPS,
                            safesage={"kernel": "sage", "quality": "balanced"}), remember=remember)
        return before, server.safesage_stats()

    before, after = prompt(False)                         # measured
    assert stats_delta(before, after, "quality.probes") == BLOCKS, after["quality"]
    before, after = prompt(True)                          # remembered: no probe, the choices from step 1
    q = after["quality"]
    assert stats_delta(before, after, "quality.probes") == 0, q
    assert stats_delta(before, after, "quality.recalled_blocks") == BLOCKS, q
    assert stats_delta(before, after, "quality.moved_calls") == len(OUTLIERS) * STEPS, q
    assert after["quality_last_run"]["choices"]["source"] == "remembered", after["quality_last_run"]
    moved = sorted(c["block"] for c in after["quality_last_run"]["choices"]["blocks"] if c["moved"])
    assert moved == list(OUTLIERS), after["quality_last_run"]
    assert server.forget_quality() == BLOCKS
    before, after = prompt(True)                          # forgotten: measured again
    assert stats_delta(before, after, "quality.probes") == BLOCKS, after["quality"]


def test_faults_only_measures_nothing(qserver, seed_counter):
    server, unet = qserver
    with WsListener(server.url, server.client_id) as ws:
        before, after, sent = _run(server, unet, seed_counter(), "faults only", ws)
    assert sent == [], sent                                    # nothing measured: no event
    for key in ("probes", "report_probes", "plan_changes", "moved_calls", "inconclusive"):
        assert stats_delta(before, after, "quality." + key) == 0, (key, after["quality"])
    calls = stats_delta(before, after, "attention_calls")
    assert calls == BLOCKS * STEPS
    assert stats_delta(before, after, "fallbacks") == 0, after["fallback_reasons"]
    assert any("fake_sage" in v for v in after["plans"].values()), after["plans"]   # the fake families ran
