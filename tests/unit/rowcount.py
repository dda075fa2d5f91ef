"""How far a chunked MLP may differ from the unchunked one ON THIS MACHINE, measured, not assumed.

Every step of an MLP is row independent in exact arithmetic, but a matmul backend may round a
row differently depending on how many rows it was given (the CPU's BLAS picks kernels and
blockings by M. Seen with torch 2.13's CPU build on this project's machines: fp32/fp16 differ at
M = 1 and 513 while bf16 was row independent; issue 18 reports an AMD EPYC (AVX2 MKL path) where
a bf16 fc2 differs by one ulp on 2 of 300 rows). So the tolerance between "all tokens"
and "token chunks" is derived from the two stages' own row-count sensitivity on this machine:

* ``s1``: stage 1 (fc1) over all rows vs over the same chunks;
* ``s2``: stage 2 (activation + fc2) likewise, on stage 1's full output.

Both 0 (this backend is row-count independent here): the chunked MLP must be BITWISE equal.
Otherwise the difference may be that sensitivity carried through the second stage (factor 8:
the SwiGLU multiplies two perturbed halves and fc2 sums them) plus two output ulps (a value
that moved by less than an ulp can still round the other way).
"""
from __future__ import annotations

import torch


def rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0.0 when equal)."""
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() if a.numel() else 0.0


def per_chunk(fn, x: torch.Tensor, chunk: int) -> torch.Tensor:
    return torch.cat([fn(x[a:a + chunk]) for a in range(0, x.shape[0], chunk)])


def sensitivity(fn, x: torch.Tensor, chunk: int) -> float:
    """How much ``fn``'s rows change when it runs on ``chunk``-row slices instead of all rows."""
    return rel_max(per_chunk(fn, x, chunk), fn(x))


def mlp_tolerance(stage1, stage2, x: torch.Tensor, chunk: int) -> float:
    """The tolerance for ``stage2(stage1(x))`` chunked vs unchunked (0.0: must be bitwise)."""
    s1 = sensitivity(stage1, x, chunk)
    s2 = sensitivity(stage2, stage1(x), chunk)
    if s1 == 0.0 and s2 == 0.0:
        return 0.0
    eps = torch.finfo(stage2(stage1(x[:1])).dtype).eps
    return 8 * (s1 + s2) + 2 * eps


def assert_within(got: torch.Tensor, want: torch.Tensor, tol: float, tag: str = "") -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, tag
    if tol == 0.0:
        assert torch.equal(got, want), f"{tag}: this backend is row-count independent here, so bitwise"
    else:
        err = rel_max(got, want)
        assert err <= tol, f"{tag}: rel err {err:.3g} > measured tolerance {tol:.3g}"
