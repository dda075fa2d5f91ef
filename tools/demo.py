"""Run the SafeSage demo from a git checkout, on any machine: python3 tools/demo.py [demo args]

Uses this Python if it has torch; otherwise prepares a private venv with torch under
~/.cache/safesage/demo-venv (one time; your own environments are never touched) and runs
`python -m safe_ops.demo` there. Development helper: tools/ is left out of the registry archive
(.comfyignore), so the shipped pack carries no process-spawning or environment-reading code.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_PIN = "torch==2.13.0"     # the CPU build where the index has one; any torch otherwise


def demo_python() -> str:
    """This Python if it has torch, else the private venv's (built on first use)."""
    if importlib.util.find_spec("torch") is not None:
        return sys.executable
    venv = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                        "safesage", "demo-venv")
    py = os.path.join(venv, "bin", "python")
    print(f"SafeSage demo: this Python has no torch; preparing {venv} (one time) ...", file=sys.stderr)
    try:
        if not os.path.exists(py):
            subprocess.check_call([sys.executable, "-m", "venv", venv])
        if subprocess.call([py, "-c", "import torch"], stderr=subprocess.DEVNULL) != 0:
            if subprocess.call([py, "-m", "pip", "install", "-q", TORCH_PIN]) != 0:
                subprocess.check_call([py, "-m", "pip", "install", "-q", "torch"])
    except (OSError, subprocess.CalledProcessError) as e:
        sys.exit(f"SafeSage demo needs PyTorch and could not install it ({e}). Run it with ComfyUI's "
                 "Python, which ships torch: <ComfyUI python> -m safe_ops.demo")
    return py


def main(argv: list[str]) -> int:
    return subprocess.call([demo_python(), "-m", "safe_ops.demo", *argv], cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
