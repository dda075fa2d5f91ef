"""The quality guard's outcome on the node, in ComfyUI's real frontend (headless Debian chromium).

A headless ComfyUI (--cpu) of its own, started as tests/comfy/test_comfy_quality.py starts its
server: the fake families of tests/unit/fake_quality_families.py (SAFESAGE_EXTRA_FAMILIES) and a
tiny H3 whose blocks 4 and 5 carry outlier k channels, so balanced moves them to fake_kitchen. The
graph is queued from the frontend (its Run button) twice: after the first run the SafeSage node shows
its status with one ``last run: blocks 4-5 → fake_kitchen, ...`` line under it (the
``safesage.quality`` event, web/safesage.js), the same line ``/safesage/stats`` holds; the second
run samples again with a new seed while ComfyUI has the SafeSage node's output cached (the node does
not run, so its status is not written again) and the line is replaced, the status kept. Skipped
with the reason without chromium/playwright/the frontend (tests/browser/conftest.py) or without H3.
Marked `browser`.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from browser import hide_overlays, ms, next_frames, open_comfy, seconds, wait_socket, wait_until
from stats_panel import open_sidebar_panel, panel_refreshes, panel_text, wait_panel_refreshed
from tools.harness.comfy_graphs import h3_graph
from tools.harness.comfy_server import (QUALITY_BLOCKS, QUALITY_OUTLIERS, REPO, fake_quality_server,
                                        skip_without_h3)

pytestmark = pytest.mark.browser

BLOCKS, OUTLIERS, STEPS = QUALITY_BLOCKS, QUALITY_OUTLIERS, 3
SAFESAGE_ID = "10"                      # h3_graph's SafeSageAttention node
STATUS_JS = """() => {
    const n = app.graph._nodes.find((x) => x.type === 'SafeSageAttention');
    const w = n?.widgets?.find((x) => x.name === 'safesage_status');
    return w ? (w.safesageElement ? w.safesageElement.value : w.value) ?? '' : null;
}"""
# the KSampler's seed, fixed (the frontend would randomise it after each queue)
SEED_JS = """(seed) => {
    const ks = app.graph._nodes.find((x) => x.type === 'KSampler');
    for (const w of ks.widgets) {
        if (w.name === 'seed') w.value = seed;
        if (w.name === 'control_after_generate') w.value = 'fixed';
    }
}"""
# the line in a visible status box, as its last line, scrolled into view (the box is shorter than the status)
VISIBLE_JS = """(line) => [...document.querySelectorAll('textarea')].some((t) => {
    const r = t.getBoundingClientRect();
    return t.value.endsWith('\\n' + line) && r.width > 50 && r.height > 20 && t.offsetParent !== null
        && r.right > 0 && r.bottom > 0 && r.left < innerWidth && r.top < innerHeight
        && t.scrollTop + t.clientHeight >= t.scrollHeight - 2;
})"""
EVENT_LOG = "[SafeSage] quality guard, "     # web/safesage.js logs each event it shows
PANEL_SHOT = REPO / "docs" / "safesage_stats_panel.png"   # SAFESAGE_UPDATE_SCREENSHOTS=1 rewrites it


def _fmt(v) -> str:
    return "%.3f" % v


def _assert_panel_shows(page, stats: dict) -> dict:
    """The panel's quality table is stats' quality_last_run, row by row; the rest of its numbers
    are stats' too."""
    panel = panel_text(page)
    last = stats["quality_last_run"]
    blocks = last["choices"]["blocks"]
    assert panel["summary"] == last["summary"], (panel["summary"], last["summary"])
    assert [r["block"] for r in panel["quality"]] == [b["block"] for b in blocks] == list(range(BLOCKS))
    for row, b in zip(panel["quality"], blocks):
        runs = "%s (%s)" % (b["family"], _fmt(b["error"])) if b["moved"] else b["family"]
        assert row["cells"] == [str(b["block"]), b["planned"], _fmt(b["planned_error"]), _fmt(b["target"]), runs], (row, b)
        assert row["why"] == b["why"] and row["moved"] == b["moved"], (row, b)
    moved = [r["block"] for r in panel["quality"] if r["moved"]]
    assert moved == list(OUTLIERS), panel["quality"]
    assert all(r["cells"][4].startswith("fake_kitchen (") for r in panel["quality"] if r["moved"])
    assert all(r["cells"][1] == r["cells"][4] == "fake_sage" for r in panel["quality"] if not r["moved"])
    assert panel["total"].startswith("%d attention calls" % stats["attention_calls"]), panel["total"]
    plans = {k[len("plan:"):]: v for k, v in stats.items() if k.startswith("plan:")}
    assert {r[0]: int(r[1]) for r in panel["plans"]} == plans and plans
    mlp = {r[0]: r[1] for r in panel["mlp"]}
    assert mlp["MLPs patched"] == str(stats["mlp_patched"]) and mlp["chunks"] == str(stats["mlp"]["chunks"]), mlp
    assert panel["fallbacks"] == [] and panel["disabled"] == [] and "none: every call ran its plan" in panel["text"]
    assert "{" not in panel["text"], "raw JSON in the panel"
    return panel


@pytest.fixture(scope="module")
def qserver(tmp_path_factory):
    skip_without_h3("the quality guard's browser test needs")
    with fake_quality_server(tmp_path_factory.mktemp("browser_quality"), tmp_path_factory.mktemp("fake_families"),
                             name="browser-quality") as qs:
        yield qs


def _wait_idle(server, timeout: float = 240) -> None:
    """Until ComfyUI's /queue has nothing running or pending (limit scaled)."""
    deadline = time.monotonic() + seconds(timeout)
    while time.monotonic() < deadline:
        q = server.get_json("/queue")
        if not q["queue_running"] and not q["queue_pending"]:
            return
        time.sleep(0.2)
    raise TimeoutError("the prompt queued from the frontend did not finish within %.0f s; log tail:\n%s"
                       % (seconds(timeout), server.log_tail()))


def _run_from_frontend(page, server, console, seed: int) -> str:
    """Queue the loaded graph with the Run button at ``seed``; the status text once this run's
    safesage.quality event has been shown (web/safesage.js logs it) and the queue is empty."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeoutError
    page.evaluate(SEED_JS, seed)
    wait_socket(page)                  # the run's events come to this page over it
    try:
        with page.expect_console_message(lambda m: EVENT_LOG in m.text, timeout=ms(240)):
            page.get_by_role("button", name="Run", exact=True).first.click(timeout=ms(30))
    except PlaywrightTimeoutError as e:
        raise AssertionError("no safesage.quality event shown within %.0f s; console: %s\nlog tail:\n%s"
                             % (seconds(240), console[-20:], server.log_tail())) from e
    _wait_idle(server)
    return page.evaluate(STATUS_JS)


def _last_prompt(server) -> dict:
    hist = server.get_json("/history")
    return max(hist.values(), key=lambda e: e["prompt"][0])


def test_last_run_line_under_the_status_after_a_run_with_moved_blocks(qserver, tmp_path):
    server, unet = qserver
    console: list[str] = []
    with open_comfy(server.url, console) as page:
        graph = h3_graph(unet, 6100, "browser_quality", steps=STEPS, safesage={"kernel": "sage", "quality": "balanced"})
        page.evaluate("async (g) => { await app.loadApiJson(g, 'safesage_quality'); }", graph)
        page.evaluate("""() => {
            const ss = app.graph._nodes.find((n) => n.type === 'SafeSageAttention');
            ss.pos = [0, 0]; ss.size = [600, 420];
            app.canvas.ds.scale = 1; app.canvas.ds.offset = [90, 130];
            app.canvas.setDirty(true, true);
        }""")

        # the SafeSage sidebar tab, opened before any run: nothing measured yet
        page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.url)
        open_sidebar_panel(page)
        wait_panel_refreshed(page, 0)
        assert panel_text(page)["quality"] == [] and "no run measured yet" in panel_text(page)["text"]
        refreshes = panel_refreshes(page)

        text = _run_from_frontend(page, server, console, 6101)
        stats = server.safesage_stats()
        summary = stats["quality_last_run"]["summary"]
        assert summary.startswith(f"last run: blocks {OUTLIERS[0]}-{OUTLIERS[-1]} → fake_kitchen, "), summary
        lines = text.split("\n")
        assert lines[0].startswith("SafeSage: ") and "quality: balanced" in text, text      # the status, kept
        assert lines[-1] == summary and sum(l.startswith("last run: ") for l in lines) == 1, text
        wait_until(page, VISIBLE_JS, "the last-run line in a visible box on the node, scrolled to", arg=summary)
        status = "\n".join(lines[:-1])
        wait_panel_refreshed(page, refreshes)          # at the run's end, without a click
        wait_until(page, "(s) => document.querySelector('[data-safesage=quality-summary]')?.innerText === s",
                   "the panel's quality summary of the first run", arg=summary)
        _assert_panel_shows(page, server.safesage_stats())
        # the panel beside the node with its last-run line (the sidebar covers the canvas' left part)
        page.evaluate("() => { app.canvas.ds.offset = [400, 120]; app.canvas.setDirty(true, true); }")
        hide_overlays(page)
        next_frames(page)
        shot = PANEL_SHOT if os.environ.get("SAFESAGE_UPDATE_SCREENSHOTS") == "1" else tmp_path / PANEL_SHOT.name
        page.screenshot(path=str(shot), clip={"x": 0, "y": 40, "width": 1060, "height": 860})
        # the raw JSON only through the copy button
        page.locator("[data-safesage=copy]").first.click(timeout=ms(30))
        copied = json.loads(page.evaluate("() => navigator.clipboard.readText()"))
        assert copied["quality_last_run"] == server.safesage_stats()["quality_last_run"]
        assert copied["attention_calls"] == server.safesage_stats()["attention_calls"]
        refreshes = panel_refreshes(page)

        # again with another seed: the SafeSage node's output is cached (it does not run, its status is
        # not written again); the new run's line replaces the old one, the status stays
        text2 = _run_from_frontend(page, server, console, 6102)
        entry = _last_prompt(server)
        cached = [m[1].get("nodes", []) for m in entry["status"]["messages"] if m[0] == "execution_cached"]
        assert cached and SAFESAGE_ID in cached[0], entry["status"]["messages"]
        summary2 = server.safesage_stats()["quality_last_run"]["summary"]
        assert text2 == status + "\n" + summary2, (text2, status, summary2)
        wait_until(page, VISIBLE_JS, "the second run's line in a visible box on the node, scrolled to", arg=summary2)
        wait_panel_refreshed(page, refreshes)
        wait_until(page, "(s) => document.querySelector('[data-safesage=quality-summary]')?.innerText === s",
                   "the panel's quality summary of the second run", arg=summary2)
        _assert_panel_shows(page, server.safesage_stats())
    errors = [l for l in console if (l.startswith(("error:", "warning:")) and "[SafeSage]" in l)
              or (l.startswith("pageerror:") and "safesage" in l.lower())]
    assert not errors, errors
