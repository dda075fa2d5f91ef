"""ComfyUI side of the pack: the V3 extension, its nodes and its HTTP routes (thin; logic is in safe_ops)."""
from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from .safe_sage import NODES, SafeSageAttention
from .safe_sage_raylight import SafeSageRaylight

__all__ = ["SafeSageAttention", "SafeSageExtension", "comfy_entrypoint"]


class SafeSageExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return [*NODES, SafeSageRaylight]


async def comfy_entrypoint() -> SafeSageExtension:
    return SafeSageExtension()
