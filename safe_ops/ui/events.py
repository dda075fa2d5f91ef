"""Events to ComfyUI's frontend over its websocket (``PromptServer.instance.send_sync``).

ComfyUI is never imported here: the server is looked up when an event is sent, in
``sys.modules["server"]`` (ComfyUI's main.py has imported it; a unit test or a script has not,
and then nothing is sent). The event goes to the client that queued the running prompt
(``PromptServer.instance.client_id``; every client when none is known), as ComfyUI sends a
node's output. The data is made plain JSON first (finite numbers, string keys): ComfyUI's
publishing loop serialises it later, on the server's event loop, where an error would stop every
message to the frontend. An error of ComfyUI's sending is logged once and the prompt goes on.
"""
from __future__ import annotations

import logging
import math
import sys
from typing import Any

from . import run_stats

QUALITY = "safesage.quality"        # the quality guard's outcome at a sampling run's end (web/safesage.js)


def server() -> Any:
    """ComfyUI's running PromptServer, or None (no ComfyUI server in this process)."""
    ps = getattr(getattr(sys.modules.get("server"), "PromptServer", None), "instance", None)
    return ps if callable(getattr(ps, "send_sync", None)) else None


def plain(value: Any) -> Any:
    """``value`` as plain JSON data: dicts (string keys), lists, strings, bools, ints, finite floats
    (NaN and infinities become None); anything else its ``str``."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return str(value)


def send(event: str, data: Any) -> bool:
    """Send ``event`` with ``data`` to the frontend; True when handed to the server. False when
    there is no server, or ComfyUI's ``send_sync`` raised (logged once per event: not SafeSage's
    error, the prompt goes on). An error of this module's own code reaches the caller, whose
    containment boundary counts it (patch.py's sampling-run wrapper)."""
    ps = server()
    if ps is None:
        return False
    sid = getattr(ps, "client_id", None)
    sid = sid if isinstance(sid, str) and sid else None
    payload = plain(data)
    try:
        ps.send_sync(event, payload, sid)
        return True
    except Exception as e:  # noqa: BLE001 - the frontend's extra line never fails a prompt
        run_stats.once(("event-send", event), logging.WARNING,
                       "SafeSage: could not send %s to the frontend (%s: %s); the run is not affected, "
                       "its outcome is in /safesage/stats", event, type(e).__name__, e)
        return False
