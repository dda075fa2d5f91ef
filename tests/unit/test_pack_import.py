"""Importing the pack outside a running ComfyUI (a script, pytest treating the checkout as a
package with a ComfyUI tree on PYTHONPATH, ComfyUI-Manager's checks) starts nothing of ComfyUI's:

* the node API is imported only where ComfyUI has set up its device (``comfy.model_management``
  imported, as ComfyUI's main.py has before it loads custom nodes): importing it elsewhere starts
  that set-up -- on a CPU-only torch without --cpu it raises -- or fails on a package ComfyUI's own
  start-up needs (PyAV: the GPU machine's pytest of tests/gpu failed collecting on it);
* the stats route is registered only on the PromptServer ComfyUI's main.py has already imported
  (``sys.modules["server"]``), never by importing ``server``."""
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


def test_outside_a_running_comfyui_the_pack_imports_nothing_of_comfyuis(comfy_importable, monkeypatch):
    for name in ("server", "comfy.model_management", "comfy_api.latest"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    pack = _import_pack("safesage_pack_test_a")
    assert pack.__all__ == ["WEB_DIRECTORY"] and not hasattr(pack, "comfy_entrypoint")
    assert not {"server", "comfy.model_management", "comfy_api.latest"} & set(sys.modules)


def test_in_a_running_comfyui_the_route_goes_on_its_prompt_server(comfy_importable, monkeypatch):
    import comfy.cli_args
    monkeypatch.setattr(comfy.cli_args.args, "cpu", True)      # as the test servers start ComfyUI
    import comfy.model_management  # noqa: F401 - what ComfyUI's main.py has imported by now
    added = []

    class Routes:                      # aiohttp's RouteTableDef, as PromptServer.routes has it
        def get(self, path):
            return lambda handler: added.append(("GET", path, handler))

        def post(self, path):
            return lambda handler: added.append(("POST", path, handler))
    ps = types.SimpleNamespace(instance=types.SimpleNamespace(routes=Routes()))
    monkeypatch.setitem(sys.modules, "server", types.SimpleNamespace(PromptServer=ps))
    pack = _import_pack("safesage_pack_test_b")
    assert "comfy_entrypoint" in pack.__all__
    assert pack.nodes.routes._registered is True
    assert [(m, p) for m, p, _ in added] == [("GET", pack.nodes.routes.STATS_PATH),
                                             ("POST", pack.nodes.routes.FORGET_PATH)]
