"""The UI-format example workflow, converted to an API prompt with this ComfyUI's /object_info,
is the graph of the API-format copy (example_workflows/api/). Needs a ComfyUI whose node types
cover the graph (MiniMax H3: 0dd9b154 or later); elsewhere it skips with the reason."""

from __future__ import annotations

import json

import pytest

from tools.harness.comfy_graphs import canonical_inputs
from tools.harness.comfy_server import REPO

NAME = "minimax_h3_ref2va_safesage"


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
    """The frontend's graphToPrompt, reduced to what this graph uses: links become [id, slot]
    references; widgets_values are read in the order of the node's widget inputs, skipping the
    value of a `control_after_generate` widget that follows a seed input (object_info says which)
    and widgets that are not node inputs (LoadImage's `upload`)."""
    links = {l[0]: l for l in ui["links"]}
    out = {}
    for n in ui["nodes"]:
        if n.get("mode", 0) != 0:
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


def test_ui_workflow_converts_to_the_api_copy(comfy):
    ui = json.loads((REPO / "example_workflows" / (NAME + ".json")).read_text())
    api = json.loads((REPO / "example_workflows" / "api" / (NAME + ".json")).read_text())
    info = comfy.object_info()
    missing = sorted({n["type"] for n in ui["nodes"]} - set(info))
    if missing:
        pytest.skip("this ComfyUI has no MiniMax H3 node types (%s): the H3 example needs COMFYUI_PATH=<0dd9b154 "
                    "or later>" % ", ".join(missing))
    got = ui_to_api(ui, info)
    assert sorted(got) == sorted(api)
    for nid, node in api.items():
        g = got[nid]
        assert g["class_type"] == node["class_type"], nid
        spec = _spec(info, node["class_type"])
        want, have = canonical_inputs(node["inputs"]), canonical_inputs(g["inputs"])
        for name, value in want.items():
            assert have.get(name) == value, (nid, name, have.get(name), value)
        # inputs the API copy leaves out hold this ComfyUI's defaults
        for name in set(have) - set(want):
            assert have[name] == _default(spec[name]), (nid, name)


def test_api_copy_validates_up_to_the_missing_files(comfy):
    """POST /prompt with the API copy: ComfyUI's own validation accepts every node except the
    ones that name model/image files this test server does not have."""
    api = json.loads((REPO / "example_workflows" / "api" / (NAME + ".json")).read_text())
    info = comfy.object_info()
    if set(v["class_type"] for v in api.values()) - set(info):
        pytest.skip("this ComfyUI has no MiniMax H3 node types: the H3 example needs COMFYUI_PATH=<0dd9b154 or later>")
    res = comfy.post_prompt(api)
    assert isinstance(res, dict), "queued although the H3 model files are absent"
    bad = res.get("node_errors", {})
    file_nodes = {"UNETLoader", "CLIPLoader", "VAELoader", "LoadImage"}
    assert bad and {api[k]["class_type"] for k in bad} <= file_nodes, json.dumps(bad)[:3000]
    for k, e in bad.items():
        assert all(x["type"] in ("value_not_in_list", "custom_validation_failed") for x in e["errors"]), e


def test_template_browser_lists_the_ui_workflow_and_thumbnail(comfy):
    """ComfyUI's own template routes: /workflow_templates lists the pack's templates (only
    example_workflows/*.json, so not the API copy), and the frontend fetches each one and its
    thumbnail from /api/workflow_templates/<pack folder>/<name>.json|.jpg."""
    import requests

    from tools.harness.comfy_server import PACK_DIR_NAME

    listed = comfy.get_json("/workflow_templates")
    assert listed.get(PACK_DIR_NAME) == [NAME], listed
    for ext, ctype in ((".json", "application/json"), (".jpg", "image/jpeg")):
        r = requests.get("%s/api/workflow_templates/%s/%s%s" % (comfy.url, PACK_DIR_NAME, NAME, ext), timeout=30)
        assert r.status_code == 200 and r.headers["content-type"].startswith(ctype), (ext, r.status_code)
        assert r.content == (REPO / "example_workflows" / (NAME + ext)).read_bytes()
