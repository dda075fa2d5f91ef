"""SafeSage into raylight's Ray workers (safe_ops/multigpu/raylight.py, worker.py), without Ray.

* raylight's patch-node protocol, with fake actors: ``model_function_runner.remote(fn, *args)`` on
  every worker, ``self.model = fn(self.model, *args)``; reports through ``..._get_values``.
* a stand-in worker process (tests/unit/raylight_worker_child.py) with ComfyUI on its path and the
  pack *not* importable by name, which loads worker.py by path as raylight's by-value pickle delivers
  it, and applies SafeSage to a real ModelPatcher of a tiny MiniMax H3. Needs a ComfyUI tree with H3
  (COMFYUI_PATH; `bash .ci/run` sets it), else that test skips with the reason printed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

from safe_ops.multigpu import raylight, worker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Remote:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class FakeActor:
    """raylight's RayWorker's two runners (distributed_worker/ray_worker.py)."""
    def __init__(self, model):
        self.model = model
        self.sent = []

        def runner(fn, *args, **kwargs):
            self.sent.append((fn, args))
            self.model = fn(self.model, *args, **kwargs)

        self.model_function_runner = _Remote(runner)
        self.model_function_runner_get_values = _Remote(lambda fn, *a, **k: fn(self.model, *a, **k))


def test_apply_to_workers_sends_the_worker_entry_to_every_actor(monkeypatch):
    by_value = []
    ray = types.SimpleNamespace(get=lambda futures: futures,
                                cloudpickle=types.SimpleNamespace(register_pickle_by_value=by_value.append))
    monkeypatch.setitem(sys.modules, "ray", ray)
    seen = []
    monkeypatch.setattr(worker, "apply_in_worker", lambda model, pack, settings: seen.append((model, pack, settings))
                        or ("patched", model))
    monkeypatch.setattr(worker, "report", lambda model: {"hook": False, "text": f"model {model}"})
    actors = [FakeActor("m0"), FakeActor("m1")]
    reports = raylight.apply_to_workers({"workers": actors}, {"kernel": "auto"})
    assert [a.model for a in actors] == [("patched", "m0"), ("patched", "m1")]
    assert seen == [("m0", raylight.PACK_DIR, {"kernel": "auto"}), ("m1", raylight.PACK_DIR, {"kernel": "auto"})]
    assert os.path.isfile(os.path.join(raylight.PACK_DIR, "safe_ops", "multigpu", "worker.py"))
    assert worker in by_value                  # a worker cannot import the pack by name
    assert len(reports) == 2 and "no yunchang" in raylight.status_text(reports)
    with pytest.raises(ValueError, match="RAY_ACTORS"):
        raylight.apply_to_workers({"nothing": []}, {})


def test_a_worker_without_the_pack_on_its_path_applies_safesage_to_its_h3():
    comfy = os.environ.get("COMFYUI_PATH", "")
    if not os.path.isfile(os.path.join(comfy, "comfy", "ldm", "minimax", "model.py")):
        why = "COMFYUI_PATH is not a ComfyUI tree with MiniMax H3 (bash .ci/run sets it on the tree passes)"
        print(f"\n[test_multigpu_worker] skipped: {why}")
        pytest.skip(why)
    env = dict(os.environ)
    env["PYTHONPATH"] = comfy                  # raylight's workers: ComfyUI's root, not the custom nodes
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "unit", "raylight_worker_child.py"), ROOT],
                       cwd=comfy, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["pack_importable_by_name"] is False
    assert r["same_model"] is False                                # a clone, as the node makes
    assert any(k.endswith(".forward") and "mlp" in k for k in r["object_patches"]), r["object_patches"]
    assert r["input_object_patches"] == []                         # the worker's input left clean
    assert r["bad_settings_same_model"] is True                    # refused: the model goes on as it came
    assert r["report"]["hook"] is False                            # no yunchang in this worker
    assert "could not be applied" in r["report"]["text"]           # the last apply's (bad settings) status
    assert "calls" in r["multigpu_counters"]
