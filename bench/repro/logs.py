"""What a row's server log says: its tail, the error line, the key start-up / failure lines, and
the Python stack that faulthandler printed for the thread that aborted (ComfyUI's main.py enables
faulthandler)."""
from __future__ import annotations

import re
import signal


def sig_name(rc):
    try:
        return signal.Signals(-rc).name
    except Exception:
        return str(rc)


def tail(path, n=25):
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []
    return [ln[:400] for ln in lines[-n:]]


def error_line(lines):
    """The exception line of the last traceback, else the last ERR] / non-empty line."""
    for ln in reversed(lines):
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Abort\w*)\b", ln.strip()):
            return ln.strip()
    for ln in reversed(lines):
        if ln.startswith("ERR]") and ln[4:].strip():
            return ln.strip()
    for ln in reversed(lines):
        if ln.strip():
            return ln.strip()
    return None


# "ERR]": the level prefix of the in-process worker's logs (committed runs); a ComfyUI server logs
# its errors after "!!! Exception during processing !!!"
KEY_LINES = ("ERR]", "!!! Exception during processing", "Error running sage attention", "Got an OOM",
             "terminate called", "what():", "Exception raised from", "Fatal Python error",
             "Found quantization metadata", "Detected mixed precision", "DynamicVRAM support", "Device: cuda",
             "model weight dtype", "prepared for dynamic VRAM", "loaded partially", "loaded completely",
             "Using sage attention", "Using pytorch attention", "aimdo", "Staged", "offloaded")


def log_excerpt(path):
    """Key lines of a row's server log: loader/VRAM lines, errors, and the aborting thread's innermost frames."""
    try:
        with open(path, "r", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    keys = [ln[:300] for ln in lines if any(k in ln for k in KEY_LINES) and "Found comfy_kitchen backend" not in ln]
    frames = []
    for i, ln in enumerate(lines):
        if ln.startswith("Current thread"):
            frames = [x.strip()[:300] for x in lines[i + 1:i + 9] if x.strip().startswith("File")]
    return {"key_lines": keys, "python_stack_at_abort": frames}


def grep_count(path, words):
    n = 0
    try:
        with open(path, "r", errors="replace") as f:
            for ln in f:
                low = ln.lower()
                if any(w in low for w in words):
                    n += 1
    except OSError:
        pass
    return n
