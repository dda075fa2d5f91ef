"""Two fake CPU kernel families for the quality guard's tests, loaded through
``SAFESAGE_EXTRA_FAMILIES=fake_quality_families`` (in a test process or a headless ComfyUI server):

* ``fake_sage`` (kind "sage"): q and k quantised per token to :data:`SAGE_LEVELS` levels (scale =
  the row's largest magnitude), as INT8 sage quantises per block of tokens: a few channels scaled
  up (H3's late blocks) take the scale, every other channel loses precision, so its error grows
  with the outlier factor.
* ``fake_kitchen`` (kind "ck"): exact attention plus noise of a known relative size
  :data:`KITCHEN_ERROR` on every call, whatever the data (comfy-kitchen's int8_attention holds its
  error flat across outlier channels by rotating them).

Both compute attention with PyTorch's SDPA on the dequantised q/k; neither imports the pack (the
registry hands them its kit).
"""
from __future__ import annotations

import torch

SAGE, KITCHEN = "fake_sage", "fake_kitchen"
SAGE_LEVELS = 127
KITCHEN_ERROR = 0.006
LAUNCHES: dict = {SAGE: 0, KITCHEN: 0}


def quantise(t: torch.Tensor, levels: int, dim: int) -> torch.Tensor:
    """``t`` [B,H,S,D] rounded to ``levels`` steps of a scale per token (dim -1) or per channel (-2)."""
    s = t.abs().amax(dim=dim, keepdim=True).clamp_min(1e-12) / levels
    return (t / s).round() * s


def make_family(kit, name, kind, levels, error=None, tolerance=0.5, benign_error=None):
    """One fake family: q/k quantised to ``levels`` (0: exact) and, with ``error`` (a callable read on
    every call: a relative size, or it raises), noise of that relative size added to the output. The
    launch is counted (:data:`LAUNCHES`) before ``error`` is read. ``tolerance``: its first-call check's
    bound, which is also the quality guard's ceiling for blocks planned on it, unless ``benign_error``
    (its random-input error) makes the ceiling lower (quality.targets.family_ceiling)."""
    LAUNCHES.setdefault(name, 0)
    env = kit.Envelope(family=name, source="tests/unit/fake_quality_families.py", head_dims=(16, 32, 64, 128),
                       dtypes=("float32",), supports_mask=False, terms=(), devices=("cpu",),
                       temp_bytes=lambda call: 4 * call.q.numel)

    def fn(q, k, v, layout, scale):
        LAUNCHES[name] += 1
        rel = error() if error is not None else None
        qh, kh, vh = (t if layout == "HND" else t.transpose(1, 2) for t in (q, k, v))
        if levels:
            qh, kh = quantise(qh, levels, -1), quantise(kh, levels, -1)
        o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, scale=scale)
        if rel is not None:
            noise = torch.randn(o.shape, generator=torch.Generator().manual_seed(7)).to(o)
            o = o + rel * o.norm() / noise.norm() * noise
        return o if layout == "HND" else o.transpose(1, 2)

    return kit.KernelFamily(env, kind=kind, tolerance=tolerance, call=lambda: (fn, None), benign_error=benign_error,
                            function=f"tests/unit/fake_quality_families.py {name}",
                            detect=lambda rt: rt.arch is None)


def kernel_families(kit):
    # KITCHEN_ERROR is read on every call (tests set it)
    return [make_family(kit, SAGE, "sage", SAGE_LEVELS), make_family(kit, KITCHEN, "ck", 0, error=lambda: KITCHEN_ERROR)]
