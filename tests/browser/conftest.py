"""Fixtures for tests/browser/: a headless ComfyUI (--cpu) of its own, with its frontend, driven in
headless chromium. Reuses the harness's server helpers (tools/harness/comfy_server.py, comfy_graphs.py).

Every test here is skipped, with the reason printed (-rs), without a ComfyUI tree
(COMFYUI_PATH), or without chromium / playwright / comfyui-frontend-package
(`bash .ci/setup_browser.sh <venv python>` installs them). These skips are kept out of the
tests/comfy guard in .ci/check_junit.py on purpose: the browser is optional in CI.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

from browser import browser_problem  # noqa: E402
from tools.harness.comfy_server import comfy_path_problem, running_pack_server, server_python  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "browser: drives ComfyUI's frontend in headless chromium "
                                       "(tests/browser); skipped without chromium/playwright")


def _problem() -> str | None:
    return comfy_path_problem() or browser_problem(server_python())


def pytest_collection_modifyitems(config, items):
    mine = [i for i in items if HERE in Path(str(i.fspath)).resolve().parents]
    if not mine:
        return
    problem = _problem()
    if problem is None:
        return
    skip = pytest.mark.skip(reason=problem)
    for item in mine:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def comfy(tmp_path_factory):
    """A ComfyUI server for the browser tests, with the pack, the test nodes and the frontend."""
    with running_pack_server(tmp_path_factory.mktemp("comfy_browser_base"), name="browser") as server:
        yield server


@pytest.fixture(scope="session")
def tiny_sd2(comfy):
    return comfy.make_model("sd2", "safesage_tiny_sd2.safetensors", seed=1234)


@pytest.fixture
def seed():
    return 4242
