"""A kernel family defined in this one file: a fake CPU kernel with 16-bit index arithmetic.

Loaded only through ``SAFESAGE_EXTRA_FAMILIES=fake_family`` (tests/unit/test_extra_family.py): the
registry imports this module and calls :func:`kernel_families` with its kit, so nothing of the pack
is imported here (in a ComfyUI server the pack's package has another name). Its envelope is sage
1.0.6's index arithmetic shrunk to 16-bit products on a CPU-sized problem, so H3-shaped strided
views cross it and need a plan; its kernel asserts that every launch is inside that envelope, counts
the launches, and computes attention with PyTorch's SDPA.
"""
from __future__ import annotations

NAME = "fake_cpu16"
LAUNCHES: list = []          # (layout, q shape) of every launch, in this process


def kernel_families(kit):
    terms = tuple(kit.IndexTerm("fake_quant", t, a, "i16", f"fake_family.py ({t}.{a})")
                  for t in ("q", "k", "q:alloc", "k:alloc") for a in "bhs")
    env = kit.Envelope(family=NAME, source="tests/unit/fake_family.py", head_dims=(16,), dtypes=("float32",),
                       supports_mask=False, terms=terms, devices=("cpu",),
                       temp_bytes=lambda call: 4 * call.q.numel)         # its output, float32
    hnd = {"HND": lambda t: t, "NHD": lambda t: t.transpose(1, 2)}

    def fn(q, k, v, layout, scale):
        def desc(t):
            t = hnd[layout](t)
            return kit.TensorDesc(tuple(t.shape), tuple(t.stride()))
        call = kit.AttnCall(desc(q), desc(k), desc(v), "float32", layout, False, "cpu")
        viol = kit.check(call, env)
        assert not viol, f"{NAME} launched outside its envelope: {viol[0]}"
        LAUNCHES.append((layout, tuple(q.shape)))
        return kit.sdpa_fn(q, k, v, layout, scale)

    return [kit.KernelFamily(env, kind="fake", tolerance=0.01, call=lambda: (fn, None),
                             function="tests/unit/fake_family.py fn",
                             detect=lambda rt: rt.arch is None)]      # runs on a machine without CUDA
