"""HTTP routes of the pack, added to ComfyUI's server when there is one.

GET /safesage/stats -> safe_ops.ui.run_stats.snapshot() as JSON (process-wide counters: attention
calls per plan kind, fallbacks with reasons, MLP patches and calls). 503 with
{"error": ...} when safe_ops could not be imported, 500 when the snapshot itself fails.

POST /safesage/quality/forget -> forgets every error the quality guard remembered per model
(safe_ops/quality/memory.py): the next prompt measures its blocks again at step 1. {"forgotten": N}.
"""
from __future__ import annotations

import json
import logging
import sys

from . import _backend

log = logging.getLogger("SafeSage")

STATS_PATH = "/safesage/stats"
FORGET_PATH = "/safesage/quality/forget"
_registered = False


def _dumps(obj) -> str:
    # Counters may hold tuples, enums or dataclasses: never fail the endpoint on a stray type.
    return json.dumps(obj, default=str)


async def stats_handler(request):
    from aiohttp import web

    try:
        _, _, report = _backend.require()
    except _backend.SafeSageUnavailable as e:
        return web.json_response({"error": str(e)}, status=503, dumps=_dumps)
    try:
        return web.json_response(report.snapshot(), dumps=_dumps)
    except Exception as e:
        log.exception("SafeSage: %s failed", STATS_PATH)
        return web.json_response({"error": f"{type(e).__name__}: {e}"}, status=500, dumps=_dumps)


async def forget_handler(request):
    from aiohttp import web

    try:
        _backend.require()
        from ..safe_ops.quality import memory
        n = memory.forget()
    except _backend.SafeSageUnavailable as e:
        return web.json_response({"error": str(e)}, status=503, dumps=_dumps)
    except Exception as e:
        log.exception("SafeSage: %s failed", FORGET_PATH)
        return web.json_response({"error": f"{type(e).__name__}: {e}"}, status=500, dumps=_dumps)
    log.info("SafeSage: forgot %d remembered quality measurement(s) (%s)", n, FORGET_PATH)
    return web.json_response({"forgotten": n}, dumps=_dumps)


def register() -> bool:
    """Add the routes to the running PromptServer. False (and nothing done) when there is none,
    e.g. when the pack is imported by a script or a test rather than by a ComfyUI server."""
    global _registered
    if _registered:
        return True
    # the server ComfyUI's main.py imported before loading custom nodes (as ui/events.py reads it): never
    # imported here, where a script or test importing the pack would start ComfyUI's device set-up
    ps = getattr(getattr(sys.modules.get("server"), "PromptServer", None), "instance", None)
    routes = getattr(ps, "routes", None)
    if routes is None:
        log.debug("SafeSage: no ComfyUI server instance; %s not registered", STATS_PATH)
        return False
    routes.get(STATS_PATH)(stats_handler)
    routes.post(FORGET_PATH)(forget_handler)
    _registered = True
    return True
