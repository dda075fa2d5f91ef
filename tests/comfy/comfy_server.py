"""A real headless ComfyUI server process and its HTTP helpers (used by tests/comfy/conftest.py).

Source tree: $COMFYUI_PATH (set by .ci/setup_env.sh to ComfyUI 0.3.75 from PyPI; developers point
it at another tree, e.g. a 0dd9b154 export for the MiniMax H3 tests). Python: $SAFESAGE_PYTHON
if set, else the python running pytest; it must have ComfyUI's requirements installed.
Without a usable COMFYUI_PATH every test here is skipped with the reason printed (-rs).

The server runs `main.py --cpu` on 127.0.0.1 with a temporary --base-directory whose
custom_nodes/ holds this repository (symlinked as ComfyUI-SafeSage) and the test-only nodes in
tests/comfy/test_nodes (symlinked as safesage_test_nodes). It is started with Popen and stopped
by that PID at the end of the session.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

try:
    import requests
except ImportError:  # reported as the skip reason by comfy_path_problem()
    requests = None

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PACK_DIR_NAME = "ComfyUI-SafeSage"
TEST_NODES_DIR_NAME = "safesage_test_nodes"
START_TIMEOUT_S = float(os.environ.get("SAFESAGE_COMFY_START_TIMEOUT", "180"))


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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ComfyServer:
    """One ComfyUI server process and the HTTP helpers the tests use."""

    def __init__(self, base: Path, custom_nodes: dict[str, Path], name: str = "comfy",
                 extra_args: tuple = ()):
        self.base = Path(base)
        self.name = name
        self.extra_args = list(extra_args)     # more ComfyUI flags, e.g. --use-split-cross-attention
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.url = ""
        self.log_path = self.base / ("%s-server.log" % name)
        (self.base / "custom_nodes").mkdir(parents=True, exist_ok=True)
        for dirname, target in custom_nodes.items():
            link = self.base / "custom_nodes" / dirname
            if not link.exists():
                os.symlink(Path(target).resolve(), link, target_is_directory=True)
        self.models_dir = self.base / "models" / "diffusion_models"
        self.models_dir.mkdir(parents=True, exist_ok=True)
        self.output_dir = self.base / "output"
        self.frontend_root = self.base / "frontend-empty"
        self.frontend_root.mkdir(exist_ok=True)
        self.client_id = uuid.uuid4().hex

    # ------------------------------------------------------------------ process
    def _cmd(self, port: int) -> list[str]:
        cmd = [server_python(), "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
               "--disable-auto-launch", "--base-directory", str(self.base),
               "--database-url", "sqlite:///:memory:", "--disable-api-nodes"] + self.extra_args
        if not self._frontend_installed():
            cmd += ["--front-end-root", str(self.frontend_root)]
        return cmd

    def _frontend_installed(self) -> bool:
        r = subprocess.run([server_python(), "-c", "import comfyui_frontend_package"],
                           capture_output=True)
        return r.returncode == 0

    def start(self, attempts: int = 3) -> "ComfyServer":
        last = ""
        for _ in range(attempts):
            port = _free_port()
            env = dict(os.environ)
            env.pop("PYTHONPATH", None)  # the server imports from its own tree only
            env["PYTHONUNBUFFERED"] = "1"
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(self._cmd(port), cwd=str(comfy_root()), env=env,
                                             stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL)
            self.port = port
            self.url = "http://127.0.0.1:%d" % port
            if self._wait_ready():
                return self
            tail = self.log_tail()
            self.stop()
            last = tail
            if "address already in use" not in tail.lower() and "errno 98" not in tail.lower():
                break
        raise RuntimeError("ComfyUI server (%s) did not start; log tail:\n%s" % (self.name, last))

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if requests.get(self.url + "/system_stats", timeout=2).status_code == 200:
                    return True
            except requests.RequestException:
                pass
            time.sleep(0.25)
        return False

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)
        self.proc = None

    def alive(self) -> bool:
        try:
            return requests.get(self.url + "/system_stats", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    # ------------------------------------------------------------------ HTTP helpers
    def get_json(self, path: str, timeout: float = 30):
        r = requests.get(self.url + path, timeout=timeout)
        r.raise_for_status()
        return r.json()

    def object_info(self) -> dict:
        return self.get_json("/object_info", timeout=60)

    def post_prompt(self, graph: dict):
        """Queue an API-format graph. Returns the prompt_id (str) when ComfyUI accepts it, or the
        JSON body (dict with `error` and `node_errors`) when it answers 400."""
        r = requests.post(self.url + "/prompt",
                          json={"prompt": graph, "client_id": self.client_id}, timeout=60)
        if r.status_code == 400:
            return r.json()
        r.raise_for_status()
        return r.json()["prompt_id"]

    def wait_history(self, prompt_id: str, timeout: float = 300) -> dict:
        """The /history entry of a finished prompt (success or error)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            h = self.get_json("/history/%s" % prompt_id)
            entry = h.get(prompt_id)
            if entry and entry.get("status", {}).get("completed") is not None and (
                    entry["status"].get("status_str") in ("success", "error")):
                return entry
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError("ComfyUI server died while running %s; log tail:\n%s"
                                   % (prompt_id, self.log_tail()))
            time.sleep(0.1)
        raise TimeoutError("prompt %s did not finish in %ss; log tail:\n%s"
                           % (prompt_id, timeout, self.log_tail()))

    def run(self, graph: dict, timeout: float = 300) -> dict:
        """Queue a graph that must succeed; returns its history entry."""
        pid = self.post_prompt(graph)
        assert isinstance(pid, str), "prompt rejected: %s" % json.dumps(pid, indent=1)[:3000]
        entry = self.wait_history(pid, timeout)
        if entry["status"]["status_str"] != "success":
            raise AssertionError("prompt failed: %s\nlog tail:\n%s" % (
                json.dumps(execution_error(entry), indent=1)[:4000], self.log_tail()))
        return entry

    def logs(self) -> str:
        """ComfyUI's own log buffer (GET /internal/logs) as one string."""
        data = self.get_json("/internal/logs")
        if isinstance(data, str):
            return data
        if isinstance(data, dict) and "entries" in data:
            data = data["entries"]
        if isinstance(data, list):
            return "".join(e.get("m", "") if isinstance(e, dict) else str(e) for e in data)
        return json.dumps(data)

    def safesage_stats(self) -> dict:
        r = requests.get(self.url + "/safesage/stats", timeout=30)
        assert r.status_code == 200, "/safesage/stats answered %s: %s" % (r.status_code, r.text[:2000])
        return r.json()

    # ------------------------------------------------------------------ models
    def make_model(self, kind: str, name: str, seed: int = 0) -> dict:
        """Write a tiny random model into <base>/models/diffusion_models/<name>; returns the
        generator's JSON description (see tiny_models.py)."""
        out = self.models_dir / name
        env = dict(os.environ, COMFYUI_PATH=str(comfy_root()))
        env.pop("PYTHONPATH", None)
        r = subprocess.run([server_python(), str(HERE / "tiny_models.py"), kind, str(out),
                            "--seed", str(seed)],
                           cwd=str(self.base), env=env, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError("tiny_models.py %s failed:\n%s\n%s" % (kind, r.stdout, r.stderr[-4000:]))
        return json.loads(r.stdout.strip().splitlines()[-1])


@contextmanager
def running_pack_server(base: Path, name: str = "comfy", extra_args: tuple = ()):
    """A started server with this pack and the test nodes in its custom_nodes; stopped on exit."""
    server = ComfyServer(base, {PACK_DIR_NAME: REPO, TEST_NODES_DIR_NAME: HERE / "test_nodes"}, name=name,
                         extra_args=extra_args)
    try:
        server.start()
        yield server
    finally:
        server.stop()


def execution_error(entry: dict) -> dict | None:
    for kind, data in entry.get("status", {}).get("messages", []):
        if kind == "execution_error":
            return data
    return None
