"""What the quality guard measured, remembered per model: a later prompt runs its choices from step 1.

Errors are remembered, not choices: every run decides again (targets.decide) with its own speed budget,
installed kernels and plans. An entry is keyed on

* the model being sampled: the base model (``ModelPatcher.model``, a weak reference: ComfyUI unloading
  it forgets it) and the sampling patcher's ``patches_uuid`` (patch.py's OUTER_SAMPLE wrapper reads the
  CFGGuider's patcher, so a LoRA added after the node gives another uuid: measured again). A new uuid
  for a base model forgets the old one's entries;
* the kernel builds (``Runtime.kernel_site`` of every installed family: another sageattention or
  comfy-kitchen build, or another GPU arch, measures again);
* the block and the class of call (another resolution or length is another class: measured).

:func:`forget` forgets everything (the stats panel's button, ``POST /safesage/quality/forget``).
Plain dictionaries under one lock; host floats only.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

#: entries per (model, uuid): blocks x classes of call; a bound, not a tuning knob
MAX_ENTRIES = 4096

_LOCK = threading.Lock()
# base model -> (patches_uuid, {(site, block, klass): {family: error or None, ...}, "planned": ...})
_MEM: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class ModelKey:
    """The model a sampling run samples: its base model (weakly) and the patcher's patches_uuid."""
    model: "weakref.ref"
    uuid: Any

    def base(self):
        return self.model()


def model_key(model_patcher: Any) -> ModelKey | None:
    """The key of the model ``model_patcher`` samples, or None (no base model, or one that cannot be
    referenced weakly: nothing is remembered for it)."""
    base = getattr(model_patcher, "model", None)
    if base is None:
        return None
    try:
        ref = weakref.ref(base)
    except TypeError:
        return None
    return ModelKey(ref, getattr(model_patcher, "patches_uuid", None))


def remember(key: ModelKey | None, site: Any, block: int, klass: str, planned: str, errors: dict) -> None:
    """``errors`` (family -> rel. L2 on the block's sampled rows, None where it could not run) of
    ``block``'s calls of ``klass`` planned on ``planned``, built as ``site``."""
    base = key.base() if key is not None else None
    if base is None:
        return
    with _LOCK:
        held = _MEM.get(base)
        if held is None or held[0] != key.uuid:        # a new patch set (a LoRA): the old one's errors go
            held = (key.uuid, {})
            _MEM[base] = held
        entries = held[1]
        if len(entries) >= MAX_ENTRIES and (site, block, klass) not in entries:
            entries.pop(next(iter(entries)))
        entries[(site, block, klass)] = (planned, dict(errors))


def recall(key: ModelKey | None, site: Any, klass: str) -> dict:
    """{block: (planned family, {family: error})} remembered for ``klass`` under ``key`` and ``site``;
    {} when none (or the model's patches changed since)."""
    base = key.base() if key is not None else None
    if base is None:
        return {}
    with _LOCK:
        held = _MEM.get(base)
        if held is None or held[0] != key.uuid:
            return {}
        return {b: (p, dict(e)) for (s, b, k), (p, e) in held[1].items() if s == site and k == klass}


def forget(base: Any = None) -> int:
    """Forget what was measured for ``base`` (a base model), or for every model; how many entries went."""
    with _LOCK:
        if base is not None:
            held = _MEM.pop(base, None)
            return len(held[1]) if held else 0
        n = sum(len(h[1]) for h in _MEM.values())
        _MEM.clear()
        return n


def entries() -> int:
    """How many (block, class) entries are remembered now, over every model."""
    with _LOCK:
        return sum(len(h[1]) for h in _MEM.values())
