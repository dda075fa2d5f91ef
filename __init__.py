"""ComfyUI-SafeSage: ComfyUI loads this file (custom_nodes/ComfyUI-SafeSage/__init__.py).

V3 entry point only: `comfy_entrypoint` returns the extension that lists the nodes. Do not
define NODE_CLASS_MAPPINGS here: ComfyUI then ignores comfy_entrypoint.

All logic lives in safe_ops/, which imports no ComfyUI module at import time and is
importable on its own (tests put the repository root on sys.path and `import safe_ops`).
When this file is imported outside a running ComfyUI it registers nothing and imports nothing
heavy: no parent package (pytest importing it as a top-level module because the checkout's
folder name, such as ComfyUI-SafeSage, is no Python identifier), or no ComfyUI that has set up
its device (ComfyUI's nodes.py, whose load_custom_node imports this file, imports
comfy.model_management at its top in 0.3.75, 0dd9b154 and 783545f6, and the compiler era's
main.py imports both before it loads custom nodes; pytest importing the
repository as a package with a ComfyUI tree on PYTHONPATH has not, and importing ComfyUI's node
API here would start that set-up, or fail on a package ComfyUI's own start-up would have needed,
such as PyAV).
"""
import importlib.util
import sys

WEB_DIRECTORY = "./web"

if not __package__ or "comfy.model_management" not in sys.modules or importlib.util.find_spec("comfy_api") is None:
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
