"""Headless Debian chromium driven by Playwright, for the frontend tests (tests/browser/).

No browser download ever: Playwright launches /usr/bin/chromium (`.ci/setup_browser.sh` installs it
from Debian, and playwright + comfyui-frontend-package into the test venv). `browser_problem()`
says why the browser tests cannot run here (they skip with that reason).

Waits: every step waits for the frontend's own signal that it is done (the app set up and its first
workflow loaded, the websocket open with its client id, the node search open with the wanted hit
selected, the node in the graph, the prompt queue empty, ...), never for a fixed time. The limits are
generous, for a 2-core machine with other work on both cores, and all scale by SAFESAGE_BROWSER_TIMEOUT_SCALE (default 1; e.g. 3 on a
slower or busier machine): a limit only decides how long a broken page takes to fail.
SAFESAGE_BROWSER_CPU_THROTTLE=N (e.g. 6) makes chromium run its page N times slower (DevTools'
CPU throttling), to try the waits against a slow page on any machine.
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
FIRST_RUN_SETTINGS = {"Comfy.TutorialCompleted": True}
TIMEOUT_SCALE = float(os.environ.get("SAFESAGE_BROWSER_TIMEOUT_SCALE") or 1)
LOAD_TIMEOUT_S = 120          # the first page load: ComfyUI's frontend bundle, node definitions, extensions
STEP_TIMEOUT_S = 60           # any other single step (Playwright's default for a page)
CPU_THROTTLE = float(os.environ.get("SAFESAGE_BROWSER_CPU_THROTTLE") or 1)


def seconds(s: float) -> float:
    """A limit in seconds, scaled by SAFESAGE_BROWSER_TIMEOUT_SCALE."""
    return s * TIMEOUT_SCALE


def ms(s: float) -> int:
    """A limit in seconds as Playwright's milliseconds, scaled by SAFESAGE_BROWSER_TIMEOUT_SCALE."""
    return int(s * 1000 * TIMEOUT_SCALE)


# ComfyUI's websocket is open and the server has given this page its client id (the "status" message
# with its sid): a prompt queued before that goes out with no client id, and the server never sends
# this page its "executed" messages (no status text on the node, no run events).
SOCKET_JS = """() => { const a = window.app?.api ?? window.comfyAPI?.api?.api;
    return !!(a?.clientId && a.socket?.readyState === WebSocket.OPEN); }"""
# The frontend is set up (GraphCanvas.vue sets window.app after app.setup(), then clears the workspace
# spinner once its first workflow is loaded: 1.48.6, 1.49.6; 1.32.9 clears it before, so the workflow
# store's active workflow is waited for as well) and the pack's nodes are registered with LiteGraph.
READY_JS = """() => !!(window.app && app.graph && app.canvas && app.extensionManager
    && !app.extensionManager.spinner && app.extensionManager.workflow?.activeWorkflow
    && window.LiteGraph?.registered_node_types?.SafeSageAttention
    && (app.extensions ?? []).some((e) => e.name.startsWith('SafeSage'))
    && (%s)())""" % SOCKET_JS
READY_PARTS_JS = """() => ({app: !!window.app, graph: !!window.app?.graph, canvas: !!window.app?.canvas,
    spinner: window.app?.extensionManager?.spinner ?? null,
    workflow: !!window.app?.extensionManager?.workflow?.activeWorkflow,
    SafeSageAttention: !!window.LiteGraph?.registered_node_types?.SafeSageAttention,
    extensions: (window.app?.extensions ?? []).map((e) => e.name).filter((n) => n.startsWith('SafeSage')),
    socket: (%s)(), frontend: window.__COMFYUI_FRONTEND_VERSION__ ?? null})""" % SOCKET_JS
# two animation frames: the canvas and the DOM have drawn what the last step changed
FRAMES_JS = "() => new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(() => r(true))))"


def wait_until(page, js: str, what: str, timeout_s: float = STEP_TIMEOUT_S, arg=None):
    """page.wait_for_function(js, arg) within timeout_s (scaled); on timeout an AssertionError that
    says what was waited for and for how long."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeoutError
    try:
        return page.wait_for_function(js, arg=arg, timeout=ms(timeout_s))
    except PlaywrightTimeoutError as e:
        raise AssertionError("%s: not within %.0f s (SAFESAGE_BROWSER_TIMEOUT_SCALE=%g)"
                             % (what, seconds(timeout_s), TIMEOUT_SCALE)) from e


def wait_socket(page) -> None:
    """Until the page's websocket is open with its client id (SOCKET_JS): before queueing a prompt whose
    results the page must show (the socket reconnects by itself if it dropped)."""
    wait_until(page, SOCKET_JS, "ComfyUI's websocket open with this page's client id")


def double_click(page, x: float, y: float) -> None:
    """A left double-click at (x, y) whose events carry the times of a user's double-click (40 ms
    apart), through DevTools' Input.dispatchMouseEvent. LiteGraph counts two clicks as a double-click
    from the events' own timeStamps (CanvasPointer: under Comfy.Pointer.DoubleClickTime, 300 ms);
    Playwright's dblclick stamps each event when the page has taken the one before, so on a busy
    renderer (or SAFESAGE_BROWSER_CPU_THROTTLE=12) the second click came too late and no search box
    opened, however long a test waited."""
    import time
    page.mouse.move(x, y, steps=3)            # hover first, as a user's pointer does
    cdp = page.context.new_cdp_session(page)
    try:
        t = time.time()
        for i, (kind, count) in enumerate([("mousePressed", 1), ("mouseReleased", 1),
                                           ("mousePressed", 2), ("mouseReleased", 2)]):
            cdp.send("Input.dispatchMouseEvent", {
                "type": kind, "x": x, "y": y, "button": "left", "clickCount": count,
                "buttons": 1 if kind == "mousePressed" else 0, "timestamp": t + 0.04 * i})
    finally:
        cdp.detach()


def next_frames(page) -> None:
    """Return once the page has drawn two more frames (what the last step changed is on screen)."""
    page.evaluate(FRAMES_JS)


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
    """A chromium page with ComfyUI's frontend loaded from `url` (READY_JS: set up, first workflow
    loaded, the pack's nodes registered), its graph cleared."""
    import requests
    from playwright.sync_api import sync_playwright

    # a first start shows the template browser over the canvas; say the tour is done
    for key, value in FIRST_RUN_SETTINGS.items():
        requests.post("%s/settings/%s" % (url, key), json=value, timeout=seconds(30)).raise_for_status()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.set_default_timeout(ms(STEP_TIMEOUT_S))
            page.set_default_navigation_timeout(ms(LOAD_TIMEOUT_S))
            if CPU_THROTTLE > 1:
                cdp = page.context.new_cdp_session(page)
                cdp.send("Emulation.setCPUThrottlingRate", {"rate": CPU_THROTTLE})
            if console is not None:
                page.on("console", lambda m: console.append("%s: %s" % (m.type, m.text)))
                page.on("pageerror", lambda e: console.append("pageerror: %s" % e))
            page.goto(url)
            try:
                wait_until(page, READY_JS, "ComfyUI's frontend set up with its first workflow and the "
                           "SafeSage nodes registered", LOAD_TIMEOUT_S)
            except AssertionError as e:
                raise AssertionError("%s; now: %s" % (e, page.evaluate(READY_PARTS_JS))) from e
            # the frontend has loaded its default workflow; start from an empty graph with no dialog
            page.keyboard.press("Escape")
            page.evaluate("() => { app.graph.clear(); app.canvas.setDirty(true, true); }")
            next_frames(page)
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
