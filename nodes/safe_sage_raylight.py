"""SafeSageRaylight: SafeSage inside raylight's Ray workers. Thin: logic in safe_ops.multigpu.

raylight (komikndr/raylight) samples in Ray worker processes that load no custom nodes, so the
SafeSage Attention node's model never reaches its GPUs. This node takes raylight's RAY_ACTORS (put
it after raylight's model loader, where raylight's own patch nodes go) and applies SafeSage in every
worker, as those patch nodes do: the hook at xFuser's/yunchang's per-rank sage selection, and the
SafeSage Attention node's patch (H3 MLP chunking, block index) on the worker's model.
"""
from __future__ import annotations

from comfy_api.latest import io, ui

from . import _backend
from .safe_sage import (KERNELS, MLP_CHUNKING, TIP_KERNEL, TIP_MLP_CHUNK_TOKENS, TIP_MLP_CHUNKING, TIP_VERIFY,
                        VERIFY)

RayActors = io.Custom("RAY_ACTORS")

TIP_ACTORS = ("raylight's workers, from its model loader (or after its other patch nodes). SafeSage is applied "
              "in every worker; the workers come out patched.")


class SafeSageRaylight(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SafeSageRaylight",
            display_name="SafeSage Attention (raylight workers)",
            category="model/patch/attention",
            description=(
                "SafeSage for raylight's multi-GPU sequence-parallel sampling: in every Ray worker, checks each "
                "rank's SageAttention call (xFuser/yunchang Ulysses and ring, output and log-sum-exp) against "
                "what the kernel can index, checks each new kind of call once on every rank, and sends a call "
                "outside the limits -- or one that failed its check on any rank -- to PyTorch attention on every "
                "rank alike; and runs MiniMax H3's MLP in token chunks. Never stops a worker: what cannot be "
                "applied leaves that worker's model as it was, and the status says so."
            ),
            inputs=[
                RayActors.Input("ray_actors", tooltip=TIP_ACTORS),
                io.Combo.Input("kernel", options=KERNELS, default="auto", tooltip=TIP_KERNEL),
                io.Combo.Input("mlp_chunking", options=MLP_CHUNKING, default="auto", tooltip=TIP_MLP_CHUNKING),
                io.Int.Input("mlp_chunk_tokens", default=16384, min=256, max=1048576, step=256,
                             tooltip=TIP_MLP_CHUNK_TOKENS),
                io.Combo.Input("verify", options=VERIFY, default="first", tooltip=TIP_VERIFY),
            ],
            outputs=[RayActors.Output()],
        )

    @classmethod
    def execute(cls, *, ray_actors, kernel, mlp_chunking, mlp_chunk_tokens, verify) -> io.NodeOutput:
        text = _backend.raylight_workers(ray_actors, dict(kernel=kernel, mlp_chunking=mlp_chunking,
                                                          mlp_chunk_tokens=int(mlp_chunk_tokens), verify=verify))
        return io.NodeOutput(ray_actors, ui=ui.PreviewText(text))
