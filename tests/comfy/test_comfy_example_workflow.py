"""The templates against a real headless ComfyUI: each UI-format template, converted to an API
prompt with this ComfyUI's /object_info, is the graph of its API-format copy (example_workflows/api/);
the quick-start template runs, on generated tiny models of its own file names (the same
architectures: a Lotus-D UNet, the SD KL VAE; tools/harness/tiny_models.py) and a small image named
example.png -- nothing is downloaded; the H3 templates validate up to the files this server does not
have. The H3 templates need a ComfyUI with MiniMax H3 (0dd9b154 or later); elsewhere they skip with the
reason."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from safe_ops.facts.versions import version_tuple
from tools.harness.comfy_graphs import canonical_inputs, stats_delta
from tools.harness.comfy_server import PACK_DIR_NAME, REPO, execution_error

H3 = "minimax_h3_ref2va_safesage"
H3_720 = "minimax_h3_ref2va_720p_safesage"
QUICK = "safesage_quickstart_lotus_depth"
H3S = [H3, H3_720]
NAMES = [H3, H3_720, QUICK]
FRONTEND_ONLY = {"MarkdownNote", "Note"}      # the frontend's own nodes: never in a prompt
LOTUS_ERROR = "Either num_heads or num_head_channels has to be set"


def declared_minimum() -> str:
    """The ComfyUI the pack declares it needs (pyproject.toml ``requires-comfyui = ">=X"``): the first tested
    ComfyUI that runs the quick start (tests/unit/test_example_workflows.py holds README to it)."""
    m = re.search(r'^"requires-comfyui" = ">=([0-9.]+)"$', (REPO / "pyproject.toml").read_text(), re.M)
    assert m, "pyproject.toml declares no requires-comfyui minimum"
    return m.group(1)


def _load(name: str):
    ui = json.loads((REPO / "example_workflows" / (name + ".json")).read_text())
    api = json.loads((REPO / "example_workflows" / "api" / (name + ".json")).read_text())
    return ui, api


def _spec(info: dict, class_type: str) -> dict:
    inp = info[class_type]["input"]
    return {**inp.get("required", {}), **inp.get("optional", {})}


def _default(spec):
    """The value the frontend gives a widget the API copy leaves out: the declared default, or a
    combo's first option."""
    opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    if "default" in opts:
        return opts["default"]
    if isinstance(spec[0], list):
        return spec[0][0]
    return (opts.get("options") or [None])[0]


def ui_to_api(ui: dict, info: dict) -> dict:
    """The frontend's graphToPrompt, reduced to what these graphs use: links become [id, slot]
    references; widgets_values are read in the order of the node's widget inputs, skipping the
    value of a `control_after_generate` widget that follows a seed input (object_info says which)
    and widgets that are not node inputs (LoadImage's `upload`); the frontend's own nodes (notes)
    are left out."""
    links = {l[0]: l for l in ui["links"]}
    out = {}
    for n in ui["nodes"]:
        if n.get("mode", 0) != 0 or n["type"] in FRONTEND_ONLY:
            continue
        spec = _spec(info, n["type"])
        inputs = {}
        values = list(n.get("widgets_values") or [])
        vi = 0
        for i in n.get("inputs", []):
            name = i["name"]
            if i.get("widget") is not None:
                value = values[vi]
                vi += 1
                root = spec.get(name.split(".")[0])
                if root is None:
                    continue                 # frontend-only widget (e.g. upload)
                if len(root) > 1 and isinstance(root[1], dict) and root[1].get("control_after_generate"):
                    vi += 1
                if i.get("link") is None:
                    inputs[name] = value
                    continue
            if i.get("link") is not None:
                src = links[i["link"]]
                inputs[name] = [str(src[1]), src[2]]
        assert vi == len(values), "node %s: %d widget values, %d read" % (n["id"], len(values), vi)
        out[str(n["id"])] = {"class_type": n["type"], "inputs": inputs}
    return out


def _need_types(info: dict, api: dict, name: str) -> None:
    missing = sorted({v["class_type"] for v in api.values()} - set(info))
    if missing:
        pytest.skip("this ComfyUI has no %s node types (%s): the %s template needs COMFYUI_PATH=<0dd9b154 or later>"
                    % ("MiniMax H3" if name in H3S else "of these", ", ".join(missing), name))


@pytest.mark.parametrize("name", NAMES)
def test_ui_workflow_converts_to_the_api_copy(comfy, name):
    ui, api = _load(name)
    info = comfy.object_info()
    _need_types(info, api, name)
    got = ui_to_api(ui, info)
    assert sorted(got) == sorted(api)
    for nid, node in api.items():
        g = got[nid]
        assert g["class_type"] == node["class_type"], nid
        spec = _spec(info, node["class_type"])
        want, have = canonical_inputs(node["inputs"]), canonical_inputs(g["inputs"])
        for key, value in want.items():
            assert have.get(key) == value, (nid, key, have.get(key), value)
        # inputs the API copy leaves out hold this ComfyUI's defaults
        for key in set(have) - set(want):
            assert have[key] == _default(spec[key]), (nid, key)


@pytest.mark.parametrize("name", H3S)
def test_h3_api_copy_validates_up_to_the_missing_files(comfy, name):
    """POST /prompt with an H3 API copy: ComfyUI's own validation accepts every node except the
    ones that name model/image files this test server does not have."""
    _, api = _load(name)
    info = comfy.object_info()
    _need_types(info, api, name)
    res = comfy.post_prompt(api)
    assert isinstance(res, dict), "queued although the H3 model files are absent"
    bad = res.get("node_errors", {})
    file_nodes = {"UNETLoader", "CLIPLoader", "VAELoader", "LoadImage"}
    assert bad and {api[k]["class_type"] for k in bad} <= file_nodes, json.dumps(bad)[:3000]
    assert {"UNETLoader", "CLIPLoader", "VAELoader"} <= {api[k]["class_type"] for k in bad}
    for k, e in bad.items():
        assert all(x["type"] in ("value_not_in_list", "custom_validation_failed") for x in e["errors"]), e


def _example_png(path: Path) -> None:
    """A small image under the template's image name (ComfyUI's own example.png is 768x768)."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:48, 0:64]
    rgb = np.stack([x * 4, y * 5, (x + y) * 2], axis=-1).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rgb).save(path)


def test_quickstart_template_runs_headless_on_tiny_models_of_its_names(comfy):
    """The quick-start template's API copy (the UI template's prompt, test above), queued as it is:
    tiny random models of the same architectures under its file names (UNETLoader's
    lotus-depth-d-v1-1.safetensors detected as LotusD; VAELoader's vae-ft-mse-840000-ema-pruned),
    example.png 64x48. On the declared minimum ComfyUI (pyproject.toml, 0.30.0: the 0dd9b154 pass)
    and later it must finish, save an image, and every attention call of its one Lotus step must have
    gone through SafeSage (counted by plan). Below it (ComfyUI 0.3.75, which cannot load any Lotus-D
    UNet) it must fail in the loader with that ComfyUI error -- so the declared minimum can be neither
    a tree where the quick start fails nor later than one where it runs."""
    _, api = _load(QUICK)
    info = comfy.object_info()
    _need_types(info, api, QUICK)
    unet = api["1"]["inputs"]["unet_name"]
    vae = api["2"]["inputs"]["vae_name"]
    lotus = comfy.make_model("lotus", unet, seed=11)
    assert lotus["detected"] == "LotusD", lotus
    made = comfy.make_model("sd_vae", "safesage_tiny_sd_vae.safetensors", seed=12)
    (comfy.base / "models" / "vae").mkdir(parents=True, exist_ok=True)
    shutil.move(made["path"], comfy.base / "models" / "vae" / vae)
    _example_png(comfy.base / "input" / api["3"]["inputs"]["image"])

    before = comfy.safesage_stats()
    version = comfy.get_json("/system_stats")["system"]["comfyui_version"]
    if version_tuple(version) < version_tuple(declared_minimum()):
        # ComfyUI 0.3.75's LotusD config has no num_head_channels: no Lotus-D UNet loads there, a
        # ComfyUI bug (README: the quick start needs the declared minimum). The template fails as it
        # would for a user, in the loader, and nothing of SafeSage ran.
        entry = comfy.queue_and_wait(api)
        err = execution_error(entry) or {}
        assert err.get("node_type") == "UNETLoader" and LOTUS_ERROR in err.get("exception_message", ""), err
        assert stats_delta(before, comfy.safesage_stats(), "attention_calls") == 0
        return
    entry = comfy.run(api)
    after = comfy.safesage_stats()
    images = [img for out in entry["outputs"].values() for img in out.get("images", [])]
    assert len(images) == 1 and images[0]["filename"].endswith(".png"), entry["outputs"]
    assert (comfy.output_dir / images[0]["subfolder"] / images[0]["filename"]).is_file()
    calls = stats_delta(before, after, "attention_calls")
    assert calls == lotus["attention_calls_per_forward"], (calls, lotus)     # one step: one forward
    by_plan = sum(stats_delta(before, after, k) for k in after if k.startswith("plan:"))
    assert by_plan == calls
    status = "\n".join(entry["outputs"]["30"]["text"])
    assert status.startswith("SafeSage: "), status


def test_template_browser_lists_the_ui_workflows_and_thumbnails(comfy):
    """ComfyUI's own template routes: /workflow_templates lists the pack's templates (only
    example_workflows/*.json, so not the API copies), and the frontend fetches each one and its
    thumbnail from /api/workflow_templates/<pack folder>/<name>.json|.jpg."""
    import requests

    listed = comfy.get_json("/workflow_templates")
    assert sorted(listed.get(PACK_DIR_NAME, [])) == sorted(NAMES), listed
    for name in NAMES:
        for ext, ctype in ((".json", "application/json"), (".jpg", "image/jpeg")):
            r = requests.get("%s/api/workflow_templates/%s/%s%s" % (comfy.url, PACK_DIR_NAME, name, ext), timeout=30)
            assert r.status_code == 200 and r.headers["content-type"].startswith(ctype), (name, ext, r.status_code)
            assert r.content == (REPO / "example_workflows" / (name + ext)).read_bytes()
