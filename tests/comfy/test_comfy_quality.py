"""The quality guard through a real headless ComfyUI (H3 trees: 0dd9b154 and later; skipped on
0.3.75, which has no H3).

A server of its own, started with SAFESAGE_EXTRA_FAMILIES=fake_quality_families (the two fake CPU
families of tests/unit/fake_quality_families.py on its PYTHONPATH): fake_sage's error grows with
outlier q/k channels, fake_kitchen's is a fixed KITCHEN_ERROR. A tiny H3 with 6 DiT blocks whose
blocks 4 and 5 have k_norm weights x32 on 2 of 32 channels (tiny_models.py
``--outlier-blocks``), sampled for 3 steps through SafeSageAttention (kernel sage: the fake
families; ``auto`` would pick ComfyUI's own on this unmeasured CPU). The blocks are told apart by
SafeSage's ``patches_replace["dit"]`` hook (quality/blocks.py).
"""
from __future__ import annotations

import os

import pytest

from tools.harness.comfy_graphs import h3_graph, stats_delta
from tools.harness.comfy_server import (PACK_DIR_NAME, REPO, TEST_NODES, TEST_NODES_DIR_NAME, ComfyServer,
                                        has_minimax_h3)

BLOCKS, OUTLIERS = 6, (4, 5)
STEPS = 3
FACTOR = 32
FAKE = "fake_quality_families"


@pytest.fixture(scope="module")
def qserver(tmp_path_factory, comfy):        # comfy: the session server's skip reasons apply here too
    if not has_minimax_h3():
        pytest.skip("COMFYUI_PATH=%s has no MiniMax H3 (comfy/ldm/minimax/model.py): the quality guard's "
                    "ComfyUI test needs a ComfyUI with H3 (0dd9b154 or later); `bash .ci/run` runs it in its "
                    "0dd9b154 pass" % os.environ.get("COMFYUI_PATH"))
    path = tmp_path_factory.mktemp("fake_families")
    (path / f"{FAKE}.py").symlink_to(REPO / "tests" / "unit" / f"{FAKE}.py")   # that module alone
    server = ComfyServer(tmp_path_factory.mktemp("comfy_quality"),
                         {PACK_DIR_NAME: REPO, TEST_NODES_DIR_NAME: TEST_NODES}, name="comfy-quality",
                         env={"SAFESAGE_EXTRA_FAMILIES": FAKE, "PYTHONPATH": str(path)})
    try:
        server.start()
        model = server.make_model("h3", "safesage_tiny_h3_outliers.safetensors", seed=77,
                                  args=("--blocks", str(BLOCKS), "--outlier-blocks", ",".join(map(str, OUTLIERS)),
                                        "--outlier-factor", str(FACTOR)))
        assert model["blocks"] == BLOCKS and model["outlier_blocks"] == list(OUTLIERS)
        yield server, os.path.basename(model["path"])
    finally:
        server.stop()


def _run(server, unet, seed, quality):
    before = server.safesage_stats()
    server.run(h3_graph(unet, seed, f"quality_{quality.replace(' ', '_')}_{seed}", steps=STEPS,
                        safesage={"kernel": "sage", "quality": quality}))
    return before, server.safesage_stats()


def test_outlier_blocks_move_benign_stay_one_plan_change_per_run(qserver, seed_counter):
    server, unet = qserver
    for run in range(2):                                 # each run measures at its own step 1
        before, after = _run(server, unet, seed_counter(), "balanced")
        q = (after["quality"], after.get("quality_last_run", {}).get("choices", {}).get("lines"))
        assert stats_delta(before, after, "quality.probes") == BLOCKS, q
        assert stats_delta(before, after, "quality.plan_changes") == 1, q
        assert stats_delta(before, after, "quality.blocks_moved") == len(OUTLIERS), q
        # KSampler euler, cfg 1: one forward per step; the moved blocks from step 2 on
        assert stats_delta(before, after, "quality.moved_calls") == len(OUTLIERS) * (STEPS - 1), q
        assert stats_delta(before, after, "forwards") == STEPS
        choices = after["quality_last_run"]["choices"]
        assert choices["quality"] == "balanced"
        ch = {c["block"]: c for c in choices["blocks"]}
        assert sorted(ch) == list(range(BLOCKS)), choices
        for b in OUTLIERS:
            assert ch[b]["family"] in ("fake_kitchen", "sdpa") and ch[b]["moved"], (b, choices)
            assert ch[b]["planned"] == "fake_sage" and ch[b]["planned_error"] > ch[b]["target"], (b, choices)
        for b in set(range(BLOCKS)) - set(OUTLIERS):
            assert ch[b]["family"] == "fake_sage" and not ch[b]["moved"], (b, choices)
        assert any("fake_kitchen" in line or "sdpa" in line for line in choices["lines"]), choices["lines"]


def test_faults_only_measures_nothing(qserver, seed_counter):
    server, unet = qserver
    before, after = _run(server, unet, seed_counter(), "faults only")
    for key in ("probes", "report_probes", "plan_changes", "moved_calls", "inconclusive"):
        assert stats_delta(before, after, "quality." + key) == 0, (key, after["quality"])
    calls = stats_delta(before, after, "attention_calls")
    assert calls == BLOCKS * STEPS
    assert stats_delta(before, after, "fallbacks") == 0, after["fallback_reasons"]
    assert any("fake_sage" in v for v in after["plans"].values()), after["plans"]   # the fake families ran
