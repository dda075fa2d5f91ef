"""A broken install of the pack (a half-updated safe_ops that fails to import) in a second, short
-lived real ComfyUI server: ComfyUI keeps running, the start-up log says clearly what failed, and
nothing samples silently without the guard."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tools.harness.comfy_graphs import sd2_graph
from tools.harness.comfy_server import PACK_DIR_NAME, REPO, TEST_NODES, TEST_NODES_DIR_NAME, ComfyServer, execution_error

CAUSE = "simulated broken SafeSage install (tests/comfy)"
# what a user's install has; everything else in the repository is development-only
NOT_SHIPPED = {".git", ".ci", "tests", "bench", "docs", "example_workflows", ".venv", ".comfy",
               "build", "dist", ".pytest_cache", ".whl"}


@pytest.fixture(scope="module")
def broken_server(comfy, tiny_sd2, tmp_path_factory):
    base = tmp_path_factory.mktemp("comfy_broken_base")
    pack = base / "custom_nodes" / PACK_DIR_NAME
    pack.mkdir(parents=True)
    for src in REPO.iterdir():
        if src.name in NOT_SHIPPED or src.name.startswith(".git"):
            continue
        if src.is_dir():
            shutil.copytree(src, pack / src.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, pack / src.name)
    # a half-updated install: one safe_ops module raises at import
    (pack / "safe_ops" / "patch.py").write_text("raise ImportError(%r)\n" % CAUSE)
    server = ComfyServer(base, {TEST_NODES_DIR_NAME: TEST_NODES}, name="broken")
    os.link(tiny_sd2["path"], server.models_dir / os.path.basename(tiny_sd2["path"]))
    try:
        server.start()
        yield server
    finally:
        server.stop()


def test_broken_pack_is_reported_clearly_and_server_lives(broken_server, tiny_sd2, seed_counter):
    s = broken_server
    logs = s.logs()
    relevant = [l for l in logs.splitlines() if "SafeSage" in l or PACK_DIR_NAME in l or CAUSE in l]
    assert any(CAUSE in l for l in relevant), "the cause is not in /internal/logs:\n" + "\n".join(relevant)
    assert any("SafeSage" in l and ("IMPORT FAILED" in l or "Cannot import" in l) for l in relevant), relevant
    assert s.alive()

    # the node is still listed (nodes/_backend.py catches the import error) but must refuse to run,
    # naming the cause, instead of passing the model through unguarded
    assert "SafeSageAttention" in s.object_info(), "the broken pack registered no node"
    pid = s.post_prompt(sd2_graph(os.path.basename(tiny_sd2["path"]), seed_counter(), "broken", safesage={}))
    assert isinstance(pid, str), pid
    entry = s.wait_history(pid)
    assert entry["status"]["status_str"] == "error", "the node ran with its core missing"
    err = execution_error(entry)
    assert err["node_type"] == "SafeSageAttention", err
    assert CAUSE in err["exception_message"] and "SafeSage" in err["exception_message"], err
    assert s.alive()
    r = s.get_json("/system_stats")
    assert r["system"]["comfyui_version"], json.dumps(r)[:500]


def test_broken_pack_stats_route_says_unavailable(broken_server):
    import requests

    r = requests.get(broken_server.url + "/safesage/stats", timeout=30)
    assert r.status_code == 503, (r.status_code, r.text[:500])   # registered, and says why it has nothing
    assert CAUSE in r.json()["error"]
