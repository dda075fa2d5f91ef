"""What ComfyUI would run: its own attention functions, and which functions run an unguarded kernel.

A call no guarded kernel takes runs exactly what ComfyUI would have run (attention.override): ComfyUI's
``func`` -- unless ``func`` itself runs an unguarded sage / comfy-kitchen kernel, then ComfyUI's own
``attention_pytorch``. ComfyUI's modules are looked up lazily (``sys.modules``), never imported here.
"""
from __future__ import annotations

from typing import Any, Callable


# ------------------------------------------------------------------ what ComfyUI would run
#: ComfyUI's own attention functions that run a sage or comfy-kitchen kernel without a guard
#: (comfy/ldm/modules/attention.py), by kind; looked up lazily, where this ComfyUI has them
UNGUARDED = (("attention_sage", "sage"), ("attention3_sage", "sage"), ("attention_comfy_kitchen_int8", "ck"))


def _comfy_attention_module():
    import sys
    return sys.modules.get("comfy.ldm.modules.attention")


def _name_kind(fn: Any) -> str | None:
    """Other packs' wrappers, by name (the rule ComfyUI's own function names follow)."""
    if getattr(fn, "_safesage_guarded", False):
        return None
    name = getattr(fn, "__name__", None)
    names = (name if isinstance(name, str) else type(fn).__name__).lower()
    if "sage" in names:
        return "sage"
    if "kitchen" in names:
        return "ck"
    return None


def unguarded_kind(fn: Any) -> str | None:
    """"sage" / "ck" when calling ``fn`` runs an unguarded SageAttention / comfy-kitchen kernel, else
    None: identity with ComfyUI's own ``attention_sage`` / ``attention3_sage`` /
    ``attention_comfy_kitchen_int8`` (wrapped or inner), or, for other packs' functions and
    overrides, the name rule -- looking through ``__wrapped__`` and one level of closure (core's
    ``set_model_optimized_attention`` override closes over the function it runs)."""
    if fn is None or getattr(fn, "_safesage_guarded", False):
        return None
    att = _comfy_attention_module()
    cands = [fn, getattr(fn, "__wrapped__", None)] + _closed_over(fn)
    for c in cands:
        if c is None:
            continue
        for name, kind in UNGUARDED:
            own = getattr(att, name, None) if att is not None else None
            if own is not None and (c is own or c is getattr(own, "__wrapped__", None)):
                return kind
    for c in cands:
        if c is not None and not _is_comfy_own(c, att):
            kind = _name_kind(c)
            if kind is not None:
                return kind
    return None


def _closed_over(fn) -> list:
    """The callables ``fn`` closes over (one level; empty cells skipped)."""
    out = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:           # an empty cell
            continue
        if callable(value):
            out.append(value)
    return out


def _is_comfy_own(fn, att) -> bool:
    """One of ComfyUI's own attention functions (its name says what it is, and it is not sage)."""
    if att is None:
        return False
    name = getattr(fn, "__name__", None)
    own = getattr(att, name, None) if isinstance(name, str) else None
    return own is not None and (fn is own or fn is getattr(own, "__wrapped__", None))


def comfy_pytorch_attention() -> Callable | None:
    """ComfyUI's own ``attention_pytorch`` (its inner function), or None outside ComfyUI."""
    att = _comfy_attention_module()
    f = getattr(att, "attention_pytorch", None) if att is not None else None
    return getattr(f, "__wrapped__", f)


def comfy_function(func: Callable | None) -> Callable | None:
    """What runs a call that no guarded kernel takes: ComfyUI's ``func`` -- unless ``func`` itself
    runs an unguarded sage / comfy-kitchen kernel, then ComfyUI's own ``attention_pytorch``."""
    if func is None or unguarded_kind(func) is None:
        return func
    return comfy_pytorch_attention() or func


def function_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
