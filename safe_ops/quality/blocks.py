"""Which block an attention call belongs to: ComfyUI's ``transformer_options["block_index"]``.

Many ComfyUI models set ``block_index`` themselves while a block runs (Flux, Wan, ...); MiniMax H3
does not, but it offers every DiT block to ``patches_replace["dit"][("double_block", i)]``
(comfy/ldm/minimax/model.py), ComfyUI's own per-block hook (``ModelPatcher.set_model_patch_replace``).
:func:`install_block_index` puts one there for each block that sets ``block_index = i`` on the
block's ``transformer_options`` (as Flux does in its own loop) and runs what was there before --
another pack's replacement, chained -- else the original block. A model with neither gets the n-th
attention call of the forward (guard.py). The patch is plain Python with no state: traced by
torch.compile without a graph break.

Only the base model's own block is measured under its index: while the original block runs (inside
whatever replacement was there before), :data:`BASE_KEY` holds its index, and the guard reads a call
as block ``i`` only where both say ``i`` (``QualityGuard.base_marked``). Another tower's attention that
runs under the same ``transformer_options`` -- H3's Fun-ControlNet tower ran the sampler's override
under the base ``block_index`` (ComfyUI PR #16344), TokenRefiner runs before the first block -- is
neither measured nor moved: it runs as planned.
"""
from __future__ import annotations

from typing import Any, Callable

from .. import contain
from ..attention.call_forms import BASE_KEY

PATCH_NAME = "dit"
BLOCK_NAME = "double_block"


class BaseBlock:
    """The original block, marked as the base model's own while it runs (:data:`BASE_KEY`). Nothing of
    SafeSage's runs after the block has started but the plain unmarking, so an error of SafeSage's here
    is raised before the block ran: :class:`BlockIndex` contains it and runs the block unmarked. The
    block's own errors pass through."""

    def __init__(self, index: int, original: Callable):
        self.index = index
        self.original = original

    def __call__(self, args: dict) -> Any:
        to = args.get("transformer_options")
        marked = isinstance(to, dict)
        if marked:
            to[BASE_KEY] = self.index
        try:
            return contain.run_comfy(self.original, args)
        finally:
            if marked:
                to[BASE_KEY] = None


class BlockIndex:
    """``patches_replace["dit"][("double_block", i)]``: sets ``block_index`` and runs the block
    (or the replacement that was there before, chained)."""

    _safesage_block_index = True

    def __init__(self, index: int, previous: Callable | None):
        self.index = index
        self.previous = previous

    @contain.boundary
    def __call__(self, args: dict, extra: dict) -> Any:
        # ComfyUI's H3 forward calls this: an error of SafeSage's in marking the block is contained
        # (the block runs unmarked: counted by call order); the block's own errors pass through
        try:
            self.mark(args)
        except Exception as e:  # noqa: BLE001 - see contain.py
            contain.internal_error(e, "the H3 block index", "this block's calls are told apart by call order")
        original = extra["original_block"]
        try:
            base = BaseBlock(self.index, original)
        except Exception as e:  # noqa: BLE001 - see contain.py
            contain.internal_error(e, "marking the H3 base block", "this block's calls run as planned, unmeasured")
            base = original
        try:
            if self.previous is not None:
                return contain.run_comfy(self.previous, args, {**extra, "original_block": base})
            return base(args)
        except Exception as e:
            if contain.not_ours(e):
                raise                     # the block's (or the chained replacement's) own error
            # SafeSage's, raised before the block ran (BaseBlock runs none of SafeSage's code after it starts)
            contain.internal_error(e, "the H3 block index", "the block runs unmarked")
            if self.previous is not None:
                return contain.run_comfy(self.previous, args, extra)
            return contain.run_comfy(original, args)

    def mark(self, args: dict) -> None:
        to = args.get("transformer_options")
        if isinstance(to, dict):
            to["block_index"] = self.index


def install_block_index(model_patcher: Any, diffusion_model: Any) -> int:
    """One :class:`BlockIndex` per block of a MiniMax H3 ``diffusion_model`` on ``model_patcher``
    (a clone), chained with any replacement already there (an earlier SafeSage's is replaced).
    Returns how many were installed (0 for other models or a ComfyUI without the hook)."""
    from ..models.h3.dims import is_h3_model
    blocks = getattr(diffusion_model, "blocks", None)
    if not is_h3_model(diffusion_model) or blocks is None or not hasattr(model_patcher, "set_model_patch_replace"):
        return 0
    to = model_patcher.model_options.get("transformer_options", {})
    existing = to.get("patches_replace", {}).get(PATCH_NAME, {})
    for i in range(len(blocks)):
        prev = existing.get((BLOCK_NAME, i))
        while getattr(prev, "_safesage_block_index", False):
            prev = prev.previous
        model_patcher.set_model_patch_replace(BlockIndex(i, prev), PATCH_NAME, BLOCK_NAME, i)
    return len(blocks)
