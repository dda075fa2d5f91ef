"""example_workflows/: the UI-format templates ComfyUI's template browser lists, their thumbnails,
the API-format copies, and the download entries of every model file they name. Pure JSON checks
here (no URL is ever fetched: only its form is checked); tests/comfy/test_comfy_example_workflow.py
converts each UI file to an API prompt against a real ComfyUI's /object_info and runs the quick-start
template on generated tiny models of its file names, and tests/browser/test_browser_frontend.py lets
the frontend itself load them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WF = REPO / "example_workflows"
H3 = "minimax_h3_ref2va_safesage"
H3_720 = "minimax_h3_ref2va_720p_safesage"      # the same graph sized for a 16-24 GB card
QUICK = "safesage_quickstart_lotus_depth"
H3S = [H3, H3_720]
NAMES = [H3, H3_720, QUICK]
#: each H3 template's size (width, height, length in frames) and reference images
SIZES = {H3: (1664, 960, 362, 3), H3_720: (1280, 720, 362, 3)}
H3_STEPS = 20          # what the bug report renders its video with (its repro: 2)

#: the ComfyUI models/ folder each loader reads its file from, and the widget that names it
LOADERS = {"UNETLoader": ("unet_name", "diffusion_models"), "CLIPLoader": ("clip_name", "text_encoders"),
           "VAELoader": ("vae_name", "vae")}
KNOWN_DIRECTORIES = {"diffusion_models", "text_encoders", "vae", "checkpoints", "loras", "clip_vision"}
#: where each template's files come from (the Hugging Face repositories README cites)
REPOS = {H3: {"Comfy-Org/MiniMax-H3"}, H3_720: {"Comfy-Org/MiniMax-H3"}, QUICK: {"Comfy-Org/lotus", "stabilityai/sd-vae-ft-mse-original"}}
SAFESAGE_DEFAULTS = ["auto", "auto", 16384, "first", False, "balanced", 0, 0]
FRONTEND_ONLY = {"MarkdownNote", "Note"}      # the frontend's own nodes: never in a prompt


def load_ui(name: str) -> dict:
    return json.loads((WF / (name + ".json")).read_text())


def load_api(name: str) -> dict:
    return json.loads((WF / "api" / (name + ".json")).read_text())


def nodes_of(ui: dict, type_: str) -> list[dict]:
    return [n for n in ui["nodes"] if n["type"] == type_]


def source(ui: dict, node: dict, input_name: str):
    """(node, slot) that feeds ``input_name`` of ``node``, or None."""
    links = {l[0]: l for l in ui["links"]}
    nodes = {n["id"]: n for n in ui["nodes"]}
    inp = next(i for i in node["inputs"] if i["name"] == input_name)
    if inp.get("link") is None:
        return None
    lid, src, slot, *_ = links[inp["link"]]
    return nodes[src], slot


def test_template_browser_sees_only_ui_workflows():
    """ComfyUI lists example_workflows/*.json (not sub-folders) and opens only the UI format."""
    listed = sorted(p.name for p in WF.glob("*.json"))
    assert listed == sorted(n + ".json" for n in NAMES)
    assert sorted(p.name for p in (WF / "api").glob("*.json")) == listed
    for p in WF.glob("*.json"):
        wf = json.loads(p.read_text())
        assert isinstance(wf.get("nodes"), list) and isinstance(wf.get("links"), list), p


@pytest.mark.parametrize("name", NAMES)
def test_thumbnail_next_to_the_template(name):
    """The frontend asks for /api/workflow_templates/<pack>/<name>.jpg."""
    jpg = (WF / (name + ".jpg")).read_bytes()
    assert jpg[:3] == b"\xff\xd8\xff" and 10_000 < len(jpg) < 400_000


@pytest.mark.parametrize("name", NAMES)
def test_ui_format_is_consistent(name):
    ui = load_ui(name)
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


def _url_problem(url: str, name: str, directory: str) -> str | None:
    """Why ``url`` is not a direct Hugging Face download of ``name``, or None (form only)."""
    m = re.fullmatch(r"https://huggingface\.co/([\w.-]+/[\w.-]+)/resolve/main/(?:[\w.-]+/)*([\w.-]+)", url)
    if not m:
        return "not https://huggingface.co/<owner>/<repo>/resolve/main/<path>"
    if m.group(2) != name:
        return "the URL's file is %s, not %s" % (m.group(2), name)
    if directory not in KNOWN_DIRECTORIES:
        return "directory %r is no ComfyUI models/ folder" % directory
    return None


@pytest.mark.parametrize("name", NAMES)
def test_every_model_file_has_a_download_entry(name):
    """Each loader's file is in its node's ``properties.models`` (name, url, directory) -- what the
    frontend's missing-models dialog offers to download -- with an https Hugging Face ``resolve/``
    URL of that file, the loader's own models/ folder, from the template's source repository."""
    ui = load_ui(name)
    seen = set()
    for n in ui["nodes"]:
        entries = n.get("properties", {}).get("models", [])
        if n["type"] in LOADERS:
            widget, directory = LOADERS[n["type"]]
            file = n["widgets_values"][0]
            assert [e["name"] for e in entries] == [file], (n["type"], file, entries)
            assert entries[0]["directory"] == directory, entries
        for e in entries:
            assert set(e) == {"name", "url", "directory"}, e
            problem = _url_problem(e["url"], e["name"], e["directory"])
            assert problem is None, (e, problem)
            repo = re.match(r"https://huggingface\.co/([^/]+/[^/]+)/", e["url"]).group(1)
            assert repo in REPOS[name], (e["url"], REPOS[name])
            seen.add(e["name"])
    api_files = {v for node in load_api(name).values() for k, v in node["inputs"].items()
                 if k in {w for w, _ in LOADERS.values()}}
    assert seen == api_files and seen, (seen, api_files)


def test_the_url_check_refuses_what_it_must():
    """The form check above is not vacuous."""
    ok = "https://huggingface.co/Comfy-Org/lotus/resolve/main/lotus-depth-d-v1-1.safetensors"
    assert _url_problem(ok, "lotus-depth-d-v1-1.safetensors", "diffusion_models") is None
    assert _url_problem(ok.replace("https", "http"), "lotus-depth-d-v1-1.safetensors", "diffusion_models")
    assert _url_problem(ok.replace("/resolve/", "/blob/"), "lotus-depth-d-v1-1.safetensors", "diffusion_models")
    assert _url_problem(ok, "other.safetensors", "diffusion_models")
    assert _url_problem(ok, "lotus-depth-d-v1-1.safetensors", "unet_models")
    assert _url_problem(ok + "?download=true", "lotus-depth-d-v1-1.safetensors", "diffusion_models")


@pytest.mark.parametrize("name", NAMES)
def test_the_note_links_the_same_files(name):
    """The template's note names every download its loaders carry (for a frontend without the
    missing-models dialog)."""
    ui = load_ui(name)
    (note,) = nodes_of(ui, "MarkdownNote")
    text = note["widgets_values"][0]
    for n in ui["nodes"]:
        for e in n.get("properties", {}).get("models", []):
            assert "[%s](%s)" % (e["name"], e["url"]) in text, e


@pytest.mark.parametrize("name,consumers", [
    (H3, ["BasicGuider", "BasicScheduler", "SafeSagePreflight"]),
    (H3_720, ["BasicGuider", "BasicScheduler", "SafeSagePreflight"]),
    (QUICK, ["BasicGuider", "BasicScheduler"]),
])
def test_safesage_between_loader_and_every_model_consumer(name, consumers):
    ui = load_ui(name)
    nodes = {n["id"]: n for n in ui["nodes"]}
    (loader,), (ss,) = nodes_of(ui, "UNETLoader"), nodes_of(ui, "SafeSageAttention")
    model_links = [l for l in ui["links"] if l[5] == "MODEL"]
    from_loader = [l for l in model_links if l[1] == loader["id"]]
    assert [(l[3], l[4]) for l in from_loader] == [(ss["id"], 0)], "the loader's MODEL goes only to SafeSage"
    others = [l for l in model_links if l[1] != loader["id"]]
    assert others and all(l[1] == ss["id"] for l in others)
    assert sorted(nodes[l[3]]["type"] for l in others) == consumers
    assert ss["widgets_values"] == SAFESAGE_DEFAULTS      # all 8 inputs, at their defaults


@pytest.mark.parametrize("name", H3S)
def test_h3_template_holds_preflight_for_its_own_size(name):
    """SafeSage Preflight reports the graph's own size: width, height and length come from the
    same primitive nodes as the H3 node's; its model is SafeSage's; ref_images counts the
    reference images wired into the H3 node."""
    ui = load_ui(name)
    (pf,), (h3,), (ss,) = (nodes_of(ui, t) for t in ("SafeSagePreflight", "MiniMaxH3ReferenceToVideo",
                                                      "SafeSageAttention"))
    assert source(ui, pf, "model") == (ss, 0)
    size = {}
    for k in ("width", "height", "length"):
        src = source(ui, pf, k)
        assert src is not None and src == source(ui, h3, k), k
        assert src[0]["type"] == "PrimitiveInt"
        size[k] = src[0]["widgets_values"][0]
    assert size == dict(zip(("width", "height", "length"), SIZES[name][:3]))
    refs = [i for i in h3["inputs"] if i["name"].startswith("ref_images.") and i.get("link") is not None]
    widgets = dict(zip(["width", "height", "length", "ref_images", "text_tokens"], pf["widgets_values"]))
    assert widgets["ref_images"] == len(refs) == SIZES[name][3]


@pytest.mark.parametrize("name", NAMES)
def test_load_image_nodes_say_what_to_load(name):
    """Each LoadImage starts on example.png (it ships with ComfyUI, so the template runs as
    shipped) and its title says what to load."""
    ui = load_ui(name)
    images = nodes_of(ui, "LoadImage")
    assert images
    for n in images:
        assert n["widgets_values"][0] == "example.png", n
        assert re.search(r"\bload\b", n.get("title", ""), re.I), n.get("title")
    titles = [n["title"] for n in images]
    assert len(set(titles)) == len(titles)


@pytest.mark.parametrize("name", NAMES)
def test_api_copy_has_the_same_nodes(name):
    """The API copy holds the UI template's nodes (minus the frontend's own) with the same types."""
    ui, api = load_ui(name), load_api(name)
    want = {str(n["id"]): n["type"] for n in ui["nodes"] if n["type"] not in FRONTEND_ONLY}
    assert {k: v["class_type"] for k, v in api.items()} == want


def test_h3_api_copy_is_the_reporters_graph_with_safesage_and_preflight():
    api = load_api(H3)
    ss = [k for k, v in api.items() if v["class_type"] == "SafeSageAttention"]
    assert len(ss) == 1 and api[ss[0]]["inputs"]["model"] == ["1", 0]
    users = sorted(v["class_type"] for v in api.values() if v["inputs"].get("model") == [ss[0], 0])
    assert users == ["BasicGuider", "BasicScheduler", "SafeSagePreflight"]
    h3 = api["6"]["inputs"]
    size = {k: api[h3[k][0]]["inputs"]["value"] for k in ("width", "height", "length")}
    assert size == {"width": 1664, "height": 960, "length": 362}          # the reporter's size
    pf = next(v for v in api.values() if v["class_type"] == "SafeSagePreflight")["inputs"]
    assert all(pf[k] == h3[k] for k in ("width", "height", "length"))


def test_720p_template_is_the_reporters_graph_at_1280x720():
    """The 16-24 GB template is the 1664x960 one with only its size (and output name) changed."""
    big, small = load_api(H3), load_api(H3_720)
    assert sorted(big) == sorted(small)
    changed = {k for k in big if big[k] != small[k]}
    assert changed == {"40", "41", "15"}, changed            # width, height; SaveVideo's filename
    assert [small[k]["inputs"]["value"] for k in ("40", "41", "42")] == [1280, 720, 362]


@pytest.mark.parametrize("name", H3S)
def test_h3_templates_render_a_videos_step_count(name):
    """The H3 templates sample 20 steps, what the bug report renders with (/work/shared's report: "a full
    20-step run"), not its 2-step repro setting; the note says both."""
    ui, api = load_ui(name), load_api(name)
    (sched,) = nodes_of(ui, "BasicScheduler")
    assert sched["widgets_values"][1] == H3_STEPS
    assert next(v for v in api.values() if v["class_type"] == "BasicScheduler")["inputs"]["steps"] == H3_STEPS
    note = _note(name)
    assert "**Steps**: 20" in note and "set *steps* to 2 to reproduce" in note


def _note(name: str) -> str:
    (note,) = nodes_of(load_ui(name), "MarkdownNote")
    return note["widgets_values"][0]


def _own_tokens(name: str) -> int:
    """The template's packed token count from the function SafeSage Preflight uses, for the size its
    own Preflight node reports on (widget values, the primitives' values where they are wired)."""
    from safe_ops.models.h3.dims import packed_tokens
    ui = load_ui(name)
    (pf,) = nodes_of(ui, "SafeSagePreflight")
    widgets = dict(zip(["width", "height", "length", "ref_images", "text_tokens"], pf["widgets_values"]))
    return packed_tokens(widgets["width"], widgets["height"], widgets["length"], widgets["ref_images"],
                         widgets["text_tokens"]).total


@pytest.mark.parametrize("name", H3S)
def test_note_token_count_is_preflights(name):
    """Each H3 template's note states its token count as SafeSage Preflight computes it (h3.dims.packed_tokens,
    the function ui/preflight.py's assess() calls), and README's Templates section states the same."""
    tokens = _own_tokens(name)
    note = re.sub(r"\s+", " ", _note(name))
    assert "%s tokens as SafeSage Preflight counts them" % f"{tokens:,}" in note, (tokens, note)
    assert len(re.findall(r"[0-9]{1,3}(?:,[0-9]{3})+ tokens as SafeSage Preflight", note)) == 1
    readme = re.sub(r"\s+", " ", (REPO / "README.md").read_text())
    assert "%s tokens as SafeSage Preflight counts them" % f"{tokens:,}" in readme, tokens


def test_the_reporters_graph_is_173062_tokens_with_its_references():
    """Issue 48: with its 3 reference images the reporter's size is 173,062 tokens (168,382 without)."""
    assert _own_tokens(H3) == 173_062
    from safe_ops.models.h3.dims import packed_tokens
    assert packed_tokens(1664, 960, 362, 0).total == 168_382


def test_the_720p_note_quotes_the_length_measurement():
    """The 16-24 GB template's size is one the 24 GiB length measurement completed with room to spare, and
    its note quotes that measurement's numbers and says what kind of measurement it is."""
    m = json.loads((REPO / "bench" / "results" / "max_length_h100.json").read_text())
    b = m["budgets"]["24"]
    arms = b["arms"]
    assert (m["width"], m["height"], b["free_gib"], m["blocks"]) == (1280, 720, 24.0, 8)
    note = re.sub(r"\s+", " ", _note(H3_720))
    assert ("with 24 GiB free, SafeSage completed 1280x720 up to %d frames (%s tokens), unguarded SageAttention "
            "up to %d" % (arms["safesage"]["max_frames"], f"{arms['safesage']['max_tokens']:,}",
                          arms["sage"]["max_frames"])) in note, note
    assert "8-block emulated measurement" in note and "A 16 GB card is not measured" in note
    assert _own_tokens(H3_720) <= arms["safesage"]["max_tokens"] // 2 + 1000       # "half those tokens"


@pytest.mark.parametrize("name", NAMES)
def test_note_says_what_the_template_needs(name):
    """Each note: the ComfyUI it needs (the declared minimum), the downloads with a size each and their
    total, the card it was sized for, and the time per step (measured or said to be not)."""
    note = re.sub(r"\s+", " ", _note(name))
    minimum = re.search(r'^"requires-comfyui" = ">=([0-9.]+)"$', (REPO / "pyproject.toml").read_text(), re.M)
    assert "**Needs**: ComfyUI %s" % minimum.group(1) in note
    assert re.search(r"\*\*Downloads, about [0-9.]+ GB\*\*", note)
    bullets = _note(name).split("\n- ")[1:]
    for n in load_ui(name)["nodes"]:
        for e in n.get("properties", {}).get("models", []):
            (bullet,) = [b for b in bullets if "[%s](" % e["name"] in b]
            assert re.match(r"[a-z_]+, (?:about )?[0-9.]+ [GM]B", bullet), bullet      # folder, size: link
    assert "Sized for" in note or "for a 16-24 GB card" in note
    assert "Time per step" in note


def test_quickstart_api_copy_runs_lotus_through_safesage():
    api = load_api(QUICK)
    ss = [k for k, v in api.items() if v["class_type"] == "SafeSageAttention"]
    assert len(ss) == 1
    users = sorted(v["class_type"] for v in api.values() if v["inputs"].get("model") == [ss[0], 0])
    assert users == ["BasicGuider", "BasicScheduler"]
    assert api[api[ss[0]]["inputs"]["model"][0]]["inputs"]["unet_name"] == "lotus-depth-d-v1-1.safetensors"


def test_readme_cites_where_the_files_come_from():
    """README names both templates and the pages their model files were taken from."""
    readme = (REPO / "README.md").read_text()
    for name in NAMES:
        assert "example_workflows/%s.json" % name in readme, name
    for repos in REPOS.values():
        for repo in repos:
            assert "https://huggingface.co/%s" % repo in readme, repo
