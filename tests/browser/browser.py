"""Headless Debian chromium driven by Playwright, for the frontend tests (tests/browser/).

No browser download ever: Playwright launches /usr/bin/chromium (`.ci/setup_browser.sh` installs it
from Debian, and playwright + comfyui-frontend-package into the test venv). `browser_problem()`
says why the browser tests cannot run here (they skip with that reason).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from contextlib import contextmanager

CHROMIUM = os.environ.get("SAFESAGE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
VIEWPORT = {"width": 1600, "height": 900}
LOAD_TIMEOUT_MS = 120_000
FIRST_RUN_SETTINGS = {"Comfy.TutorialCompleted": True}


def browser_problem(server_python: str) -> str | None:
    """Why the browser tests cannot run here, or None."""
    if not os.access(CHROMIUM, os.X_OK):
        return ("no chromium at %s: install it with `bash .ci/setup_browser.sh <venv python>` "
                "(Debian package chromium)" % CHROMIUM)
    if importlib.util.find_spec("playwright") is None:
        return "playwright is not installed in this python: `bash .ci/setup_browser.sh <venv python>`"
    r = subprocess.run([server_python, "-c", "import comfyui_frontend_package"], capture_output=True)
    if r.returncode != 0:
        return ("comfyui-frontend-package is not installed in the server's python, so ComfyUI serves "
                "no frontend: `bash .ci/setup_browser.sh <venv python>`")
    return None


@contextmanager
def open_comfy(url: str, console: list | None = None):
    """A chromium page with ComfyUI's frontend loaded from `url` (window.app ready)."""
    import requests
    from playwright.sync_api import sync_playwright

    # a first start shows the template browser over the canvas; say the tour is done
    for key, value in FIRST_RUN_SETTINGS.items():
        requests.post("%s/settings/%s" % (url, key), json=value, timeout=30).raise_for_status()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            if console is not None:
                page.on("console", lambda m: console.append("%s: %s" % (m.type, m.text)))
                page.on("pageerror", lambda e: console.append("pageerror: %s" % e))
            page.goto(url)
            page.wait_for_function("window.app && window.app.graph && window.app.canvas",
                                   timeout=LOAD_TIMEOUT_MS)
            # the frontend opens a default workflow first; start from an empty graph with no dialog
            page.wait_for_timeout(1000)
            page.keyboard.press("Escape")
            page.evaluate("() => { app.graph.clear(); app.canvas.setDirty(true, true); }")
            yield page
        finally:
            browser.close()


def hide_overlays(page) -> None:
    """Hide toasts, the missing-model error panel, the minimap and the canvas' render statistics
    (screenshots only)."""
    page.add_style_tag(content=".p-toast, [class*='error-overlay'], [class*='ErrorOverlay'] "
                               "{ display: none !important; }")
    page.evaluate("""() => {
        const s = app.extensionManager?.setting;
        for (const [k, v] of [['Comfy.Minimap.Visible', false], ['Comfy.Graph.CanvasInfo', false]]) {
            try { s?.set?.(k, v); } catch (e) { /* an older frontend without the setting */ }
        }
        app.canvas.setDirty(true, true);
    }""")
