"""Regenerate example_workflows/minimax_h3_ref2va_safesage.json (UI format) and its .jpg thumbnail
from the API copy in example_workflows/api/, with ComfyUI's own frontend doing the conversion.

    COMFYUI_PATH=<ComfyUI 0dd9b154 tree> SAFESAGE_PYTHON=<venv python> \
        <venv python> tests/browser/make_ui_workflow.py

Starts a headless ComfyUI (--cpu) with the pack, opens it in headless chromium, loads the API
graph with the frontend's app.loadApiJson, sets the reporter's seed to 'fixed' (the frontend
defaults new seeds to 'randomize'), saves app.graph.serialize() and a JPEG of the canvas.
Development tool only (not shipped; tests/ is in .comfyignore).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]       # browser.py, and the repository root (harness)

from browser import browser_problem, hide_overlays, open_comfy  # noqa: E402
from tools.harness.comfy_server import (REPO, comfy_path_problem, has_minimax_h3, running_pack_server,  # noqa: E402
                          server_python)

NAME = "minimax_h3_ref2va_safesage"
# node id -> canvas position: loaders left, SafeSage right after the model loader, sampling, decode, save
LAYOUT = {1: (0, 0), 2: (0, 150), 3: (0, 330), 4: (0, 440), 20: (0, 640), 21: (330, 640), 22: (660, 640),
          30: (330, 0), 6: (330, 200), 7: (720, 0), 8: (720, 140), 9: (720, 250), 10: (720, 350),
          11: (1010, 0), 12: (1250, 0), 13: (1250, 110), 14: (1250, 220), 15: (1250, 370)}
VIEW = {"scale": 0.68, "offset": [128, 174]}   # graph (0, 0) at window pixel (87, 118)
API = REPO / "example_workflows" / "api" / (NAME + ".json")
UI = REPO / "example_workflows" / (NAME + ".json")
THUMB = REPO / "example_workflows" / (NAME + ".jpg")


def main() -> int:
    problem = comfy_path_problem() or browser_problem(server_python())
    if problem or not has_minimax_h3():
        print(problem or "COMFYUI_PATH has no MiniMax H3 nodes", file=sys.stderr)
        return 2
    api = json.loads(API.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        with running_pack_server(Path(tmp)) as server:
            with open_comfy(server.url) as page:
                page.evaluate("async (g) => { await app.loadApiJson(g, %s); }" % json.dumps(NAME), api)
                page.evaluate("""() => {
                    for (const n of app.graph._nodes) {
                        const c = n.widgets?.find((w) => w.name === 'control_after_generate');
                        if (c) c.value = 'fixed';
                    }
                    app.canvas.setDirty(true, true);
                }""")
                page.evaluate("""(layout) => {
                    for (const n of app.graph._nodes) {
                        const p = layout[String(n.id)];
                        if (p) n.pos = [p[0], p[1]];
                    }
                }""", {str(k): v for k, v in LAYOUT.items()})
                ui = page.evaluate("() => app.graph.serialize()")
                ui.pop("id", None)          # a random workflow id per serialisation
                ui["extra"] = {"ds": VIEW}
                UI.write_text(json.dumps(ui, indent=1) + "\n")
                page.evaluate("(ds) => { app.canvas.ds.scale = ds.scale; app.canvas.ds.offset = ds.offset;"
                              " app.canvas.setDirty(true, true); }", ui["extra"]["ds"])
                hide_overlays(page)
                time.sleep(1.0)
                page.screenshot(path=str(THUMB), type="jpeg", quality=80,
                                clip={"x": 70, "y": 85, "width": 1100, "height": 600})
    print("wrote %s and %s" % (UI, THUMB))
    return 0


if __name__ == "__main__":
    sys.exit(main())
