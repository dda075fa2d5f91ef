"""H3's SwiGLU MLP in plain torch, unchunked and token-chunked: the demo's and the tests' reference.

Not the production path (that is ``mlp.h3_mlp_forward``, ComfyUI's own forward per chunk); these two
functions check the chunk loop (``mlp.run_chunked``) bit for bit without ComfyUI.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .mlp import run_chunked


def reference_swiglu(x: torch.Tensor, fc1_weight, fc1_bias, fc2_weight, fc2_bias) -> torch.Tensor:
    """A plain-torch SwiGLU MLP in the form H3 uses (gate = first half of fc1's output), for the
    demo and the tests that need no ComfyUI: fc1 -> ``silu(gate).mul_(up)`` -> fc2."""
    h = F.linear(x, fc1_weight, fc1_bias)
    gate, up = h.chunk(2, dim=-1)
    return F.linear(F.silu(gate).mul_(up), fc2_weight, fc2_bias)


def chunked_swiglu(x: torch.Tensor, fc1_weight, fc1_bias, fc2_weight, fc2_bias, chunk_tokens: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`reference_swiglu` over token chunks (the chunk loop of the H3 forward, on plain
    weights). ``out`` must be ``[..., hidden_out]`` or ``[S, hidden_out]``."""
    if out is not None:
        n_out = fc2_weight.shape[0]
        S = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if tuple(out.shape) not in ((*x.shape[:-1], n_out), (S, n_out)):
            raise ValueError(f"out has shape {tuple(out.shape)}, expected {(*x.shape[:-1], n_out)}")
    return run_chunked(lambda xc: reference_swiglu(xc, fc1_weight, fc1_bias, fc2_weight, fc2_bias),
                       x, chunk_tokens, out)
