"""ComfyUI's own wrap_attn-wrapped ``attention_pytorch`` for the unit tests (CPU) and the benches, or a stand-in.

With COMFYUI_PATH pointing at a ComfyUI tree, ``attention()`` is that tree's
``comfy.ldm.modules.attention.attention_pytorch`` (imported with ``--cpu``); without one, a
stand-in with the same contract: ``wrap_attn`` (modelled on ComfyUI's: hands the call to
``transformer_options["optimized_attention_override"](func, ...)`` once, marking the kwargs
with ``_inside_attn_wrapper``) around PyTorch SDPA. ``load(path, cpu)`` is the benches' form
(bench/kernels/gpu_compile.py, bench/kernels/gpu_attention.py): the tree they are given, else the stand-in.

ComfyUI is imported from ``PYTHONPATH``, never by editing ``sys.path``: whoever starts the process puts
the tree there (.ci/run does for the tests; ``PYTHONPATH=$COMFYUI_PATH python3 -m bench....`` for a
bench). A tree that is named but is not the ComfyUI that PYTHONPATH imports is an error saying so.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import sys

import torch

_ATTENTION = os.path.join("comfy", "ldm", "modules", "attention.py")


class NotOnPythonPath(ImportError):
    """The ComfyUI tree asked for is not the one this process imports (it is not on PYTHONPATH)."""


def imported_comfy() -> str | None:
    """The folder holding the ``comfy`` package this process imports (already imported, or found on
    PYTHONPATH), or None."""
    mod = sys.modules.get("comfy")
    if mod is not None:
        locations = list(getattr(mod, "__path__", []))
    else:
        try:
            spec = importlib.util.find_spec("comfy")
        except (ImportError, ValueError):
            spec = None
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return os.path.dirname(locations[0]) if locations else None


def _import_attention(path: str, cpu: bool):
    """ComfyUI's ``attention_pytorch`` of the tree ``path``, from PYTHONPATH. Raises NotOnPythonPath when
    that tree is not the ComfyUI this process imports; any error of ComfyUI's own import as it is."""
    found = imported_comfy()
    if found is None:
        raise NotOnPythonPath(f"ComfyUI is not importable: put {path} on PYTHONPATH "
                              f"(PYTHONPATH={path} python3 -m ...; bash .ci/run does so for the tests)")
    if os.path.realpath(found) != os.path.realpath(path):
        raise NotOnPythonPath(f"PYTHONPATH imports ComfyUI from {found}, not from {path}: "
                              f"put {path} first on PYTHONPATH")
    import comfy.cli_args
    if cpu:
        comfy.cli_args.args.cpu = True          # before comfy.model_management is imported
    import comfy.ldm.modules.attention as att
    return att.attention_pytorch


def load(path: str | None, cpu: bool):
    """(ComfyUI's attention_pytorch of the tree ``path``, "ComfyUI <path>"), or (the stand-in,
    "stand-in (<why>)") when no tree is given or it does not import from PYTHONPATH."""
    if path and os.path.isfile(os.path.join(path, _ATTENTION)):
        try:
            return _import_attention(path, cpu), f"ComfyUI {path}"
        except Exception as e:  # noqa: BLE001 - the stand-in is used, and the reason recorded
            why = str(e) if isinstance(e, NotOnPythonPath) else f"ComfyUI at {path} does not import: {e!r}"
    else:
        why = "no ComfyUI tree given" if not path else f"{path} has no {_ATTENTION}"
    return attention_pytorch, f"stand-in ({why})"


def _real():
    path = os.environ.get("COMFYUI_PATH")
    if not path or not os.path.isfile(os.path.join(path, _ATTENTION)):
        return None, "COMFYUI_PATH not set"
    try:
        f = _import_attention(path, cpu=True)
    except NotOnPythonPath as e:
        raise NotOnPythonPath(f"COMFYUI_PATH names a ComfyUI tree, but {e} -- or unset COMFYUI_PATH for "
                              "the stand-in") from None
    except Exception as e:  # noqa: BLE001 - the stand-in is used, and the reason printed
        return None, f"ComfyUI's attention module does not import: {e!r}"
    if getattr(f, "__wrapped__", None) is None:
        return None, "this ComfyUI's attention_pytorch is not wrap_attn-wrapped"
    return f, None


def wrap_attn(func):
    """Stand-in for ComfyUI's wrap_attn (comfy/ldm/modules/attention.py)."""
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        remove = False
        try:
            if "_inside_attn_wrapper" not in kwargs:
                to = kwargs.get("transformer_options", None)
                remove = True
                kwargs["_inside_attn_wrapper"] = True
                if to is not None and "optimized_attention_override" in to:
                    return to["optimized_attention_override"](func, *args, **kwargs)
            return func(*args, **kwargs)
        finally:
            if remove:
                del kwargs["_inside_attn_wrapper"]
    return wrapper


@wrap_attn
def attention_pytorch(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                      skip_output_reshape=False, **kwargs):
    """Stand-in for ComfyUI's attention_pytorch: SDPA, [B,S,H*D] or [B,H,S,D] in and out."""
    if not skip_reshape:
        b, _, hd = q.shape
        d = hd // heads
        q, k, v = (t.view(b, -1, t.shape[-1] // d, d).transpose(1, 2) for t in (q, k, v))
    sdpa_extra = {kk: vv for kk, vv in kwargs.items() if kk in ("scale", "enable_gqa")}
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, **sdpa_extra)
    if not skip_output_reshape:
        out = out.transpose(1, 2).reshape(out.shape[0], -1, out.shape[1] * out.shape[3])
    return out


@functools.lru_cache(maxsize=None)
def _chosen():
    return _real()


def attention():
    """(ComfyUI's attention_pytorch or the stand-in, a label saying which). Raises NotOnPythonPath
    when COMFYUI_PATH names a tree that PYTHONPATH does not import."""
    real, why = _chosen()
    if real is not None:
        return real, "ComfyUI's attention_pytorch (%s)" % os.environ.get("COMFYUI_PATH")
    return attention_pytorch, "stand-in attention_pytorch (%s)" % why
