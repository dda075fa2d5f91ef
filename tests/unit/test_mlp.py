"""CPU tests of safe_ops.mlp's pure-torch core (no ComfyUI needed).

Numerics. Every step of the MLP is row independent, so chunked must be BITWISE equal to
ComfyUI's eager path (fc1 over all tokens -> ``_swiglu_eager`` -> fc2) whenever the matmul
backend is row independent itself. The CPU backend is not always: measured with torch 2.13
CPU, ``F.linear`` over a row slice differs from the same rows of a full ``F.linear`` for
fp32 and fp16 at some M (M = 1, remainders such as 513 = 512 + 1), while bf16 was row
independent in every case here. So each case asserts
  1. chunked == the same eager math run per chunk (same matmul shapes) -- always bitwise;
  2. chunked == unchunked bitwise when the backend's matmul is row independent for these
     shapes (checked in the test, ``_backend_row_independent``), else within the stated
     relative tolerance TOL (max |diff| / max |ref|). Largest values measured here:
     fp32 3.4e-7, fp16 7.0e-5, fp8-dequantised fp16 5.1e-4, fp8-dequantised fp32 6.2e-7,
     bf16 0 (bitwise).
"""
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from safe_ops import mlp, mlp_patch, mlp_plan
from safe_ops.fences import FenceBook


def _swiglu_spec(h):
    """SwiGLU as H3 defines it: silu(first half) * second half. (test_mlp_comfy.py checks the
    pack's SwiGLU against ComfyUI's own _swiglu_eager.)"""
    n = h.shape[-1] // 2
    return F.silu(h[..., :n]) * h[..., n:]


def _reference(x, w1, b1, w2, b2):
    return F.linear(_swiglu_spec(F.linear(x, w1, b1)), w2, b2)


def _weights(hidden, ffn, dtype, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(2 * ffn, hidden, generator=g) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(hidden, ffn, generator=g) * ffn ** -0.5).to(dtype)
    b1 = (torch.randn(2 * ffn, generator=g) * 0.02).to(dtype) if bias else None
    b2 = (torch.randn(hidden, generator=g) * 0.02).to(dtype) if bias else None
    return w1, b1, w2, b2


def _x(S, hidden, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, hidden, generator=g).to(dtype)


TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _per_chunk_reference(x, w1, b1, w2, b2, chunk):
    return torch.cat([_reference(x[a:a + chunk], w1, b1, w2, b2) for a in range(0, x.shape[0], chunk)])


def _backend_row_independent(x, w1, b1, w2, b2, chunk):
    return torch.equal(_per_chunk_reference(x, w1, b1, w2, b2, chunk), _reference(x, w1, b1, w2, b2))


def _assert_same(got, x, w1, b1, w2, b2, chunk, dtype, tag):
    ref = _reference(x, w1, b1, w2, b2)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    c = max(1, min(chunk, x.shape[0]))
    # 1. same kernels, same shapes: bitwise, always
    assert torch.equal(got, _per_chunk_reference(x, w1, b1, w2, b2, c)), tag
    # 2. vs unchunked: bitwise where the backend matmul is row independent
    if _backend_row_independent(x, w1, b1, w2, b2, c):
        assert torch.equal(got, ref), tag
        return
    err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()
    assert err <= TOL[dtype], f"{tag}: rel err {err} > {TOL[dtype]}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("S,chunk", [(1000, 256), (999, 256), (997, 100), (37, 1), (50, 64), (256, 256), (513, 512)])
def test_chunked_equals_unchunked(dtype, bias, S, chunk):
    hidden, ffn = 64, 96
    w1, b1, w2, b2 = _weights(hidden, ffn, dtype, bias)
    x = _x(S, hidden, dtype)
    got = mlp.chunked_swiglu(x, w1, b1, w2, b2, chunk)
    _assert_same(got, x, w1, b1, w2, b2, chunk, dtype, f"{dtype}-{bias}-{S}-{chunk}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_scaled_weights(dtype):
    """float8_e4m3fn weight + per-tensor scale, dequantised once (comfy-kitchen formula)."""
    hidden, ffn = 128, 160
    w1f, _, w2f, _ = _weights(hidden, ffn, torch.float32, seed=3)
    s1 = w1f.abs().amax() / 448.0
    s2 = w2f.abs().amax() / 448.0
    q1 = (w1f / s1).to(torch.float8_e4m3fn)
    q2 = (w2f / s2).to(torch.float8_e4m3fn)
    w1 = mlp.dequantize_fp8(q1, s1, dtype)
    w2 = mlp.dequantize_fp8(q2, s2, dtype)
    assert torch.equal(w1, q1.to(dtype) * s1.to(dtype))
    x = _x(777, hidden, dtype)
    for chunk in (1, 100, 256, 776, 777, 5000):
        _assert_same(mlp.chunked_swiglu(x, w1, None, w2, None, chunk), x, w1, None, w2, None, chunk,
                     dtype, f"fp8-{dtype}-{chunk}")


def test_leading_batch_dims_and_out():
    hidden, ffn = 32, 48
    w1, b1, w2, b2 = _weights(hidden, ffn, torch.float32, bias=True)
    x = torch.randn(2, 3, 45, hidden)
    got = mlp.chunked_swiglu(x, w1, b1, w2, b2, 16)
    assert got.shape == (2, 3, 45, hidden)
    x2 = x.reshape(-1, hidden)
    _assert_same(got.reshape(-1, hidden), x2, w1, b1, w2, b2, 16, torch.float32, "batch16")
    out = torch.full((2, 3, 45, hidden), float("nan"))
    got2 = mlp.chunked_swiglu(x, w1, b1, w2, b2, 7, out=out)
    assert got2 is out
    _assert_same(out.reshape(-1, hidden), x2, w1, b1, w2, b2, 7, torch.float32, "batch7")


def test_out_must_be_contiguous_and_shaped():
    w1, b1, w2, b2 = _weights(8, 8, torch.float32)
    x = torch.randn(10, 8)
    with pytest.raises(ValueError):
        mlp.chunked_swiglu(x, w1, b1, w2, b2, 4, out=torch.empty(8, 10).t())
    with pytest.raises(ValueError):
        mlp.chunked_swiglu(x, w1, b1, w2, b2, 4, out=torch.empty(11, 8))


def test_rectangular_fc2_out_width():
    hidden, ffn = 32, 48
    w1 = torch.randn(2 * ffn, hidden)
    w2 = torch.randn(20, ffn)
    x = torch.randn(33, hidden)
    _assert_same(mlp.chunked_swiglu(x, w1, None, w2, None, 8), x, w1, None, w2, None, 8,
                 torch.float32, "rect")


def test_empty_sequence():
    hidden, ffn = 32, 48
    w1, b1, w2, b2 = _weights(hidden, ffn, torch.bfloat16, bias=True)
    x = torch.empty(0, hidden, dtype=torch.bfloat16)
    got = mlp.chunked_swiglu(x, w1, b1, w2, b2, 16)
    assert got.shape == (0, hidden) and got.dtype == torch.bfloat16
    got = mlp.chunked_swiglu(x, w1, b1, w2, b2, 0)
    assert got.shape == (0, hidden)


def test_swiglu_gate_is_first_half():
    h = torch.tensor([[1.0, -2.0, 3.0, 5.0]])  # gate = [1, -2], up = [3, 5]
    got = mlp.swiglu_inplace(h.clone())
    assert torch.equal(got, F.silu(torch.tensor([[1.0, -2.0]])) * torch.tensor([[3.0, 5.0]]))
    assert torch.equal(got, _swiglu_spec(h.clone()))


# ---------------------------------------------------------------------------------------
# plan_chunk
# ---------------------------------------------------------------------------------------
def test_plan_chunk_boundaries():
    hidden, ffn, b = 5376, 14336, 2
    per = mlp_plan.per_token_bytes(hidden, ffn, b)
    assert per == (3 * ffn + hidden) * b + ffn + hidden
    # S = 0, everything fits, exactly fits
    assert mlp_plan.plan_chunk(0, hidden, ffn, b, 1 << 30) == 0
    assert mlp_plan.plan_chunk(1000, hidden, ffn, b, per * 1000) == 1000
    assert mlp_plan.plan_chunk(1000, hidden, ffn, b, per * 1000 - 1) == 768
    # rounded down to a multiple of 256
    c = mlp_plan.plan_chunk(169000, hidden, ffn, b, 768 * 2 ** 20)
    assert c % 256 == 0 and c * per <= 768 * 2 ** 20 < (c + 256) * per
    # below 256 tokens: the largest count that fits, never < 1
    assert mlp_plan.plan_chunk(169000, hidden, ffn, b, per * 255) == 255
    assert mlp_plan.plan_chunk(169000, hidden, ffn, b, per * 256) == 256
    assert mlp_plan.plan_chunk(169000, hidden, ffn, b, per - 1) == 1
    assert mlp_plan.plan_chunk(169000, hidden, ffn, b, 0) == 1
    assert mlp_plan.plan_chunk(1, hidden, ffn, b, 0) == 1


def test_resolve_and_parse_chunk_setting():
    d = torch.device("cpu")
    assert mlp_plan.parse_chunk_setting("auto") == "auto"
    assert mlp_plan.parse_chunk_setting(" OFF ") == "off"
    assert mlp_plan.parse_chunk_setting("4096") == 4096
    assert mlp_plan.parse_chunk_setting(None) == "auto"
    for bad in (0, -3, "0", "lots", True, 1.5):
        with pytest.raises(ValueError):
            mlp_plan.parse_chunk_setting(bad)
    assert mlp_plan.resolve_chunk("off", 5000, 64, 128, torch.bfloat16, d) == 5000
    assert mlp_plan.resolve_chunk(300, 5000, 64, 128, torch.bfloat16, d) == 300
    assert mlp_plan.resolve_chunk(30000, 5000, 64, 128, torch.bfloat16, d) == 5000
    per = mlp_plan.per_token_bytes(64, 128, 2)
    assert mlp_plan.resolve_chunk("auto", 5000, 64, 128, torch.bfloat16, d, budget_bytes=per * 600) == 512
    assert mlp_plan.resolve_chunk("auto", 0, 64, 128, torch.bfloat16, d) == 0


# ---------------------------------------------------------------------------------------
# leases and fences (meta tensors: FenceBook ignores CPU tensors, CPU work is synchronous)
# ---------------------------------------------------------------------------------------
class FakeEvent:
    def __init__(self, log):
        self.done = False
        self.recorded = False
        self.log = log

    def record(self, stream=None):
        self.recorded = True
        self.log.append("record")

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


class TrackingLease(mlp.DenseLease):
    def __init__(self, weight, log, name, **kw):
        super().__init__(weight, None, **kw)
        self.log = log
        self.name = name
        self.uses = 0

    def apply(self, inp):
        self.uses += 1
        self.log.append(f"use:{self.name}")
        return super().apply(inp)

    def apply_into(self, inp, out):
        self.uses += 1
        self.log.append(f"use:{self.name}")
        return super().apply_into(inp, out)


def test_transient_weight_fenced_until_event_completes():
    log = []
    events = []

    def factory():
        ev = FakeEvent(log)
        events.append(ev)
        return ev

    book = FenceBook(event_factory=factory)
    hidden, ffn, S = 16, 24, 70
    # a "cast/dequant buffer" that only the lease references after this block
    w1 = torch.empty(2 * ffn, hidden, device="meta")
    w2 = torch.empty(hidden, ffn, device="meta")
    ref1 = weakref.ref(w1)
    released = []
    fc1 = TrackingLease(w1, log, "fc1", transients=[w1],
                        release=lambda: (log.append("release:fc1"), released.append("fc1")))
    fc2 = TrackingLease(w2, log, "fc2", transients=[w2],
                        release=lambda: (log.append("release:fc2"), released.append("fc2")))
    del w1, w2
    x = torch.empty(S, hidden, device="meta")
    stats = mlp.MlpStats()
    y = mlp.run_chunked_mlp(x, fc1, fc2, 16, fences=book, stats=stats)
    assert y.shape == (S, hidden)
    n_chunks = -(-S // 16)
    assert fc1.uses == fc2.uses == n_chunks and stats.chunks == n_chunks and stats.fenced == 1
    # one event, recorded after the last chunk's kernels, before ComfyUI's release path
    assert len(events) == 1
    last_use = max(i for i, e in enumerate(log) if e.startswith("use:"))
    assert log.index("record") > last_use
    assert log.index("record") < log.index("release:fc1") < log.index("release:fc2")
    # the lease is gone, yet the transient is alive: the fence holds it
    del fc1, fc2, y
    gc.collect()
    assert ref1() is not None and book.pending == 1
    assert book.poll() == 0 and ref1() is not None
    events[0].done = True
    assert book.poll() == 1
    gc.collect()
    assert ref1() is None and book.pending == 0


def test_leases_released_and_fenced_on_error():
    log = []
    book = FenceBook(event_factory=lambda: FakeEvent(log))
    w1 = torch.empty(8, 4, device="meta")

    class Boom(mlp.DenseLease):
        def apply_into(self, inp, out):
            raise RuntimeError("kernel launch failed")

    released = []
    fc1 = mlp.DenseLease(w1, None, transients=[w1], release=lambda: released.append(1))
    fc2 = Boom(torch.empty(4, 4, device="meta"), None, release=lambda: released.append(2))
    with pytest.raises(RuntimeError):
        mlp.run_chunked_mlp(torch.empty(10, 4, device="meta"), fc1, fc2, 3, fences=book)
    assert released == [1, 2] and book.pending == 1


def test_no_fence_without_transients():
    book = FenceBook(event_factory=lambda: pytest.fail("no event expected"))
    w1, b1, w2, b2 = _weights(8, 8, torch.float32)
    x = torch.randn(20, 8)
    y = mlp.run_chunked_mlp(x, mlp.DenseLease(w1, b1), mlp.DenseLease(w2, b2), 6, fences=book)
    _assert_same(y, x, w1, b1, w2, b2, 6, torch.float32, "nofence")


def test_safe_ops_mlp_does_not_import_comfy():
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import sys; import safe_ops.mlp as m; "
            "assert not any(k == 'comfy' or k.startswith('comfy.') for k in sys.modules), "
            "[k for k in sys.modules if k.startswith('comfy')]")
    env = dict(os.environ, PYTHONPATH=root)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env=env)


def test_install_on_non_h3_model():
    class P:
        def __init__(self, dm):
            self.model = type("BaseModel", (), {})()
            self.model.diffusion_model = dm
            self.object_patches = {}

        def add_object_patch(self, k, v):
            self.object_patches[k] = v

    p = P(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    r = mlp_patch.install_h3_mlp_patches(p, "auto")
    assert r["patched"] == 0 and "not a MiniMax H3 model" in r["skipped"] and r["conflicts"] == []
    assert p.object_patches == {}
    r = mlp_patch.install_h3_mlp_patches(object(), "auto")
    assert r["patched"] == 0 and r["skipped"]


def test_quantising_fc2_gets_contiguous_swiglu_without_extra_copy():
    """An fc2 lease that needs a contiguous input (the quantised paths) receives the SwiGLU
    made out of place (ComfyUI's _swiglu_eager op order: a new contiguous tensor), not the
    strided in-place view plus a ``.contiguous()`` copy; fc1's output is left as it was.
    A dense fc2 gets the in-place view (no new tensor)."""
    hidden, ffn = 16, 24
    w1, _, w2, _ = _weights(hidden, ffn, torch.float32)
    x = torch.randn(10, hidden)
    seen = []

    class Fc1(mlp.DenseLease):
        def apply(self, inp):
            h = super().apply(inp)
            seen.append(("h", h, h.clone()))
            return h

    def fc2_fn(inp):
        seen.append(("inp", inp, None))
        return F.linear(inp, w2)

    class Fc2(mlp.DenseLease):
        def apply(self, inp):
            seen.append(("inp", inp, None))
            return super().apply(inp)

        def apply_into(self, inp, out):
            seen.append(("inp", inp, None))
            super().apply_into(inp, out)

    for fc2 in (mlp.CallableLease(fc2_fn), Fc2(w2)):
        seen.clear()
        y = mlp.run_chunked_mlp(x, Fc1(w1), fc2, 4)
        assert torch.equal(y, mlp.chunked_swiglu(x, w1, None, w2, None, 4))
        hs = [(t, before) for kind, t, before in seen if kind == "h"]
        inps = [t for kind, t, _ in seen if kind == "inp"]
        assert len(hs) == len(inps) == 3
        for (h, before), inp in zip(hs, inps):
            if isinstance(fc2, mlp.CallableLease):
                assert inp.is_contiguous() and inp.data_ptr() != h.data_ptr()
                assert torch.equal(h, before), "fc1's output was written"
            else:
                assert not inp.is_contiguous() and inp.data_ptr() == h.data_ptr()
