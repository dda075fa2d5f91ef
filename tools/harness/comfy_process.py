"""Start and stop one real ComfyUI server process (its own main.py) and talk to it over HTTP.

Shared by the headless tests (comfy_server.py, which fixes the test settings: $COMFYUI_PATH,
--cpu, no PYTHONPATH) and by the GPU reproduction harness (bench/repro/worker.py, which passes the
arm's flags and environment). Nothing here knows about SafeSage.

The server runs `main.py` in the given ComfyUI tree on 127.0.0.1 with a free port, a temporary
--base-directory whose custom_nodes/ holds the given node packs (symlinked), an in-memory
database, and an empty frontend folder when no frontend package is installed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

try:
    import requests
except ImportError:  # callers report it (comfy_server.comfy_path_problem)
    requests = None

START_TIMEOUT_S = float(os.environ.get("SAFESAGE_COMFY_START_TIMEOUT", "180"))


class ServerDied(RuntimeError):
    """The server process ended while a prompt was running; ``returncode`` is its exit status
    (negative: the signal that ended it)."""

    def __init__(self, msg: str, returncode):
        super().__init__(msg)
        self.returncode = returncode


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def execution_error(entry: dict) -> dict | None:
    """The execution_error message of a /history entry, or None."""
    for kind, data in entry.get("status", {}).get("messages", []):
        if kind == "execution_error":
            return data
    return None


class ComfyProcess:
    """One ComfyUI server process.

    root: the ComfyUI tree (main.py's folder); python: the interpreter that runs it;
    flags: more ComfyUI flags (e.g. --cpu, --use-sage-attention); env: variables set for the
    server on top of this process's; keep_pythonpath: pass PYTHONPATH on (else the server imports
    from its own tree only); own_group: start it in a process group of its own, so that stop()
    ends whatever it started too.
    """

    def __init__(self, base: Path, custom_nodes: dict, *, root: Path, python: str | None = None,
                 flags: tuple = (), env: dict | None = None, name: str = "comfy",
                 keep_pythonpath: bool = False, own_group: bool = False):
        self.base = Path(base)
        self.root = Path(root)
        self.python = python or sys.executable
        self.flags = list(flags)
        self.env = dict(env or {})
        self.name = name
        self.keep_pythonpath = keep_pythonpath
        self.own_group = own_group
        self.proc: subprocess.Popen | None = None
        self.startup_logs: str | None = None
        self.returncode = None          # exit status once the process has ended
        self.cmdline: list[str] = []    # the command it was started with
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
    def command(self, port: int) -> list[str]:
        cmd = [self.python, "main.py", "--listen", "127.0.0.1", "--port", str(port),
               "--disable-auto-launch", "--base-directory", str(self.base),
               "--database-url", "sqlite:///:memory:", "--disable-api-nodes"] + self.flags
        if not self._frontend_installed():
            cmd += ["--front-end-root", str(self.frontend_root)]
        return cmd

    def _frontend_installed(self) -> bool:
        r = subprocess.run([self.python, "-c", "import comfyui_frontend_package"],
                           capture_output=True, env=self._env())
        return r.returncode == 0

    def _env(self) -> dict:
        env = dict(os.environ)
        if not self.keep_pythonpath:
            env.pop("PYTHONPATH", None)
        env["PYTHONUNBUFFERED"] = "1"
        env.update(self.env)
        return env

    def start(self, attempts: int = 3):
        last = ""
        for _ in range(attempts):
            port = free_port()
            self.returncode = None
            self.cmdline = self.command(port)
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(self.cmdline, cwd=str(self.root), env=self._env(),
                                             stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL,
                                             start_new_session=self.own_group)
            self.port = port
            self.url = "http://127.0.0.1:%d" % port
            if self._wait_ready():
                self.startup_logs = self._logs_or_none()
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

    def ended(self):
        """The exit status if the process has ended on its own, else None."""
        if self.proc is not None and self.proc.poll() is not None:
            self.returncode = self.proc.returncode
        return self.returncode

    def stop(self, kill: bool = False) -> None:
        """SIGTERM (SIGKILL with ``kill`` or after 20 s); to the whole group when it has its own."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self._signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait(timeout=20)
        elif self.returncode is None:
            self.returncode = self.proc.returncode
        self.proc = None

    def _signal(self, sig) -> None:
        if self.own_group:
            try:
                os.killpg(self.proc.pid, sig)
                return
            except ProcessLookupError:
                return
        self.proc.send_signal(sig)

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

    def post_json(self, path: str, body: dict | None = None, timeout: float = 30) -> None:
        """POST a JSON body to one of ComfyUI's routes (e.g. /interrupt; /free)."""
        requests.post(self.url + path, json=body or {}, timeout=timeout).raise_for_status()

    def free(self) -> None:
        """ComfyUI's POST /free: unload every model and drop the executor's caches. The prompt worker
        takes the flags within its 1 s poll; this waits long enough for that."""
        self.post_json("/free", {"unload_models": True, "free_memory": True})
        time.sleep(3.0)

    def object_info(self, node: str = "") -> dict:
        return self.get_json("/object_info" + ("/" + node if node else ""), timeout=60)

    def post_prompt(self, graph: dict):
        """Queue an API-format graph. Returns the prompt_id (str) when ComfyUI accepts it, or the
        JSON body (dict with `error` and `node_errors`) when it answers 400."""
        r = requests.post(self.url + "/prompt",
                          json={"prompt": graph, "client_id": self.client_id}, timeout=60)
        if r.status_code == 400:
            return r.json()
        r.raise_for_status()
        return r.json()["prompt_id"]

    def queue_and_wait(self, graph: dict, timeout: float = 300) -> dict:
        """Queue a graph and return its /history entry, success or error (RuntimeError when
        ComfyUI rejects the prompt)."""
        pid = self.post_prompt(graph)
        if not isinstance(pid, str):
            raise RuntimeError("prompt rejected: %s" % json.dumps(pid, indent=1)[:3000])
        return self.wait_history(pid, timeout)

    def wait_history(self, prompt_id: str, timeout: float = 300) -> dict:
        """The /history entry of a finished prompt (success or error). Raises ServerDied when the
        process ends first, TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                entry = self.get_json("/history/%s" % prompt_id).get(prompt_id)
            except requests.RequestException:
                entry = None   # a dying server refuses connections before it is reaped
            if entry and entry.get("status", {}).get("completed") is not None and (
                    entry["status"].get("status_str") in ("success", "error")):
                return entry
            if self.proc is not None and self.proc.poll() is not None:
                self.returncode = self.proc.returncode
                raise ServerDied("ComfyUI server died while running %s; log tail:\n%s"
                                 % (prompt_id, self.log_tail()), self.proc.returncode)
            time.sleep(0.1)
        raise TimeoutError("prompt %s did not finish in %ss; log tail:\n%s"
                           % (prompt_id, timeout, self.log_tail()))

    def _logs_or_none(self):
        try:
            return self.logs()
        except (requests.RequestException, ValueError):
            return None

    def start_logs(self) -> str:
        """ComfyUI's own log buffer as it stood when the server became ready. The buffer keeps only
        its last 300 writes (app/logger.py's capacity), so on a session server that has run prompts
        the start-up lines (the import-time summary, the attention function) have rolled out of
        logs(); read them here."""
        if self.startup_logs is None:
            raise RuntimeError("the server's log buffer could not be read when it became ready")
        return self.startup_logs

    def logs(self) -> str:
        """ComfyUI's own log buffer (GET /internal/logs) as one string: its last 300 writes."""
        data = self.get_json("/internal/logs")
        if isinstance(data, str):
            return data
        if isinstance(data, dict) and "entries" in data:
            data = data["entries"]
        if isinstance(data, list):
            return "".join(e.get("m", "") if isinstance(e, dict) else str(e) for e in data)
        return json.dumps(data)
