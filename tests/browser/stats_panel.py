"""Reading web/safesage.js's run statistics panel (the SafeSage sidebar tab) from a Playwright page,
for tests/browser. The panel marks its parts with data-safesage attributes: the panel itself
("stats-panel", with the count of its refreshes in data-safesage-refreshes), "attention-total",
the tables "plans", "fallbacks", "disabled", "mlp", "quality" (a row per block, data-block, and
under it its "why" row, data-why), "quality-summary", and the "copy" button."""

from __future__ import annotations

from browser import ms, next_frames, wait_until

TAB_BUTTON = '.side-bar-button[aria-label^="SafeSage run statistics"]'
TAB_ID = "safesage-stats"

STATE_JS = """() => {
    const el = document.querySelector('[data-safesage=stats-panel]');
    if (!el) return null;
    const cells = (tr) => [...tr.children].map((td) => td.innerText.trim());
    const rows = (name) => [...el.querySelectorAll(`table[data-safesage=${name}] tbody tr`)].map(cells);
    const quality = [...el.querySelectorAll('table[data-safesage=quality] tr[data-block]')].map((tr) => ({
        block: Number(tr.dataset.block), moved: tr.classList.contains('ss-moved'), cells: cells(tr),
        why: el.querySelector(`tr[data-why="${tr.dataset.block}"]`)?.innerText.trim() ?? null}));
    const r = el.getBoundingClientRect();
    return {
        refreshes: Number(el.dataset.safesageRefreshes ?? 0), text: el.innerText,
        total: el.querySelector('[data-safesage=attention-total]')?.innerText ?? null,
        plans: rows('plans'), fallbacks: rows('fallbacks'), disabled: rows('disabled'), mlp: rows('mlp'),
        quality, summary: el.querySelector('[data-safesage=quality-summary]')?.innerText ?? null,
        visible: el.offsetParent !== null && r.width > 150 && r.height > 150 && r.left >= 0 && r.top >= 0
            && r.left < innerWidth && r.top < innerHeight,
    };
}"""


def panel_text(page) -> dict | None:
    """The panel as drawn now (see STATE_JS), or None when it is not open."""
    return page.evaluate(STATE_JS)


def panel_refreshes(page) -> int:
    state = panel_text(page)
    return state["refreshes"] if state else 0


def wait_panel_refreshed(page, before: int, timeout_s: float = 120) -> dict:
    """Wait until the panel is visible and has fetched /safesage/stats more than ``before`` times
    (limit scaled, browser.py)."""
    wait_until(page, "(n) => { const s = (%s)(); return s && s.visible && s.refreshes > n; }" % STATE_JS,
               "the SafeSage panel visible and refreshed more than %d times" % before, timeout_s, arg=before)
    return panel_text(page)


def open_sidebar_panel(page) -> None:
    """Click the SafeSage button of the sidebar, as a user opens the tab."""
    page.locator(TAB_BUTTON).first.click(timeout=ms(30))


def close_sidebar_panel(page) -> None:
    """Close the SafeSage sidebar tab if it is open (it covers the canvas' left part)."""
    page.evaluate("""async (id) => {
        const em = app.extensionManager;
        if (em?.sidebarTab?.activeSidebarTabId === id) await em.command.execute('Workspace.ToggleSidebarTab.' + id);
    }""", TAB_ID)
    wait_until(page, "(id) => app.extensionManager?.sidebarTab?.activeSidebarTabId !== id",
               "the SafeSage sidebar tab closed", arg=TAB_ID)
    next_frames(page)
