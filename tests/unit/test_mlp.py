"""CPU tests of safe_ops.models.h3.mlp's pure-torch chunk loop and safe_ops.models.h3.mlp_plan (no ComfyUI needed).

Numerics. Every step of the MLP is row independent, so a chunked MLP equals the same math run
per chunk BITWISE (same code, same shapes), and equals the unchunked MLP within the tolerance
that this machine's matmul row-count sensitivity gives (tests/unit/rowcount.py: measured per
case, bitwise where the backend is row-count independent here). test_mlp_comfy.py does the same
with ComfyUI's own MLP.
"""
import pytest
import torch
import torch.nn.functional as F

from safe_ops.models.h3 import mlp, mlp_patch, mlp_plan, mlp_reference

from rowcount import assert_within, mlp_tolerance, per_chunk


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


def _assert_same(got, x, w1, b1, w2, b2, chunk, dtype, tag):
    ref = _reference(x, w1, b1, w2, b2)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    c = max(1, min(chunk, x.shape[0]))
    # 1. same code, same shapes: bitwise, always
    assert torch.equal(got, per_chunk(lambda t: _reference(t, w1, b1, w2, b2), x, c)), tag
    # 2. vs unchunked: within this machine's measured row-count sensitivity (0: bitwise)
    tol = mlp_tolerance(lambda t: F.linear(t, w1, b1), lambda h: F.linear(_swiglu_spec(h), w2, b2), x, c)
    assert_within(got, ref, tol, tag)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("S,chunk", [(1000, 256), (999, 256), (997, 100), (37, 1), (50, 64), (256, 256), (513, 512)])
def test_chunked_equals_unchunked(dtype, bias, S, chunk):
    hidden, ffn = 64, 96
    w1, b1, w2, b2 = _weights(hidden, ffn, dtype, bias)
    x = _x(S, hidden, dtype)
    got = mlp_reference.chunked_swiglu(x, w1, b1, w2, b2, chunk)
    _assert_same(got, x, w1, b1, w2, b2, chunk, dtype, f"{dtype}-{bias}-{S}-{chunk}")


def test_leading_batch_dims_and_out():
    hidden, ffn = 32, 48
    w1, b1, w2, b2 = _weights(hidden, ffn, torch.float32, bias=True)
    x = torch.randn(2, 3, 45, hidden)
    got = mlp_reference.chunked_swiglu(x, w1, b1, w2, b2, 16)
    assert got.shape == (2, 3, 45, hidden)
    x2 = x.reshape(-1, hidden)
    _assert_same(got.reshape(-1, hidden), x2, w1, b1, w2, b2, 16, torch.float32, "batch16")
    out = torch.full((2, 3, 45, hidden), float("nan"))
    got2 = mlp_reference.chunked_swiglu(x, w1, b1, w2, b2, 7, out=out)
    assert got2 is out
    _assert_same(out.reshape(-1, hidden), x2, w1, b1, w2, b2, 7, torch.float32, "batch7")


def test_out_must_be_contiguous_and_shaped():
    w1, b1, w2, b2 = _weights(8, 8, torch.float32)
    x = torch.randn(10, 8)
    with pytest.raises(ValueError):
        mlp_reference.chunked_swiglu(x, w1, b1, w2, b2, 4, out=torch.empty(8, 10).t())
    with pytest.raises(ValueError):
        mlp_reference.chunked_swiglu(x, w1, b1, w2, b2, 4, out=torch.empty(11, 8))


def test_rectangular_fc2_out_width():
    hidden, ffn = 32, 48
    w1 = torch.randn(2 * ffn, hidden)
    w2 = torch.randn(20, ffn)
    x = torch.randn(33, hidden)
    _assert_same(mlp_reference.chunked_swiglu(x, w1, None, w2, None, 8), x, w1, None, w2, None, 8,
                 torch.float32, "rect")


def test_empty_sequence():
    hidden, ffn = 32, 48
    w1, b1, w2, b2 = _weights(hidden, ffn, torch.bfloat16, bias=True)
    x = torch.empty(0, hidden, dtype=torch.bfloat16)
    got = mlp_reference.chunked_swiglu(x, w1, b1, w2, b2, 16)
    assert got.shape == (0, hidden) and got.dtype == torch.bfloat16
    got = mlp_reference.chunked_swiglu(x, w1, b1, w2, b2, 0)
    assert got.shape == (0, hidden)


def test_reference_swiglu_gate_is_first_half():
    eye = torch.eye(4)
    got = mlp_reference.reference_swiglu(torch.tensor([[1.0, -2.0, 3.0, 5.0]]), eye, None, torch.eye(2), None)
    # gate = [1, -2], up = [3, 5]
    assert torch.equal(got, F.silu(torch.tensor([[1.0, -2.0]])) * torch.tensor([[3.0, 5.0]]))


def test_run_chunked_covers_every_row_once_in_order():
    x = torch.arange(23 * 3, dtype=torch.float32).reshape(23, 3)
    seen = []

    def fn(t):
        seen.append(t.shape[0])
        return t[:, :2] * 2
    y = mlp.run_chunked(fn, x, 5)
    assert seen == [5, 5, 5, 5, 3] and torch.equal(y, x[:, :2] * 2)
    seen.clear()
    assert torch.equal(mlp.run_chunked(fn, x, 0), x[:, :2] * 2) and seen == [23]   # <= 0: one chunk
    with pytest.raises(RuntimeError):
        mlp.run_chunked(lambda t: (_ for _ in ()).throw(RuntimeError("chunk failed")), x, 5)


# ---------------------------------------------------------------------------------------
# plan_chunk
# ---------------------------------------------------------------------------------------
def test_plan_chunk_boundaries():
    hidden, ffn, b = 5376, 14336, 2
    per = mlp_plan.per_token_bytes(hidden, ffn, b)      # held to the H200 measurements in test_preflight_report.py
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


def test_safe_ops_mlp_does_not_import_comfy():
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import sys; import safe_ops.models.h3.mlp as m; "
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
