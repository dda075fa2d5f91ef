"""How many tokens per chunk an H3 MLP call runs: the setting, the memory per token, the budget.

Pure arithmetic plus a read of free device memory (budget.py's MLP_READER, throttled: at most one
per BUDGET_POLL_S seconds for the whole process); no ComfyUI, no GPU work.
"""
from __future__ import annotations

from typing import Any

import torch

from ...facts.budget import mlp_budget_bytes
from .dims import H3_FFN, H3_HIDDEN

#: token counts the planner rounds to
CHUNK_ALIGN = 256
#: "auto" aims at this many tokens per chunk. Measured on an H200 through ComfyUI 0dd9b154's
#: own ops (bench/mlp/gpu_mlp_comfy.py -> bench/results/mlp_comfy_h200.json, GPU busy as inside
#: the model): the GEMMs of 6,912-token chunks run less efficiently than the whole sequence's
#: (fp8 +2.8% to +3.4% over 38k-169k tokens); with 16,384-token chunks fp8 is +1.6% to +1.9%
#: (the pack's earlier mirror of ComfyUI's layers). ComfyUI's own forward per chunk, chunks
#: evened out (:func:`balanced`), 169k tokens: fp8 +1.6%, int8 -0.6%, bf16 +2.9%, extra peak
#: -81% / -81% / -80% (bench/results/mlp_comfy_castonce_balanced_h200.json).
AUTO_CHUNK_TOKENS = 16_384
#: never plan a budget below this, even with little free memory


def per_token_bytes(hidden: int, ffn: int, dtype_bytes: int) -> int:
    """Bytes one token of a chunk keeps live in the chunk loop (upper bound).

    In the compute dtype: fc1 output ``2*ffn`` (gate|up), SwiGLU's output ``ffn`` (a new
    contiguous tensor on the quantised paths; the dense path writes it in place into the
    gate half) and fc2's per-chunk output ``hidden`` before it is copied into the
    preallocated result; plus the
    1-byte fp8 input copies of a quantised path (``hidden`` for fc1, ``ffn`` for fc2).
    The dense path needs less (no input copies, fc2 writes straight into the output).
    """
    return (3 * ffn + hidden) * dtype_bytes + (ffn + hidden)


#: "auto" memory budget for one chunk's intermediates (fc1 out + activation + fc2 in/out):
#: what AUTO_CHUNK_TOKENS tokens of H3's MLP keep live in bf16 (116,480 B each -> 1,820 MiB)
AUTO_BUDGET_BYTES = AUTO_CHUNK_TOKENS * per_token_bytes(H3_HIDDEN, H3_FFN, 2)


def plan_chunk(S: int, hidden: int, ffn: int, dtype_bytes: int, budget_bytes: int) -> int:
    """Tokens per chunk so one chunk's intermediates fit ``budget_bytes``.

    Returns ``S`` when everything fits (no chunking; ``S = 0`` returns 0), otherwise the
    largest multiple of 256 that fits, or -- when even 256 tokens do not fit -- the largest
    token count that does, never less than 1.
    """
    S = int(S)
    if S <= 0:
        return 0
    per_tok = per_token_bytes(int(hidden), int(ffn), int(dtype_bytes))
    if per_tok <= 0:
        return S
    fit = int(budget_bytes) // per_tok
    if fit >= S:
        return S
    if fit >= CHUNK_ALIGN:
        return (fit // CHUNK_ALIGN) * CHUNK_ALIGN
    return max(1, fit)


def parse_chunk_setting(chunk_setting: Any) -> Any:
    """``"auto"`` | ``"off"`` | positive int (also as a digit string) -> normalised value."""
    if chunk_setting is None:
        return "auto"
    if isinstance(chunk_setting, bool):
        raise ValueError(f"SafeSage: MLP chunk setting must be 'auto', 'off' or a token count, got {chunk_setting!r}")
    if isinstance(chunk_setting, int):
        if chunk_setting < 1:
            raise ValueError(f"SafeSage: MLP chunk tokens must be >= 1, got {chunk_setting}")
        return chunk_setting
    s = str(chunk_setting).strip().lower()
    if s in ("auto", "off"):
        return s
    if s.isdigit() and int(s) >= 1:
        return int(s)
    raise ValueError(f"SafeSage: MLP chunk setting must be 'auto', 'off' or a token count, got {chunk_setting!r}")




def auto_budget_bytes(device: torch.device, read_free=None) -> int:
    """"auto"'s budget for one chunk on ``device``: AUTO_BUDGET_BYTES, less when memory is short
    (``read_free``: see budget.mlp_budget_bytes)."""
    return mlp_budget_bytes(device, AUTO_BUDGET_BYTES, read_free)


def balanced(S: int, c: int) -> int:
    """The same number of chunks as ``c`` tokens per chunk needs, of (nearly) equal size: no small
    tail chunk, whose GEMMs run less efficiently (rounded up to CHUNK_ALIGN, never above ``c``)."""
    if c >= S or c < CHUNK_ALIGN:
        return c
    n = -(-S // c)
    even = -(-S // n)
    return min(c, -(-even // CHUNK_ALIGN) * CHUNK_ALIGN)


def resolve_chunk(chunk_setting: Any, S: int, hidden: int, ffn: int, dtype: torch.dtype,
                  device: torch.device, budget_bytes: int | None = None) -> int:
    """Chunk tokens for this call; ``>= S`` means "do not chunk". "auto": the largest chunk the
    budget allows, then evened out over the chunks it takes (:func:`balanced`); a token count is
    taken as given."""
    return chunk_tokens(parse_chunk_setting(chunk_setting), S, hidden, ffn, dtype, device, budget_bytes)


def chunk_tokens(setting: Any, S: int, hidden: int, ffn: int, dtype: torch.dtype,
                 device: torch.device, budget_bytes: int | None = None) -> int:
    """:func:`resolve_chunk` for a setting :func:`parse_chunk_setting` already normalised (a
    patched MLP parses its setting once, not per call). "auto" reads free memory through
    budget.MLP_READER (at most every BUDGET_POLL_S seconds) unless ``budget_bytes`` is given."""
    if setting == "off" or S <= 0:
        return max(S, 0)
    if setting == "auto":
        if budget_bytes is None:
            budget_bytes = auto_budget_bytes(device)
        return balanced(S, plan_chunk(S, hidden, ffn, dtype.itemsize, budget_bytes))
    return min(int(setting), S)
