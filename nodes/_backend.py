"""The one place where the node layer imports safe_ops.

A broken install (a missing or half-updated safe_ops, a torch that does not import) must
never be silent and must never take ComfyUI down. So the import is attempted once, when
ComfyUI loads the pack: on failure the full traceback is logged as an IMPORT error right
away, the node is still registered, and running it raises SafeSageUnavailable with the
original error chained and a line that says what to do.
"""
from __future__ import annotations

import logging
import traceback

log = logging.getLogger("SafeSage")

FIX_HINT = (
    "Reinstall or update the ComfyUI-SafeSage pack (ComfyUI-Manager: 'Try fix' / 'Update', "
    "or `git pull` inside custom_nodes/ComfyUI-SafeSage) and restart ComfyUI; if it persists, "
    "report the IMPORT error from the start-up log."
)


class SafeSageUnavailable(RuntimeError):
    """safe_ops could not be imported; the message says why and what to do."""


_IMPORT_ERROR: BaseException | None = None
_IMPORT_TRACEBACK = ""

try:
    from ..safe_ops.ui import run_stats as report
    from ..safe_ops.patch import apply_node
except Exception as e:  # noqa: BLE001 - any failure must be reported, not raised at load
    _IMPORT_ERROR = e
    _IMPORT_TRACEBACK = traceback.format_exc()
    apply_node = report = None  # type: ignore[assignment]
    log.error(
        "SafeSage: IMPORT FAILED for its safe_ops core (%s: %s). The SafeSageAttention node "
        "is listed but will refuse to run. %s\n%s",
        type(e).__name__, e, FIX_HINT, _IMPORT_TRACEBACK,
    )


def require():
    """Return (apply_node, report) or raise SafeSageUnavailable."""
    if _IMPORT_ERROR is not None:
        raise SafeSageUnavailable(
            f"SafeSage could not load its safe_ops core: {type(_IMPORT_ERROR).__name__}: "
            f"{_IMPORT_ERROR}. {FIX_HINT}"
        ) from _IMPORT_ERROR
    return apply_node, report


def preflight(width: int, height: int, length: int, ref_images: int, text_tokens: int, model=None) -> dict:
    """The SafeSage Preflight node: safe_ops.ui.preflight_text.preflight_report with the connected model's
    SafeSage settings (if any) and a note when the model is not MiniMax H3."""
    require()
    from ..safe_ops.ui.preflight_text import preflight_report
    from ..safe_ops.ui.status import model_context
    policy, note = model_context(model)
    return preflight_report(width, height, length, ref_images, text_tokens, policy=policy, model_note=note)


def raylight_workers(ray_actors, settings: dict) -> str:
    """The SafeSage Attention (raylight workers) node: the settings validated here (an invalid input
    raises, as on the one-GPU node), then SafeSage applied in every raylight worker
    (safe_ops.multigpu.raylight); the workers' status lines."""
    require()
    from ..safe_ops.multigpu import raylight
    from ..safe_ops.policy import Policy
    Policy(**settings)
    return raylight.status_text(raylight.apply_to_workers(ray_actors, settings))
