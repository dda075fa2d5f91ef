"""The command line a bench records in its JSON, and writing that JSON (no torch: a bench may import this
before torch)."""
from __future__ import annotations

import json
import os
import shlex
import sys


def command(module: str) -> str:
    """``python3 -m bench.<module> ARGS``: how this bench was run (from the repository root)."""
    return "python3 -m bench.%s %s" % (module, shlex.join(sys.argv[1:]))


def write_json(doc: dict, out: str | None, echo: bool = True) -> None:
    """A bench's JSON result: to ``out`` (its folder made), else (``echo``) to stdout."""
    text = json.dumps(doc, indent=1)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(text + "\n")
    elif echo:
        print(text)
