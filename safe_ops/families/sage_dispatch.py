"""Which SageAttention kernel family ``sageattn`` runs for (sage version, GPU arch).

sageattention's own dispatcher as data: ``facts.devices`` asks :func:`sage_family_for` which family
an installed ``sageattn`` runs on a GPU. How each family is called, and the archs a build carries
it on, are the family's own facts (``sage1``, ``sage2_*``: ``KernelFamily.call`` / ``runs_on``).

Read from sageattention 1.0.6 and thu-ml/SageAttention tag ``v2.2.0`` (``core.py`` lines
below; see ``sage2`` for the source commit).
"""
from __future__ import annotations

from ..facts.versions import version_tuple

# What sageattn 2.2.0 runs, by compute capability.
_SAGE22_DISPATCH: dict[tuple[int, int], str] = {
    (8, 0): "sage2_sm80",            # core.py:144-145
    (8, 6): "sage2_sm86_triton",     # core.py:146-147
    (8, 9): "sage2_sm89_fp8pv",      # core.py:148-149
    (9, 0): "sage2_sm90",            # core.py:150-151
    (12, 0): "sage2_sm120_fp8pv",    # core.py:152-153
    # sm121: ValueError at the v2.2.0 tag (core.py:154-155); main after the tag (c03f15f,
    # still version "2.2.0") dispatches it exactly like sm120. If a tag build raises, nothing
    # was launched (a Python ValueError), so mapping it is safe.
    (12, 1): "sage2_sm120_fp8pv",
}

SAGE1 = "sage1_triton"


def sage_family_for(version: str | None, arch: tuple[int, int] | None) -> str | None:
    """Which envelope family ``sageattn`` of ``version`` runs on compute capability ``arch``.

    1.x -> "sage1_triton" (Triton; int8 tl.dot needs sm80+). 2.2.x -> the table above. 2.0.x/2.1.x
    have other dispatchers and kernels (2.1.0 sends sm89 to pv fp32+fp32, 2.0.1 sends sm90 to the
    fp16 CUDA kernel) and were not read: None, i.e. not known to be safe. None for an unsupported
    arch, an unparsable version, or no arch.
    """
    v = version_tuple(version)
    if not v or arch is None:
        return None
    arch = (int(arch[0]), int(arch[1]))
    if v[0] == 1:
        return SAGE1 if arch >= (8, 0) else None
    if v[:2] == (2, 2):
        return _SAGE22_DISPATCH.get(arch)
    return None
