"""Importing the pack outside a running ComfyUI (a script, a test, ComfyUI-Manager's checks) starts
nothing of ComfyUI's: the stats route is registered only on the PromptServer that ComfyUI's main.py
has already imported (``sys.modules["server"]``), never by importing ``server`` -- which runs
ComfyUI's device set-up (comfy.model_management) and, on a CPU-only torch without --cpu, raises."""
import importlib.util
import os
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _import_pack(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "__init__.py"),
                                                  submodule_search_locations=[ROOT])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def comfy_importable():
    if importlib.util.find_spec("comfy_api") is None or importlib.util.find_spec("server") is None:
        pytest.skip("ComfyUI is not on PYTHONPATH (bash .ci/run puts the pass's tree there)")
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith("safesage_pack_test"):
            del sys.modules[name]


def test_importing_the_pack_does_not_import_comfyuis_server(comfy_importable, monkeypatch):
    monkeypatch.delitem(sys.modules, "server", raising=False)
    pack = _import_pack("safesage_pack_test_a")
    assert "server" not in sys.modules
    assert pack.nodes.routes._registered is False


def test_the_route_is_registered_on_the_running_prompt_server(comfy_importable, monkeypatch):
    added = []

    class Routes:
        def get(self, path):
            return lambda handler: added.append((path, handler))
    ps = types.SimpleNamespace(instance=types.SimpleNamespace(routes=Routes()))
    monkeypatch.setitem(sys.modules, "server", types.SimpleNamespace(PromptServer=ps))
    pack = _import_pack("safesage_pack_test_b")
    assert pack.nodes.routes._registered is True
    assert [p for p, _ in added] == [pack.nodes.routes.STATS_PATH]
