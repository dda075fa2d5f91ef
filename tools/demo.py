"""Run the SafeSage demo from a git checkout, on any machine: python3 tools/demo.py [demo args]

Uses this Python if it has torch; otherwise prepares a private venv with torch under
~/.cache/safesage/demo-venv (one time; your own environments are never touched) and runs
`python -m safe_ops.demo` there. Before installing it says what it installs and from where: torch
TORCH_PIN, the CPU build, from PyTorch's CPU wheel index (about 200 MB to download, 0.9 GB installed;
the default PyPI index would bring the multi-GB CUDA build). SAFESAGE_TORCH_PIP_ARGS, when set, replaces
the index arguments (e.g. `--index-url https://mirror/simple`, `--find-links /dir/with/wheels`, or a
wheel file); set empty, pip's own configuration decides. Development helper: tools/ is left out of the
registry archive (.comfyignore), so the shipped pack carries no process-spawning or environment-reading
code.
"""
from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_PIN = "torch==2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PIP_ARGS_ENV = "SAFESAGE_TORCH_PIP_ARGS"
# measured on Linux x86_64, Python 3.11: the torch-2.13.0+cpu wheel is 183 MiB, its dependencies
# (sympy, networkx, jinja2, ...) about 15 MB more; the venv with them is 895 MB
SIZE = "about 200 MB to download, about 0.9 GB installed"


def torch_source(environ=os.environ) -> tuple[list[str], str]:
    """(pip arguments saying where torch comes from, those words for the user)."""
    if PIP_ARGS_ENV in environ:
        args = shlex.split(environ[PIP_ARGS_ENV])
        return args, ("%s=%r" % (PIP_ARGS_ENV, environ[PIP_ARGS_ENV]) if args
                      else "pip's own configuration (%s is set empty)" % PIP_ARGS_ENV)
    return ["--index-url", CPU_INDEX], "PyTorch's CPU wheel index, %s" % CPU_INDEX


def install_command(py: str, environ=os.environ) -> list[str]:
    return [py, "-m", "pip", "install", "-q", *torch_source(environ)[0], TORCH_PIN]


def announce(venv: str, environ=os.environ) -> str:
    """What the demo says before it installs anything."""
    args, where = torch_source(environ)
    what = ("%s, the CPU build (%s)" % (TORCH_PIN, SIZE) if PIP_ARGS_ENV not in environ else
            "%s (the CPU build is %s; these arguments may select another build)" % (TORCH_PIN, SIZE))
    return ("SafeSage demo: this Python has no torch, so the demo prepares its own venv (one time; your own\n"
            "environments are not touched):\n"
            "  venv:  %s\n"
            "  torch: %s\n"
            "  from:  %s\n"
            "  runs:  %s\n"
            "To take torch from elsewhere, set %s to pip arguments (an --index-url, a --find-links folder or a\n"
            "wheel file; empty: pip's own configuration), or run the demo with ComfyUI's Python, which has torch:\n"
            "  <ComfyUI python> -m safe_ops.demo"
            % (venv, what, where, shlex.join(["pip", "install", *args, TORCH_PIN]), PIP_ARGS_ENV))


def demo_python(environ=os.environ) -> str:
    """This Python if it has torch, else the private venv's (built on first use)."""
    if importlib.util.find_spec("torch") is not None:
        return sys.executable
    venv = os.path.join(environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "safesage", "demo-venv")
    py = os.path.join(venv, "bin", "python")
    if os.path.exists(py) and subprocess.call([py, "-c", "import torch"], stderr=subprocess.DEVNULL) == 0:
        return py
    print(announce(venv, environ), file=sys.stderr, flush=True)
    cmd = install_command(py, environ)
    try:
        if not os.path.exists(py):
            subprocess.check_call([sys.executable, "-m", "venv", venv])
        subprocess.check_call(cmd)
    except (OSError, subprocess.CalledProcessError) as e:
        # no fallback to an unpinned `pip install torch`: from PyPI that is the multi-GB CUDA build
        sys.exit("SafeSage demo could not install %s (%s). Set %s to pip arguments that reach a torch wheel, or "
                 "run it with ComfyUI's Python, which has torch: <ComfyUI python> -m safe_ops.demo"
                 % (TORCH_PIN, e, PIP_ARGS_ENV))
    print("SafeSage demo: torch installed in %s" % venv, file=sys.stderr, flush=True)
    return py


def main(argv: list[str]) -> int:
    return subprocess.call([demo_python(), "-m", "safe_ops.demo", *argv], cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
