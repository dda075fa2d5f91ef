"""Version strings of installed packages as comparable tuples (one rule for every package)."""
from __future__ import annotations

import re

_LEADING = re.compile(r"^\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?")


def version_tuple(version: str | None) -> tuple[int, ...]:
    """The leading ``major[.minor[.patch]]`` numbers of ``version``; () when it has none.

    Anything after them is ignored: "2.2.0.post3+cu128torch2.8.0" -> (2, 2, 0),
    "0.2.40rc1" -> (0, 2, 40), "v1.0.6" -> (1, 0, 6), "garbage" -> ()."""
    m = _LEADING.match(version or "")
    if not m:
        return ()
    return tuple(int(x) for x in m.groups() if x is not None)
