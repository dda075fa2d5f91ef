"""example_workflows/: the UI-format template ComfyUI's template browser lists, its thumbnail, and
the API-format copy. Pure JSON checks here; tests/comfy/test_comfy_example_workflow.py converts
the UI file to an API prompt against a real ComfyUI's /object_info, and
tests/browser/test_browser_frontend.py lets the frontend itself convert it."""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WF = REPO / "example_workflows"
NAME = "minimax_h3_ref2va_safesage"


def load_ui() -> dict:
    return json.loads((WF / (NAME + ".json")).read_text())


def load_api() -> dict:
    return json.loads((WF / "api" / (NAME + ".json")).read_text())


def test_template_browser_sees_only_ui_workflows():
    """ComfyUI lists example_workflows/*.json (not sub-folders) and opens only the UI format."""
    listed = sorted(p.name for p in WF.glob("*.json"))
    assert listed == [NAME + ".json"]
    for p in WF.glob("*.json"):
        wf = json.loads(p.read_text())
        assert isinstance(wf.get("nodes"), list) and isinstance(wf.get("links"), list), p


def test_thumbnail_next_to_the_template():
    """The frontend asks for /api/workflow_templates/<pack>/<name>.jpg."""
    jpg = (WF / (NAME + ".jpg")).read_bytes()
    assert jpg[:3] == b"\xff\xd8\xff" and len(jpg) < 400_000


def test_ui_format_is_consistent():
    ui = load_ui()
    nodes = {n["id"]: n for n in ui["nodes"]}
    assert len(nodes) == len(ui["nodes"]) and ui["last_node_id"] >= max(nodes)
    assert ui["last_link_id"] >= max(l[0] for l in ui["links"])
    links = {}
    for lid, src, src_slot, dst, dst_slot, ltype in ui["links"]:
        assert lid not in links
        links[lid] = (src, src_slot, dst, dst_slot, ltype)
        assert nodes[src]["outputs"][src_slot]["type"] == ltype
        assert lid in (nodes[src]["outputs"][src_slot].get("links") or [])
        assert nodes[dst]["inputs"][dst_slot]["link"] == lid
    for n in ui["nodes"]:
        assert n["mode"] == 0, "node %s is muted or bypassed" % n["id"]
        for i in n.get("inputs", []):
            assert i.get("link") is None or i["link"] in links
        for o in n.get("outputs", []):
            for lid in o.get("links") or []:
                assert links[lid][0] == n["id"]


def test_safesage_between_loader_and_every_model_consumer():
    ui = load_ui()
    nodes = {n["id"]: n for n in ui["nodes"]}
    by_type = {}
    for n in ui["nodes"]:
        by_type.setdefault(n["type"], []).append(n)
    (loader,), (ss,) = by_type["UNETLoader"], by_type["SafeSageAttention"]
    model_links = [l for l in ui["links"] if l[5] == "MODEL"]
    from_loader = [l for l in model_links if l[1] == loader["id"]]
    assert [(l[3], l[4]) for l in from_loader] == [(ss["id"], 0)], "the loader's MODEL goes only to SafeSage"
    consumers = [l for l in model_links if l[1] != loader["id"]]
    assert consumers and all(l[1] == ss["id"] for l in consumers)
    assert sorted(nodes[l[3]]["type"] for l in consumers) == ["BasicGuider", "BasicScheduler"]
    assert ss["widgets_values"] == ["auto", "auto", 16384, "first", False]


def test_api_copy_has_the_same_wiring():
    api = load_api()
    ss = [k for k, v in api.items() if v["class_type"] == "SafeSageAttention"]
    assert len(ss) == 1 and api[ss[0]]["inputs"]["model"] == ["1", 0]
    users = sorted(v["class_type"] for v in api.values() if v["inputs"].get("model") == [ss[0], 0])
    assert users == ["BasicGuider", "BasicScheduler"]
    # the reporter's graph otherwise unchanged
    assert api["6"]["inputs"]["width"] == 1664 and api["6"]["inputs"]["length"] == 362
