"""A real headless ComfyUI server process and its HTTP helpers (tests/comfy/conftest.py, tests/browser).

Source tree: $COMFYUI_PATH (set by .ci/setup_env.sh to ComfyUI 0.3.75 from PyPI; developers point
it at another tree, e.g. a 0dd9b154 export for the MiniMax H3 tests). Python: $SAFESAGE_PYTHON
if set, else the python running pytest; it must have ComfyUI's requirements installed.
Without a usable COMFYUI_PATH every test here is skipped with the reason printed (-rs).

The server runs `main.py --cpu` on 127.0.0.1 with a temporary --base-directory whose
custom_nodes/ holds this repository (symlinked as ComfyUI-SafeSage) and the test-only nodes in
tests/comfy/test_nodes (symlinked as safesage_test_nodes). comfy_process starts it (Popen) and
stops it by that PID at the end of the session; the GPU reproduction harness (bench/repro) starts
its servers with the same code.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from .comfy_process import START_TIMEOUT_S, ComfyProcess, ServerDied, execution_error, free_port  # noqa: F401

try:
    import requests
except ImportError:  # reported as the skip reason by comfy_path_problem()
    requests = None

REPO = Path(__file__).resolve().parents[2]        # tools/harness/comfy_server.py -> the repository
TEST_NODES = REPO / "tests" / "comfy" / "test_nodes"     # loaded beside the pack
PACK_DIR_NAME = "ComfyUI-SafeSage"
TEST_NODES_DIR_NAME = "safesage_test_nodes"


def comfy_path_problem() -> str | None:
    """Why the ComfyUI tests cannot run here, or None."""
    missing = [m for m in ("requests", "torch", "safetensors") if importlib.util.find_spec(m) is None]
    if missing:
        return ("%s not installed in this python: run the tests with `bash .ci/run`"
                % ", ".join(missing))
    p = os.environ.get("COMFYUI_PATH")
    if not p:
        return ("COMFYUI_PATH is not set: these tests need a ComfyUI tree "
                "(`bash .ci/run` sets one up, see README)")
    root = Path(p)
    if not (root / "main.py").is_file() or not (root / "comfy" / "model_management.py").is_file():
        return "COMFYUI_PATH=%s is not a ComfyUI tree (no main.py / comfy/model_management.py)" % p
    return None


def comfy_root() -> Path:
    return Path(os.environ["COMFYUI_PATH"]).resolve()


def server_python() -> str:
    return os.environ.get("SAFESAGE_PYTHON") or sys.executable


def has_minimax_h3() -> bool:
    return comfy_path_problem() is None and (comfy_root() / "comfy" / "ldm" / "minimax" / "model.py").is_file()


class ComfyServer(ComfyProcess):
    """The tests' server: $COMFYUI_PATH's main.py --cpu, run by server_python(), importing from
    its own tree only (no PYTHONPATH); plus the HTTP helpers the tests use."""

    def __init__(self, base: Path, custom_nodes: dict[str, Path], name: str = "comfy",
                 extra_args: tuple = (), env: dict | None = None):
        self.extra_args = list(extra_args)     # more ComfyUI flags, e.g. --use-split-cross-attention
        # env: variables set for the server (e.g. SAFESAGE_EXTRA_FAMILIES and the PYTHONPATH it needs)
        super().__init__(base, custom_nodes, root=comfy_root(), python=server_python(),
                         flags=["--cpu"] + self.extra_args, env=env, name=name)

    def run(self, graph: dict, timeout: float = 300, remember: bool = False) -> dict:
        """Queue a graph that must succeed; returns its history entry. Unless ``remember``, the quality
        guard first forgets what earlier prompts measured (POST /safesage/quality/forget): each such
        prompt measures at its own step 1, as the tests written before issue #46 expect; a test of the
        remembered errors passes ``remember=True``."""
        if not remember:
            self.forget_quality()
        entry = self.queue_and_wait(graph, timeout)
        if entry["status"]["status_str"] != "success":
            raise AssertionError("prompt failed: %s\nlog tail:\n%s" % (
                json.dumps(execution_error(entry), indent=1)[:4000], self.log_tail()))
        return entry

    def forget_quality(self) -> int | None:
        """POST /safesage/quality/forget: how many remembered measurements went (None: no such route,
        e.g. a pack that failed to import)."""
        r = requests.post(self.url + "/safesage/quality/forget", timeout=30)
        return r.json().get("forgotten") if r.status_code == 200 else None

    def safesage_stats(self) -> dict:
        r = requests.get(self.url + "/safesage/stats", timeout=30)
        assert r.status_code == 200, "/safesage/stats answered %s: %s" % (r.status_code, r.text[:2000])
        return r.json()

    # ------------------------------------------------------------------ models
    def make_model(self, kind: str, name: str, seed: int = 0, args: tuple = ()) -> dict:
        """Write a tiny random model into <base>/models/diffusion_models/<name>; returns the
        generator's JSON description (see tiny_models.py; ``args``: its further options)."""
        out = self.models_dir / name
        # the generator imports ComfyUI (its tree first, so its own `nodes` wins) and this harness
        env = dict(os.environ, COMFYUI_PATH=str(comfy_root()),
                   PYTHONPATH=os.pathsep.join([str(comfy_root()), str(REPO)]))
        r = subprocess.run([server_python(), "-m", "tools.harness.tiny_models", kind, str(out),
                            "--seed", str(seed), *args],
                           cwd=str(self.base), env=env, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError("tiny_models.py %s failed:\n%s\n%s" % (kind, r.stdout, r.stderr[-4000:]))
        return json.loads(r.stdout.strip().splitlines()[-1])


@contextmanager
def running_pack_server(base: Path, name: str = "comfy", extra_args: tuple = ()):
    """A started server with this pack and the test nodes in its custom_nodes; stopped on exit."""
    server = ComfyServer(base, {PACK_DIR_NAME: REPO, TEST_NODES_DIR_NAME: TEST_NODES}, name=name,
                         extra_args=extra_args)
    try:
        server.start()
        yield server
    finally:
        server.stop()



#: the quality guard's test server: the fake guarded families (tests/unit/fake_quality_families.py) and
#: a tiny H3 whose blocks QUALITY_OUTLIERS drift under fake_sage (k_norm x QUALITY_FACTOR on 2 channels)
QUALITY_FAKE = "fake_quality_families"
QUALITY_BLOCKS, QUALITY_OUTLIERS, QUALITY_FACTOR = 6, (4, 5), 32
QUALITY_MODEL = "safesage_tiny_h3_outliers.safetensors"


@contextmanager
def fake_quality_server(base: Path, families_dir: Path, name: str = "comfy-quality"):
    """A started server (H3 trees) with SAFESAGE_EXTRA_FAMILIES=fake_quality_families (that module
    alone, linked into ``families_dir``, on its PYTHONPATH) and the tiny H3 with drifting blocks:
    yields (server, the model's file name); stopped on exit."""
    (families_dir / f"{QUALITY_FAKE}.py").symlink_to(REPO / "tests" / "unit" / f"{QUALITY_FAKE}.py")
    server = ComfyServer(base, {PACK_DIR_NAME: REPO, TEST_NODES_DIR_NAME: TEST_NODES}, name=name,
                         env={"SAFESAGE_EXTRA_FAMILIES": QUALITY_FAKE, "PYTHONPATH": str(families_dir)})
    try:
        server.start()
        model = server.make_model("h3", QUALITY_MODEL, seed=77,
                                  args=("--blocks", str(QUALITY_BLOCKS), "--outlier-blocks",
                                        ",".join(map(str, QUALITY_OUTLIERS)), "--outlier-factor", str(QUALITY_FACTOR)))
        assert model["blocks"] == QUALITY_BLOCKS and model["outlier_blocks"] == list(QUALITY_OUTLIERS)
        yield server, os.path.basename(model["path"])
    finally:
        server.stop()


def skip_without_h3(what: str) -> None:
    """pytest.skip with the reason when COMFYUI_PATH's ComfyUI has no MiniMax H3 (``what``: the tests that
    need it; .ci/check_junit.py accepts a browser skip only with "MiniMax H3" in its reason)."""
    if not has_minimax_h3():
        import pytest
        pytest.skip("COMFYUI_PATH=%s has no MiniMax H3 (comfy/ldm/minimax/model.py): %s a ComfyUI with H3 "
                    "(0dd9b154 or later); `bash .ci/run` runs it in its 0dd9b154 pass"
                    % (os.environ.get("COMFYUI_PATH"), what))
