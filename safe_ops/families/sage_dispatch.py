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


# ---------------------------------------------------------------------------- in words
#: GPU models of each compute capability above, as Preflight's report and the demo name them
GPU_NAMES: dict[tuple[int, int], str] = {
    (8, 0): "A100 / A30",
    (8, 6): "RTX 30xx / A40",
    (8, 9): "RTX 4090 / L40S",
    (9, 0): "H100 / H200",
    (12, 0): "RTX 5090 / RTX PRO 6000 Blackwell",
    (12, 1): "DGX Spark / GB10",
}
#: the sageattention versions whose dispatch was read and whose kernels were measured
SAGE_VERSIONS = ("2.2.0", "1.0.6")


def gpu_words(arch: tuple[int, int]) -> str:
    """``sm_89 (RTX 4090 / L40S)``: an arch as Preflight's report names it."""
    arch = (int(arch[0]), int(arch[1]))
    names = GPU_NAMES.get(arch)
    return f"sm_{arch[0]}{arch[1]}" + (f" ({names})" if names else "")


def dispatch_archs(family: str, version: str) -> list[tuple[int, int]]:
    """The archs of :data:`GPU_NAMES` on which ``sageattn`` of ``version`` runs ``family``."""
    return [a for a in GPU_NAMES if sage_family_for(version, a) == family]


def sageattn_users(family: str) -> str:
    """Who runs ``family`` through ``sageattn``, in Preflight's words ("sm_89 (RTX 4090 / L40S) with
    sageattention 2.2.0"); "" when no read sageattention dispatches to it."""
    parts = []
    for ver in SAGE_VERSIONS:
        archs = dispatch_archs(family, ver)
        if archs:
            parts.append(", ".join(gpu_words(a) for a in archs) + f" with sageattention {ver}")
    return "; ".join(parts)
