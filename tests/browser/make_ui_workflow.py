"""Regenerate the UI-format templates in example_workflows/ from their API copies in
example_workflows/api/, with ComfyUI's own frontend doing the conversion.

    COMFYUI_PATH=<ComfyUI 0dd9b154 tree> SAFESAGE_PYTHON=<venv python> \
        <venv python> tests/browser/make_ui_workflow.py [name ...]

Starts a headless ComfyUI (--cpu) with the pack, opens it in headless chromium, loads each API
graph with the frontend's app.loadApiJson, then adds what the API format cannot hold: the loader
nodes' ``properties.models`` (name, url, directory: the frontend's missing-models dialog offers
these downloads), node titles, a note with the model links, the canvas layout; seeds are set to
'fixed' (the frontend defaults new ones to 'randomize'). Saves app.graph.serialize(). The
thumbnails (<name>.jpg) are made by tests/browser/test_browser_frontend.py
(SAFESAGE_UPDATE_SCREENSHOTS=1), with placeholder files of the templates' names so that no node
is red. Development tool only (not shipped; tests/ is in .comfyignore).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]       # browser.py, and the repository root (harness)

from browser import browser_problem, open_comfy  # noqa: E402
from tools.harness.comfy_server import (REPO, comfy_path_problem, has_minimax_h3, running_pack_server,  # noqa: E402
                                        server_python)

WF = REPO / "example_workflows"
H3 = "minimax_h3_ref2va_safesage"
H3_720 = "minimax_h3_ref2va_720p_safesage"
QUICK = "safesage_quickstart_lotus_depth"

H3_REPO = "https://huggingface.co/Comfy-Org/MiniMax-H3"
#: every model file a template names: file -> (download URL, ComfyUI models/ folder). Sources:
#: huggingface.co/Comfy-Org/MiniMax-H3 (tree/main/diffusion_models, tree/main/vae; the text encoder's
#: URL as ComfyUI's own template video_minimax_h3_r2v.json has it), huggingface.co/Comfy-Org/lotus and
#: stabilityai/sd-vae-ft-mse-original (as ComfyUI's own template image_lotus_depth_v1_1.json has them).
MODELS = {
    "minimax_h3_ref2va_pruned_fp8_scaled.safetensors":
        (H3_REPO + "/resolve/main/diffusion_models/minimax_h3_ref2va_pruned_fp8_scaled.safetensors", "diffusion_models"),
    "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors":
        (H3_REPO + "/resolve/main/text_encoders/qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors", "text_encoders"),
    "minimax_h3_video_vae_fp16.safetensors":
        (H3_REPO + "/resolve/main/vae/minimax_h3_video_vae_fp16.safetensors", "vae"),
    "minimax_h3_audio_vae_fp32.safetensors":
        (H3_REPO + "/resolve/main/vae/minimax_h3_audio_vae_fp32.safetensors", "vae"),
    "lotus-depth-d-v1-1.safetensors":
        ("https://huggingface.co/Comfy-Org/lotus/resolve/main/lotus-depth-d-v1-1.safetensors", "diffusion_models"),
    "vae-ft-mse-840000-ema-pruned.safetensors":
        ("https://huggingface.co/stabilityai/sd-vae-ft-mse-original/resolve/main/vae-ft-mse-840000-ema-pruned.safetensors",
         "vae"),
}
LOADER_INPUT = {"UNETLoader": "unet_name", "CLIPLoader": "clip_name", "VAELoader": "vae_name"}

#: each download's size, from the public file listings (the text encoder's Comfy-Org listing was not
#: readable here: 4-bit builds of the same Qwen3-VL-32B encoder are listed at 15.7 GB, and issue 48 gives
#: ~15.7 GB for this one): huggingface.co/Comfy-Org/MiniMax-H3/tree/main/diffusion_models (21 GB) and
#: /tree/main/vae (5.21 GB, 605 MB); huggingface.co/Comfy-Org/lotus/tree/main (1.74 GB);
#: huggingface.co/stabilityai/sd-vae-ft-mse-original/tree/main (335 MB)
SIZES = {
    "minimax_h3_ref2va_pruned_fp8_scaled.safetensors": "21 GB",
    "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors": "about 16 GB",
    "minimax_h3_video_vae_fp16.safetensors": "5.21 GB",
    "minimax_h3_audio_vae_fp32.safetensors": "605 MB",
    "lotus-depth-d-v1-1.safetensors": "1.74 GB",
    "vae-ft-mse-840000-ema-pruned.safetensors": "335 MB",
}
MINIMUM_COMFYUI = "ComfyUI 0.30.0 (commit 0dd9b154) or later"


def _link(file: str) -> str:
    return "[%s](%s)" % (file, MODELS[file][0])


def h3_tokens_of(name: str) -> int:
    """The packed token count of an H3 template's own size (its API copy's width, height, length
    primitives and its Preflight node's ref_images and text_tokens), counted by the function SafeSage
    Preflight uses (safe_ops.models.h3.dims.packed_tokens)."""
    from safe_ops.models.h3.dims import packed_tokens
    api = json.loads((WF / "api" / (name + ".json")).read_text())
    pf = next(v for v in api.values() if v["class_type"] == "SafeSagePreflight")["inputs"]
    size = [api[pf[k][0]]["inputs"]["value"] for k in ("width", "height", "length")]
    return packed_tokens(*size, pf["ref_images"], pf["text_tokens"]).total


H3_DOWNLOADS = f"""- diffusion_models, {SIZES['minimax_h3_ref2va_pruned_fp8_scaled.safetensors']}: {_link('minimax_h3_ref2va_pruned_fp8_scaled.safetensors')}
- text_encoders, {SIZES['qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors']}: {_link('qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors')}
- vae, {SIZES['minimax_h3_video_vae_fp16.safetensors']} and {SIZES['minimax_h3_audio_vae_fp32.safetensors']}: {_link('minimax_h3_video_vae_fp16.safetensors')},
  {_link('minimax_h3_audio_vae_fp32.safetensors')}"""

H3_STEPS = """**Steps**: 20, what the bug report renders its video with (its full run). Its repro samples 2 steps,
which already crash in the first one: set *steps* to 2 to reproduce the bug quickly."""

H3_AFTER = """**Reference images**: the three *Load ref* nodes start on example.png (it ships with ComfyUI); load
your character, background and prop there.

After a run: SafeSage's status on its node, and the **SafeSage** tab in the left sidebar (attention calls
by plan, fallbacks, the MLP's chunks, the quality guard's table per block)."""


def h3_note() -> str:
    return f"""## MiniMax H3 reference-to-video, with SafeSage

The graph of the original bug report -- 1664x960, 362 frames (15 s at 24 fps), 3 reference images:
{h3_tokens_of(H3):,} tokens as SafeSage Preflight counts them -- with **SafeSage Attention** right after
the model loader. **SafeSage Preflight** reports, before any model runs, which kernel limits that size
crosses on your GPU and the plan SafeSage takes (*width*, *height*, *length* feed both nodes).

{H3_STEPS}

**Needs**: {MINIMUM_COMFYUI} (MiniMax H3's nodes). Sized for a 32 GB card (the report's RTX 5090,
with 64 GB of RAM); for a 16-24 GB card, the 1280x720 template. Time per step: 120.4 s on an H200
running SageAttention 2.2's RTX 5090 path with 27.5 GiB free (this size without the reference images,
a synthetic 50-block H3, one step); not measured on an RTX 5090 with SafeSage (the report: 93.8 s
without it, with dynamic VRAM off).

**Downloads, about 42 GB** ([Comfy-Org/MiniMax-H3]({H3_REPO})); ComfyUI offers each one when it is missing:

{H3_DOWNLOADS}

{H3_AFTER}
"""


def h3_720_note() -> str:
    return f"""## MiniMax H3 reference-to-video at 1280x720, for a 16-24 GB card

The bug report's graph at 1280x720, 362 frames (15 s at 24 fps), 3 reference images:
{h3_tokens_of(H3_720):,} tokens as SafeSage Preflight counts them, with **SafeSage Attention** right after
the model loader and **SafeSage Preflight** reporting on this size for your GPU.

**Why this size**: with 24 GiB free, SafeSage completed 1280x720 up to 753 frames (207,006 tokens),
unguarded SageAttention up to 515. That is an 8-block emulated measurement: an H100 held to 24 GiB,
running SageAttention 2.2's RTX 5090 path, an H3-shaped model of 8 of its 50 blocks (dynamic VRAM
streams the weights, so one block's peak decides), one step. This graph has half those tokens. A 16 GB
card is not measured: read Preflight's report for your GPU, and lower *length* if it warns.

{H3_STEPS}

**Needs**: {MINIMUM_COMFYUI} (MiniMax H3's nodes). Time per step: not measured at this size.

**Downloads, about 42 GB**, the same files as the 1664x960 template ([Comfy-Org/MiniMax-H3]({H3_REPO}));
ComfyUI offers each one when it is missing:

{H3_DOWNLOADS}

{H3_AFTER}
"""


def quick_note() -> str:
    return f"""## SafeSage quick start (Lotus depth, no H3 files)

See SafeSage work in a few minutes: Lotus-D v1.1 (an SD2-class UNet, one sampling step) turns a photo
into a depth map, and **SafeSage Attention** guards every attention call of it.

**Needs**: {MINIMUM_COMFYUI} (ComfyUI 0.3.75 cannot load Lotus-D). Sized for any GPU that runs
SD2-class models (its UNet is 1.74 GB). Time per step: not measured.

**Downloads, about 2.1 GB**; ComfyUI offers each one when it is missing:

- diffusion_models, {SIZES['lotus-depth-d-v1-1.safetensors']}: {_link('lotus-depth-d-v1-1.safetensors')}
- vae, {SIZES['vae-ft-mse-840000-ema-pruned.safetensors']}: {_link('vae-ft-mse-840000-ema-pruned.safetensors')}

**Image**: *Load any photo* starts on example.png (it ships with ComfyUI).

After the run: the status on the SafeSage node (GPU, runtime, kernel choice and why), and the
**SafeSage** tab in the left sidebar: attention calls by plan, fallbacks with reasons, kernels switched
off, and the quality guard's table per block where a guarded kernel (SageAttention, comfy-kitchen)
runs them. The H3 MLP chunking needs a MiniMax H3 model (the other templates).
"""


#: per template: node id -> canvas position, node sizes, node id -> title, the note (position, size,
#: text), the canvas view saved in extra.ds, and the part of a 1600x900 page its thumbnail shows
#: (tests/browser/test_browser_frontend.py)
SPECS = {
    H3: {
        "layout": {1: (0, 0), 2: (0, 120), 3: (0, 270), 4: (0, 370), 40: (0, 490), 41: (0, 600), 42: (0, 710),
                   30: (320, 0), 31: (320, 340), 6: (720, 0), 20: (320, 630), 21: (640, 630), 22: (960, 630),
                   7: (1140, 0), 8: (1140, 150), 9: (1140, 270), 10: (1140, 370),
                   11: (1440, 0), 12: (1440, 160), 13: (1440, 250), 14: (1700, 0), 15: (1700, 140)},
        "sizes": {30: (360, 290), 31: (360, 240), 6: (380, 560), 20: (300, 330), 21: (300, 330), 22: (300, 330)},
        "titles": {20: "Load ref 1: a character", 21: "Load ref 2: a background", 22: "Load ref 3: a prop",
                   40: "width", 41: "height", 42: "length (frames)"},
        "note": ((1290, 480), (560, 560), h3_note),
        "view": {"scale": 0.65, "offset": [110, 190]},
        "thumb_clip": {"x": 62, "y": 92, "width": 1300, "height": 680},
    },
    QUICK: {
        "layout": {1: (0, 0), 2: (0, 120), 3: (0, 220), 30: (380, 0), 4: (380, 340), 8: (380, 410),
                   9: (380, 480), 5: (770, 0), 6: (770, 90), 7: (770, 240), 10: (770, 340),
                   11: (1060, 0), 12: (1060, 160), 13: (1060, 250), 14: (1330, 0)},
        "sizes": {30: (350, 290), 3: (320, 360), 14: (300, 300)},
        "titles": {3: "Load any photo"},
        "note": ((1060, 340), (570, 360), quick_note),
        "view": {"scale": 0.8, "offset": [90, 150]},
        "thumb_clip": {"x": 62, "y": 92, "width": 1320, "height": 640},
    },
}

SPECS[H3_720] = {**SPECS[H3], "note": ((1290, 480), (560, 600), h3_720_note)}

BUILD_JS = """async ([name, api, spec, models, loaderInput]) => {
    await app.loadApiJson(api, name);
    const byId = (id) => app.graph.getNodeById(Number(id));
    for (const n of app.graph._nodes) {
        for (const w of n.widgets ?? []) if (w.name === 'control_after_generate') w.value = 'fixed';
        const input = loaderInput[n.type];
        const file = input && n.widgets?.find((w) => w.name === input)?.value;
        if (file) {
            const [url, directory] = models[file];
            n.properties = {...n.properties, models: [{name: file, url, directory}]};
        }
    }
    // a widget fed by a primitive node shows that node's value (it is what the prompt gets)
    for (const n of app.graph._nodes) {
        for (const inp of n.inputs ?? []) {
            if (inp.link == null || !inp.widget) continue;
            const src = app.graph.getNodeById(app.graph.links[inp.link].origin_id);
            const w = n.widgets?.find((x) => x.name === inp.widget.name);
            if (src?.type === 'PrimitiveInt' && w) w.value = src.widgets[0].value;
        }
    }
    for (const [id, t] of Object.entries(spec.titles)) byId(id).title = t;
    for (const [id, p] of Object.entries(spec.layout)) byId(id).pos = [p[0], p[1]];
    for (const [id, s] of Object.entries(spec.sizes)) byId(id).size = [s[0], s[1]];
    const note = LiteGraph.createNode('MarkdownNote');
    app.graph.add(note);
    note.pos = spec.note[0];
    note.size = spec.note[1];
    note.title = 'Note: read me';
    note.widgets[0].value = spec.note[2];
    app.canvas.setDirty(true, true);
    const ui = app.graph.serialize();
    delete ui.id;                         // a random workflow id per serialisation
    ui.extra = {ds: spec.view};
    return ui;
}"""


def main(names: list[str]) -> int:
    problem = comfy_path_problem() or browser_problem(server_python())
    if problem or not has_minimax_h3():
        print(problem or "COMFYUI_PATH has no MiniMax H3 nodes", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        with running_pack_server(Path(tmp)) as server:
            with open_comfy(server.url) as page:
                for name in names or list(SPECS):
                    spec = dict(SPECS[name])
                    spec["note"] = (*spec["note"][:2], spec["note"][2]())
                    spec = {**spec, "layout": {str(k): v for k, v in spec["layout"].items()},
                            "sizes": {str(k): v for k, v in spec["sizes"].items()},
                            "titles": {str(k): v for k, v in spec["titles"].items()}}
                    api = json.loads((WF / "api" / (name + ".json")).read_text())
                    page.evaluate("() => app.graph.clear()")
                    ui = page.evaluate(BUILD_JS, [name, api, spec, MODELS, LOADER_INPUT])
                    out = WF / (name + ".json")
                    out.write_text(json.dumps(ui, indent=1, ensure_ascii=False) + "\n")
                    print("wrote %s" % out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
