"""SafeSage into raylight's Ray workers, the way raylight's own patch nodes reach them.

raylight's patch nodes (``ray_patch`` in ``comfy_extra_dist/ray_patch_decorator.py``) send a callable
to every actor of ``ray_actors["workers"]`` with ``actor.model_function_runner.remote(fn, *args)``;
the worker runs ``self.model = fn(self.model, *args)``. :func:`apply_to_workers` sends
worker.apply_in_worker that way, with the pack's folder and the node's settings, and waits for every
worker; :func:`worker_reports` asks each worker for its status through
``model_function_runner_get_values``. ``ray`` is looked up when called (never imported here at
import time); worker.py is registered with Ray's cloudpickle to be pickled by value, since a worker
cannot import the pack by its name.
"""
from __future__ import annotations

import os
from typing import Any

from . import worker

PACK_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ray():
    import ray
    by_value = getattr(getattr(ray, "cloudpickle", None), "register_pickle_by_value", None)
    if by_value is not None:
        by_value(worker)
    return ray


def workers(ray_actors: Any) -> list:
    """raylight's actors: ``ray_actors["workers"]`` (its RAY_ACTORS value)."""
    try:
        found = list(ray_actors["workers"])
    except (TypeError, KeyError) as e:
        raise ValueError("SafeSage: this is not raylight's RAY_ACTORS value (no 'workers')") from e
    if not found:
        raise ValueError("SafeSage: raylight's RAY_ACTORS has no workers")
    return found


def apply_to_workers(ray_actors: Any, settings: dict, pack_dir: str = PACK_DIR) -> list[dict]:
    """Apply SafeSage (worker.apply_in_worker) in every raylight worker; each worker's report."""
    ray = _ray()
    actors = workers(ray_actors)
    ray.get([a.model_function_runner.remote(worker.apply_in_worker, pack_dir, dict(settings)) for a in actors])
    return worker_reports(ray_actors)


def worker_reports(ray_actors: Any) -> list[dict]:
    ray = _ray()
    return ray.get([a.model_function_runner_get_values.remote(worker.report) for a in workers(ray_actors)])


def status_text(reports: list[dict]) -> str:
    """One line per worker, for the node."""
    lines = []
    for i, r in enumerate(reports):
        hook = {True: "xFuser/yunchang sage guarded", False: "no yunchang in the worker: nothing to guard"}
        lines.append(f"worker {i}: {hook.get(r.get('hook'), 'hook not installed')}; "
                     + (r.get("text") or "not applied").splitlines()[0])
    return "\n".join(lines)
