"""The command line a bench records in its JSON (no torch: a bench may import this before torch)."""
from __future__ import annotations

import shlex
import sys


def command(module: str) -> str:
    """``python3 -m bench.<module> ARGS``: how this bench was run (from the repository root)."""
    return "python3 -m bench.%s %s" % (module, shlex.join(sys.argv[1:]))
