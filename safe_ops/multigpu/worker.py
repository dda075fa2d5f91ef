"""What runs inside a raylight Ray worker: SafeSage on the worker's model and its xFuser attention.

A raylight worker is a Ray actor process that loads ComfyUI's code but no custom nodes, so it cannot
import this pack by the name ComfyUI gave it ("ComfyUI-SafeSage" is not even an identifier).
raylight.py therefore registers this module with Ray's cloudpickle to be pickled *by value*: it
imports only the standard library at its top, and :func:`load_safe_ops` loads the pack's
``safe_ops`` in the worker from the pack's folder by path, as the package ``safe_ops`` (how the tests
import it), without touching ``sys.path``.

:func:`apply_in_worker` is what raylight's ``model_function_runner`` calls with the worker's model
(``self.model = fn(self.model, *args)``, the way raylight's own patch nodes reach the workers):

* installs the hook at yunchang's kernel selection (xfuser_hook.install) in the worker's process,
  which is where xFuser's attention picks sage for each rank;
* applies the SafeSage Attention node's patch (patch.apply_node, its settings): a clone with the H3
  MLP patch and the block index, which raylight leaves alone (it replaces each block's attention
  forward, not ``DiTBlock.forward``). Its attention override stays on the clone but raylight's xFuser
  attention does not call ComfyUI's attention, so the hook is what guards sage there.

Nothing here raises into raylight: a failure logs its traceback and hands the worker's model back
as it came (the worker's status, :func:`report`, says so).
"""
from __future__ import annotations

import importlib.util
import logging
import os
import sys

PACKAGE = "safe_ops"


def _status(so) -> dict:
    """This process's worker status, kept in the loaded package (this module's globals are a copy
    per pickled call: it is pickled by value)."""
    from safe_ops import multigpu       # the package load_safe_ops put in sys.modules
    return multigpu.WORKER_STATUS


def load_safe_ops(pack_dir: str):
    """The pack's ``safe_ops`` in this process: already loaded, else from ``pack_dir`` by path."""
    mod = sys.modules.get(PACKAGE)
    if mod is not None:
        return mod
    init = os.path.join(pack_dir, PACKAGE, "__init__.py")
    spec = importlib.util.spec_from_file_location(PACKAGE, init,
                                                  submodule_search_locations=[os.path.dirname(init)])
    if spec is None or spec.loader is None:
        raise ImportError(f"SafeSage: no {init} to load in this worker")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(PACKAGE, None)
        raise
    return mod


def apply_in_worker(model, pack_dir: str, settings: dict):
    """``model`` with SafeSage applied (module docstring); ``model`` itself where that failed."""
    log = logging.getLogger("SafeSage")
    status: dict = {}
    try:
        so = load_safe_ops(pack_dir)
        status = _status(so)
        status.clear()
        from safe_ops import patch
        from safe_ops.multigpu import xfuser_hook
        status["hook"] = bool(xfuser_hook.install())
        applied = patch.apply_node(model, **settings)
        status.update(patched=bool(applied.patched), text=applied.text)
        log.info("SafeSage in this raylight worker: hook at yunchang's kernel selection %s; %s",
                 "installed" if status["hook"] else "not installed (no yunchang here)", applied.text)
        return applied.model
    except Exception as e:  # noqa: BLE001 - never fail raylight's worker: its model goes on unpatched
        status.update(patched=False, text=f"SafeSage could not be applied in this worker: {type(e).__name__}: {e}")
        log.error("SafeSage: could not be applied in this raylight worker; its model runs unpatched",
                  exc_info=True)
        return model


def report(model) -> dict:
    """This worker's SafeSage status (raylight's ``model_function_runner_get_values``): what
    :func:`apply_in_worker` did, and the sequence-parallel guard's counters."""
    so = sys.modules.get(PACKAGE)
    out: dict = {}
    if so is not None:
        try:
            out.update(_status(so))
            from safe_ops.multigpu import rank_kernel
            out["multigpu"] = rank_kernel.SECTION.as_dict()
        except Exception as e:  # noqa: BLE001
            out["multigpu"] = f"unavailable: {type(e).__name__}: {e}"
    return out
