"""Fixtures for tests/comfy/: one real headless ComfyUI server per pytest session.

See tools/harness/comfy_server.py for how it is started. Without a usable COMFYUI_PATH (and outside
`bash .ci/run`, which sets one up) every test here is skipped with the reason printed (-rs).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.harness.comfy_server import (PACK_DIR_NAME, REPO, TEST_NODES, TEST_NODES_DIR_NAME, ComfyServer,
                          comfy_path_problem, fake_quality_server, skip_without_h3)

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    problem = comfy_path_problem()
    if problem is None:
        return
    skip = pytest.mark.skip(reason=problem)
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def comfy(tmp_path_factory):
    """The session's ComfyUI server, started once, with the pack and the test nodes loaded."""
    problem = comfy_path_problem()
    if problem:
        pytest.skip(problem)
    base = tmp_path_factory.mktemp("comfy_base")
    server = ComfyServer(base, {PACK_DIR_NAME: REPO, TEST_NODES_DIR_NAME: TEST_NODES})
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tiny_sd2(comfy):
    """A tiny SD2-class UNet in the server's diffusion_models folder (generated once)."""
    return comfy.make_model("sd2", "safesage_tiny_sd2.safetensors", seed=1234)


@pytest.fixture(scope="session")
def tiny_h3(comfy):
    skip_without_h3("the H3 tests need")
    return comfy.make_model("h3", "safesage_tiny_h3_fp8.safetensors", seed=4321)


@pytest.fixture
def seed_counter():
    """Distinct seeds across the session: ComfyUI caches identical prompts."""
    return _SEEDS


class _Seeds:
    # a fresh server per session has an empty cache, so a fixed start keeps runs reproducible
    def __init__(self):
        self.n = 1000

    def __call__(self) -> int:
        self.n += 1
        return self.n


_SEEDS = _Seeds()



@pytest.fixture(scope="session")
def quality_server(tmp_path_factory, comfy):   # comfy: the session server's skip reasons apply here too
    """A second headless ComfyUI with the tests' fake guarded families and the tiny H3 with drifting
    blocks (tools/harness/comfy_server.fake_quality_server): (server, model file name). Shared by every
    test that needs guarded kernels on the CPU (H3 trees only)."""
    skip_without_h3("the quality guard's ComfyUI tests need")
    with fake_quality_server(tmp_path_factory.mktemp("comfy_quality_shared"),
                             tmp_path_factory.mktemp("fake_families"), name="comfy-quality-shared") as qs:
        yield qs
