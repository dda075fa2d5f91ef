"""Each SafeSage node shows its own quality outcome (issue #46 goal 6), in ComfyUI's real frontend.

The server sends one ``safesage.quality`` event per SafeSage node that ran, carrying ComfyUI's id of
that node (``node``; a path of ids such as ``"7:3"`` for a node inside a subgraph:
safe_ops/quality/report.py, tests/comfy/test_comfy_quality.py checks the id a real run sends). Here the
events are dispatched on the frontend's own api object, as its websocket handler dispatches them, to a
graph with two SafeSage Attention nodes in the root graph and one inside a subgraph (made with the
frontend's own "convert to subgraph"): each event's line goes under its node's status only, and an event
without ``node`` (a server before per-node reports) goes on every root-graph SafeSage node, as before.
Skipped with the reason without chromium/playwright/the frontend (tests/browser/conftest.py).
"""
from __future__ import annotations

import pytest

from browser import open_comfy, wait_until

pytestmark = pytest.mark.browser

SETUP_JS = """() => {
    const make = (x) => {
        const n = LiteGraph.createNode('SafeSageAttention');
        n.pos = [x, 100];
        app.graph.add(n);
        return n;
    };
    const a = make(0), b = make(400), c = make(800);
    const conv = app.graph.convertToSubgraph?.(new Set([c]));
    const outer = conv?.node;
    const inner = outer?.subgraph?.nodes?.find((n) => n.type === 'SafeSageAttention')
        ?? outer?.subgraph?._nodes?.find((n) => n.type === 'SafeSageAttention');
    window.__ss = { a, b, inner };
    return { a: String(a.id), b: String(b.id), sub: outer && inner ? `${outer.id}:${inner.id}` : null,
             error: outer ? null : 'this frontend has no convertToSubgraph' };
}"""
SEND_JS = """(detail) => {
    const api = window.comfyAPI?.api?.api ?? app.api;
    api.dispatchCustomEvent
        ? api.dispatchCustomEvent('safesage.quality', detail)
        : api.dispatchEvent(new CustomEvent('safesage.quality', { detail }));
}"""
TEXT_JS = """(which) => {
    const n = window.__ss[which];
    const w = n?.widgets?.find((x) => x.name === 'safesage_status');
    return w ? (w.safesageElement ? w.safesageElement.value : w.value) ?? '' : '';
}"""


def _last_line(page, which: str) -> str:
    return page.evaluate(TEXT_JS, which).split("\n")[-1]


def test_each_node_shows_its_own_outcome_subgraph_nodes_too(comfy):
    console: list[str] = []
    with open_comfy(comfy.url, console) as page:
        ids = page.evaluate(SETUP_JS)
        assert ids["error"] is None and ids["sub"], ids
        page.evaluate(SEND_JS, {"node": ids["a"], "summary": "last run: node A's outcome"})
        page.evaluate(SEND_JS, {"node": ids["sub"], "summary": "last run: the subgraph node's outcome"})
        wait_until(page, "() => window.__ss.inner.widgets?.some((w) => w.name === 'safesage_status')",
                   "the status widget on the SafeSage node inside the subgraph")
        assert _last_line(page, "a") == "last run: node A's outcome"
        assert _last_line(page, "inner") == "last run: the subgraph node's outcome"
        assert "last run" not in page.evaluate(TEXT_JS, "b")          # no broadcast to the other node
        # node B's own event replaces nothing of A's
        page.evaluate(SEND_JS, {"node": ids["b"], "summary": "last run: node B's outcome"})
        assert _last_line(page, "b") == "last run: node B's outcome"
        assert _last_line(page, "a") == "last run: node A's outcome"
        # an id that is no SafeSage node (a stale one) is shown nowhere
        page.evaluate(SEND_JS, {"node": "999", "summary": "last run: nobody's"})
        assert all("nobody's" not in page.evaluate(TEXT_JS, w) for w in ("a", "b", "inner"))
        # without a node id: every SafeSage node of the root graph, one line each (the previous replaced)
        page.evaluate(SEND_JS, {"summary": "last run: an older server's outcome"})
        for which in ("a", "b"):
            lines = page.evaluate(TEXT_JS, which).split("\n")
            assert lines[-1] == "last run: an older server's outcome" and sum(
                l.startswith("last run: ") for l in lines) == 1, lines
        assert _last_line(page, "inner") == "last run: the subgraph node's outcome"
    errors = [l for l in console if l.startswith("pageerror:") and "safesage" in l.lower()]
    assert not errors, errors
