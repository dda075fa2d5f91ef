"""ComfyUI-SafeSage: ComfyUI loads this file (custom_nodes/ComfyUI-SafeSage/__init__.py).

V3 entry point only: `comfy_entrypoint` returns the extension that lists the nodes. Do not
define NODE_CLASS_MAPPINGS here: ComfyUI then ignores comfy_entrypoint.

All logic lives in safe_ops/, which imports no ComfyUI module at import time and is
importable on its own (tests put the repository root on sys.path and `import safe_ops`).
When this file is imported outside ComfyUI (no `comfy_api` to import, e.g. pytest treating
the repository as a package; or no parent package, e.g. pytest importing it as a top-level
module because the checkout's folder name, such as ComfyUI-SafeSage, is no Python identifier)
it registers nothing and imports nothing heavy.
"""
import importlib.util

WEB_DIRECTORY = "./web"

if not __package__ or importlib.util.find_spec("comfy_api") is None:
    __all__ = ["WEB_DIRECTORY"]
else:
    try:
        from .nodes import comfy_entrypoint
    except ImportError as e:
        raise ImportError(
            "SafeSage could not import ComfyUI's V3 node API (comfy_api.latest); it needs "
            f"ComfyUI 0.3.75 or newer. Update ComfyUI. Cause: {e}"
        ) from e
    from .nodes import routes as _routes

    _routes.register()
    __all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]
