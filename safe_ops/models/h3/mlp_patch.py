"""Put SafeSage's chunked MLP forward on every MiniMax H3 MLP of a ModelPatcher (object patches).

Idempotent under fixed keys (``diffusion_model.<path>.forward``): SafeSage's own patch is
replaced, never wrapped; another pack's patch on a key is left in place and reported.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from ... import contain
from . import cast_memo
from ...ui import run_stats
from .dims import H3_MLP_CLASS, H3_MODEL_MODULE, find_h3_mlps, is_h3_model
from .mlp import MLP_STATS, MLPFacts, h3_mlp_forward
from .mlp_plan import parse_chunk_setting

log = logging.getLogger("SafeSage.mlp")


class H3ChunkedMLPForward:
    """Bound replacement for one MLP's ``forward`` (object-patched by key)."""

    _safesage_mlp = True

    def __init__(self, module: torch.nn.Module, path: str, chunk_setting: Any, stats: run_stats.Section = MLP_STATS):
        self.module = module
        self.path = path
        self.chunk_setting = parse_chunk_setting(chunk_setting)
        self.stats = stats
        self._facts: MLPFacts | None = None     # made at the first call, again when the module changed

    @contain.boundary
    def __call__(self, x, *args, **kwargs):
        try:                            # the containment boundary (contain.py)
            return self._forward(x, args, kwargs)
        except Exception as e:          # noqa: BLE001 - SafeSage's own error: ComfyUI's forward
            if contain.not_ours(e):
                raise
            contain.internal_error(e, f"the H3 MLP forward ({self.path})",
                                   "this call runs ComfyUI's unchunked MLP on the whole input", self.stats)
        # a chunk that raised left nothing behind: cast_once's exit released its casts
        return type(self.module).forward(self.module, x, *args, **kwargs)

    def _forward(self, x, args: tuple, kwargs: dict):
        if args or kwargs:   # not the H3 signature: never guess
            self.stats.fallback("unexpected MLP.forward arguments")
            return contain.run_comfy(type(self.module).forward, self.module, x, *args, **kwargs)
        if cast_memo.compiling():
            # traced: nothing cached is read or written (the facts are made for this trace)
            return h3_mlp_forward(self.module, x, self.chunk_setting, self.stats)
        facts = self._facts
        if facts is None or not facts.current(self.module, self.chunk_setting):
            facts = self._facts = MLPFacts(self.module, self.chunk_setting)
        return h3_mlp_forward(self.module, x, self.chunk_setting, self.stats, facts=facts)

    def __repr__(self):
        return f"H3ChunkedMLPForward({self.path}, chunk={self.chunk_setting!r})"


def _own_bound_forward(fn: Any, module: Any) -> bool:
    """ModelPatcher.unpatch_model restores a patched attribute by setting the backed-up value,
    which for ``forward`` is the module's own bound method: not a foreign patch."""
    return getattr(fn, "__self__", None) is module and \
        getattr(fn, "__func__", None) is getattr(type(module), "forward", None)


def _diffusion_model(model_patcher) -> Any:
    model = getattr(model_patcher, "model", None)
    return getattr(model, "diffusion_model", None)


def install_h3_mlp_patches(model_patcher, chunk_setting: Any = "auto") -> dict:
    """Object-patch every H3 MLP forward of ``model_patcher`` with the chunked forward, and wrap
    ComfyUI's cast once (cast_memo.install) so that each Linear is cast once per chunked call.

    Returns ``{"patched": n, "skipped": reason or None, "conflicts": [...], "removed": n,
    "cast_once": bool}``.
    Idempotent: our own patch on a key is replaced (new setting), never wrapped.  A
    foreign object patch on a key is left in place and listed in ``conflicts``.
    ``chunk_setting == "off"`` removes this module's patches (patched 0).
    """
    result = {"patched": 0, "skipped": None, "conflicts": [], "removed": 0, "cast_once": False}
    setting = parse_chunk_setting(chunk_setting)
    dm = _diffusion_model(model_patcher)
    if dm is None:
        result["skipped"] = "model patcher has no diffusion_model"
        return result
    mlps = find_h3_mlps(dm)
    if not mlps:
        t = type(dm)
        result["skipped"] = (f"not a MiniMax H3 model ({t.__module__}.{t.__qualname__})"
                             if not is_h3_model(dm) else "MiniMax H3 model without MLP modules")
        return result
    add = getattr(model_patcher, "add_object_patch", None)
    patches = getattr(model_patcher, "object_patches", None)
    if add is None or patches is None:
        result["skipped"] = "model patcher has no add_object_patch"
        return result

    # another pack replaced MLP.forward on the class: ours would silently bypass it
    cls_fwd = getattr(type(mlps[0][1]), "forward", None)
    if setting != "off" and (getattr(cls_fwd, "__module__", None) != H3_MODEL_MODULE
                             or getattr(cls_fwd, "__qualname__", None) != f"{H3_MLP_CLASS}.forward"):
        result["conflicts"].append({"key": f"{H3_MODEL_MODULE}.{H3_MLP_CLASS}.forward", "kind": "class_forward",
                                    "existing": repr(cls_fwd)[:200]})
        result["skipped"] = "MLP.forward replaced on the class by another pack"
        return result
    if setting != "off":
        result["cast_once"] = cast_memo.install()
        if not result["cast_once"]:
            log.warning("SafeSage MLP: this ComfyUI has no comfy.ops.cast_bias_weight/uncast_bias_weight: "
                        "H3 MLP chunks cast their weights once per chunk")

    for path, module in mlps:
        key = f"diffusion_model.{path}.forward"
        existing = patches.get(key)
        ours = existing is not None and getattr(existing, "_safesage_mlp", False)
        if setting == "off":
            if ours:
                del patches[key]
                result["removed"] += 1
            continue
        if existing is not None and not ours:
            result["conflicts"].append({"key": key, "kind": "object_patch",
                                        "existing": repr(existing)[:200]})
            continue
        inst = module.__dict__.get("forward")
        if inst is not None and not getattr(inst, "_safesage_mlp", False) and not _own_bound_forward(inst, module):
            result["conflicts"].append({"key": key, "kind": "instance_forward",
                                        "existing": repr(inst)[:200]})
            continue
        add(key, H3ChunkedMLPForward(module, path, setting))
        result["patched"] += 1

    if setting == "off":
        result["skipped"] = "MLP chunking off"
    # postcondition: read back what we set
    for path, _m in mlps:
        key = f"diffusion_model.{path}.forward"
        got = patches.get(key)
        if setting != "off" and not any(c["key"] == key for c in result["conflicts"]):
            if not getattr(got, "_safesage_mlp", False):
                raise RuntimeError(f"SafeSage: object patch {key} did not take")
    return result

