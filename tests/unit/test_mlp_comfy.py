"""safe_ops.mlp against ComfyUI's own classes (CPU).

Needs a ComfyUI tree with MiniMax H3 (0dd9b154 or newer): set COMFYUI_PATH (`bash .ci/run` does,
in its 0dd9b154 pass, where .ci/check_junit.py requires every test here to run). Without it
every test here is skipped with the reason printed.

What is proved here:
* the chunked forward returns ComfyUI's numbers (unpatched ``MLP.forward``) for manual_cast
  Linears, LoRA-style ``weight_function``s and fp8 / INT8 ``QuantizedTensor`` weights;
* each branch of ``comfy.ops.linear_input_act`` that the chunk loop re-implements (the eager
  SwiGLU + fc2 forward, the INT8 fused SwiGLU) gives what ComfyUI's own ``linear_input_act``
  gives on the same fc1 output; the branches it does not re-implement (INT8 with
  ``_full_precision_mm``, later ComfyUI's fp16-accumulation ``ck.fp16_linear``) run
  ComfyUI's unchunked MLP with a counted, logged reason;
* ``comfy.ops.cast_bias_weight`` is called once per Linear per MLP call (2 per call), where
  calling the layers per chunk casts (and runs the LoRA function) once per chunk;
* transient weights go to ``FenceBook.hold`` after the last chunk and before
  ``comfy.ops.uncast_bias_weight``;
* install on a real ``comfy.model_patcher.ModelPatcher``: every H3 MLP of a tiny
  MiniMaxH3Model patched on a clone, ``patch_model`` / ``unpatch_model`` (with a LoRA weight
  patch) route calls through the chunked forward and back, idempotent, foreign patches
  reported.
"""
import json
import logging
import os
import sys

import pytest
import torch
import torch.nn.functional as F

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
if not COMFYUI_PATH or not os.path.isfile(os.path.join(COMFYUI_PATH, "comfy", "ops.py")):
    _reason = "COMFYUI_PATH not set (point it at a ComfyUI tree with MiniMax H3, e.g. 0dd9b154)"
    print(f"\n[test_mlp_comfy] skipped: {_reason}")
    pytest.skip(_reason, allow_module_level=True)

if COMFYUI_PATH not in sys.path:
    sys.path.insert(0, COMFYUI_PATH)
import comfy.cli_args

comfy.cli_args.args.cpu = True  # before comfy.model_management is imported
try:
    import comfy.model_management
    import comfy.model_patcher
    import comfy.ops
    from comfy.quant_ops import QuantizedTensor
except Exception as e:  # pragma: no cover - environment
    print(f"\n[test_mlp_comfy] skipped: ComfyUI import failed: {e!r}")
    pytest.skip(f"ComfyUI import failed: {e!r}", allow_module_level=True)
try:
    import comfy.ldm.minimax.model as h3
except Exception as e:  # pragma: no cover - environment
    print(f"\n[test_mlp_comfy] skipped: comfy.ldm.minimax.model does not import: {e!r}")
    pytest.skip(f"comfy.ldm.minimax.model does not import: {e!r}", allow_module_level=True)
if getattr(comfy.ops, "linear_input_act", None) is None:  # pragma: no cover
    pytest.skip("this ComfyUI has no comfy.ops.linear_input_act", allow_module_level=True)

from safe_ops import h3, mlp, mlp_patch
from safe_ops.fences import FenceBook

HIDDEN, FFN = 64, 96


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------
class CastCounter:
    """Counts comfy.ops.cast_bias_weight / uncast_bias_weight calls (all callers: the layers
    look the names up in comfy.ops' globals at call time)."""

    def __init__(self, monkeypatch, log=None):
        self.casts = 0
        self.uncasts = 0
        self.log = log if log is not None else []
        cast, uncast = comfy.ops.cast_bias_weight, comfy.ops.uncast_bias_weight

        def counted_cast(*a, **k):
            self.casts += 1
            self.log.append("cast")
            return cast(*a, **k)

        def counted_uncast(*a, **k):
            self.uncasts += 1
            self.log.append("uncast")
            return uncast(*a, **k)

        monkeypatch.setattr(comfy.ops, "cast_bias_weight", counted_cast)
        monkeypatch.setattr(comfy.ops, "uncast_bias_weight", counted_uncast)


def _init_linear(lin, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(lin.out_features, lin.in_features, generator=g) * lin.in_features ** -0.5
    lin.weight = torch.nn.Parameter(w.to(dtype), requires_grad=False)
    if lin.bias is not None:
        lin.bias = torch.nn.Parameter(torch.zeros(lin.out_features, dtype=dtype), requires_grad=False)


def manual_cast_mlp(dtype=torch.bfloat16, weight_dtype=None):
    m = h3.MLP(HIDDEN, FFN, dtype=dtype, device="cpu", operations=comfy.ops.manual_cast)
    _init_linear(m.fc1, weight_dtype or dtype, 1)
    _init_linear(m.fc2, weight_dtype or dtype, 2)
    return m


def _fp8_state(lin, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(lin.out_features, lin.in_features, generator=g) * lin.in_features ** -0.5
    scale = w.abs().amax() / 448.0
    return {
        "weight": (w / scale).to(torch.float8_e4m3fn),
        "weight_scale": scale.float(),
        "comfy_quant": torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()), dtype=torch.uint8),
    }


def fp8_mlp(compute_dtype=torch.bfloat16, disabled=()):
    ops = comfy.ops.mixed_precision_ops({}, compute_dtype=compute_dtype, disabled=set(disabled))
    m = h3.MLP(HIDDEN, FFN, dtype=compute_dtype, device="cpu", operations=ops)
    m.fc1.load_state_dict(_fp8_state(m.fc1, 11), strict=False)
    m.fc2.load_state_dict(_fp8_state(m.fc2, 12), strict=False)
    assert isinstance(m.fc1.weight, QuantizedTensor) and m.fc1.layout_type
    return m


def _x(S, dtype=torch.bfloat16, seed=5):
    return torch.randn(S, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _unpatched(m, x):
    return type(m).forward(m, x)


def _per_chunk_unpatched(m, x, chunk):
    return torch.cat([_unpatched(m, x[a:a + chunk]) for a in range(0, x.shape[0], chunk)])


def _check_equal(got, m, x, chunk):
    """Bitwise vs ComfyUI's unpatched forward; where the CPU matmul is not row independent
    (see test_mlp.py) bitwise vs ComfyUI's forward run per chunk and 1e-5 rel vs unchunked."""
    ref = _unpatched(m, x)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    if torch.equal(got, ref):
        return 0.0
    assert torch.equal(got, _per_chunk_unpatched(m, x, chunk))
    err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert err <= 1e-5
    return err


@pytest.fixture
def stats():
    return mlp.MlpStats()


# ---------------------------------------------------------------------------------------
# numerics + casts
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_manual_cast_chunked_equals_unpatched_one_cast_per_linear(monkeypatch, stats, dtype):
    m = manual_cast_mlp(dtype)
    x = _x(333, dtype)
    cc = CastCounter(monkeypatch)
    y = mlp.h3_mlp_forward(m, x, 64, fences=None, stats=stats)
    n_chunks = -(-333 // 64)
    assert cc.casts == 2 and cc.uncasts == 2, "one cast per Linear per MLP call"
    assert stats.casts == 2 and stats.chunks == n_chunks and stats.chunked_calls == 1
    # the naive alternative (ComfyUI's layers called per chunk) casts once per chunk
    cc.casts = 0
    _per_chunk_unpatched(m, x, 64)
    assert cc.casts == 2 * n_chunks
    _check_equal(y, m, x, 64)


def test_weight_function_lora_runs_once_per_call(monkeypatch, stats):
    """A LoRA weight_function makes every ComfyUI Linear call re-patch the weight."""
    m = manual_cast_mlp(torch.bfloat16)
    calls = {"fc1": 0, "fc2": 0}
    deltas = {}
    for name in ("fc1", "fc2"):
        lin = getattr(m, name)
        d = torch.randn(lin.weight.shape, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16) * 0.01
        deltas[name] = d

        def fn(w, name=name, d=d):
            calls[name] += 1
            return w + d
        lin.weight_function = [fn]
    x = _x(500)
    cc = CastCounter(monkeypatch)
    y = mlp.h3_mlp_forward(m, x, 128, fences=None, stats=stats)
    assert calls == {"fc1": 1, "fc2": 1} and cc.casts == 2
    calls.update(fc1=0, fc2=0)
    _check_equal(y, m, x, 128)
    assert calls["fc1"] == 1  # the unpatched reference, once
    calls.update(fc1=0, fc2=0)
    _per_chunk_unpatched(m, x, 128)
    assert calls == {"fc1": 4, "fc2": 4}


def test_fp8_quantized_weights_native_path(monkeypatch, stats):
    """mixed_precision_ops fp8: the quantised matmul (comfy-kitchen _scaled_mm) runs per chunk
    on the ONE cast weight; no dequantisation; ComfyUI's numbers."""
    m = fp8_mlp()
    x = _x(700)
    cc = CastCounter(monkeypatch)
    y = mlp.h3_mlp_forward(m, x, 256, fences=None, stats=stats)
    assert cc.casts == 2 and stats.dequants == 0
    assert torch.equal(y, _unpatched(m, x))


def test_fp8_fallback_dequantises_once(monkeypatch, stats):
    """Where comfy-kitchen would fall back to dequantising inside every call, the weight is
    dequantised ONCE and each chunk computes what that fallback computes."""
    m = fp8_mlp()
    x = _x(300)
    key = mlp._fp8_probe_key(m.fc1.weight, x.device)
    monkeypatch.setitem(mlp._FP8_NATIVE, key, False)
    deq = {"n": 0}
    orig = QuantizedTensor.dequantize

    def counting(self, *a, **k):
        if self._qdata.shape in ((2 * FFN, HIDDEN), (HIDDEN, FFN)):
            deq["n"] += 1
        return orig(self, *a, **k)
    monkeypatch.setattr(QuantizedTensor, "dequantize", counting)
    cc = CastCounter(monkeypatch)
    y = mlp.h3_mlp_forward(m, x, 50, fences=None, stats=stats)   # 50 rows: no input matches a weight shape
    assert cc.casts == 2 and stats.dequants == 2 and deq["n"] == 2
    w1, w2 = orig(m.fc1.weight), orig(m.fc2.weight)
    q = comfy.ops.QuantizedTensor.from_float
    h = F.linear(q(x, m.fc1.layout_type, scale=None).dequantize(), w1)
    gate, up = h.chunk(2, -1)
    ref = F.linear(q(F.silu(gate).mul_(up), m.fc2.layout_type, scale=None).dequantize(), w2)
    assert torch.equal(y, ref)


def test_fp8_emulated_gpu_without_fp8_compute_dequantises_once(monkeypatch, stats):
    """pick_operations on a GPU without fp8 compute disables float8 -> _full_precision_mm:
    every ComfyUI call runs F.linear(bf16, QuantizedTensor), which comfy-kitchen answers by
    dequantising the weight inside the call. Chunked: dequantised once per MLP call."""
    m = fp8_mlp(disabled=("float8_e4m3fn", "float8_e5m2"))
    assert m.fc1._full_precision_mm
    deq = {"n": 0}
    orig = QuantizedTensor.dequantize

    def counting(self, *a, **k):
        deq["n"] += 1
        return orig(self, *a, **k)
    monkeypatch.setattr(QuantizedTensor, "dequantize", counting)
    x = _x(300)
    cc = CastCounter(monkeypatch)
    y = mlp.h3_mlp_forward(m, x, 50, fences=None, stats=stats)
    assert cc.casts == 2 and stats.dequants == 2 and deq["n"] == 2
    deq["n"] = 0
    _per_chunk_unpatched(m, x, 50)
    assert deq["n"] == 2 * 6, "ComfyUI's layers per chunk would dequantise per chunk"
    _check_equal(y, m, x, 50)


def test_fp8_with_lora_dequantised_in_cast_once(monkeypatch, stats):
    m = fp8_mlp()
    n = {"c": 0}

    def fn(w):
        n["c"] += 1
        return w * 1.01
    m.fc1.weight_function = [fn]
    x = _x(400)
    cc = CastCounter(monkeypatch)
    y = mlp.h3_mlp_forward(m, x, 100, fences=None, stats=stats)
    assert cc.casts == 2 and n["c"] == 1
    _check_equal(y, m, x, 100)


def _int8_state(lin, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(lin.out_features, lin.in_features, generator=g) * lin.in_features ** -0.5
    scale = w.abs().amax() / 127.0
    return {
        "weight": (w / scale).round().clamp(-127, 127).to(torch.int8),
        "weight_scale": scale.float(),
        "comfy_quant": torch.tensor(list(json.dumps({"format": "int8_tensorwise"}).encode()), dtype=torch.uint8),
    }


def int8_mlp():
    ops = comfy.ops.mixed_precision_ops({}, compute_dtype=torch.bfloat16)
    m = h3.MLP(HIDDEN, FFN, dtype=torch.bfloat16, device="cpu", operations=ops)
    m.fc1.load_state_dict(_int8_state(m.fc1, 1), strict=False)
    m.fc2.load_state_dict(_int8_state(m.fc2, 2), strict=False)
    assert m.fc2.weight._layout_cls == "TensorWiseINT8Layout"
    return m


def _spy_int8_linear(monkeypatch):
    """Records the input_act of every comfy-kitchen int8_linear call (the fused INT8 branch)."""
    ck = comfy.ops.quant_ops.ck
    acts = []
    real = ck.int8_linear

    def spy(*a, **k):
        acts.append(k.get("input_act"))
        return real(*a, **k)
    monkeypatch.setattr(ck, "int8_linear", spy)
    return acts


def test_int8_fused_swiglu_fc2_per_chunk(monkeypatch, stats):
    """linear_input_act's INT8 path (SwiGLU fused into fc2's per-row INT8 input quantiser):
    kept, per chunk, on the one cast weight; bitwise equal (per-row quantisation)."""
    m = int8_mlp()
    acts = _spy_int8_linear(monkeypatch)
    x = _x(300)
    cc = CastCounter(monkeypatch)
    y = mlp.h3_mlp_forward(m, x, 64, fences=None, stats=stats)
    assert cc.casts == 2 and acts == ["swiglu"] * 5
    assert torch.equal(y, _unpatched(m, x))


# ---------------------------------------------------------------------------------------
# fences and release order
# ---------------------------------------------------------------------------------------
class SpyBook(FenceBook):
    def __init__(self, log):
        super().__init__(event_factory=lambda: pytest.fail("CPU tensors are not fenced"))
        self.log = log
        self.held = []

    def hold(self, tensors, stream=None, label=""):
        tensors = list(tensors)
        self.held.append(tensors)
        self.log.append("hold")
        return super().hold(tensors, stream, label)


def test_transients_handed_to_fence_before_comfy_release(monkeypatch, stats):
    m = manual_cast_mlp(torch.bfloat16)
    m.fc1.weight_function = [lambda w: w * 2]   # forces a transient (patched copy) for fc1
    log = []
    cc = CastCounter(monkeypatch, log)
    book = SpyBook(log)
    mlp.h3_mlp_forward(m, _x(300), 100, fences=book, stats=stats)
    assert log == ["cast", "cast", "hold", "uncast", "uncast"]
    assert cc.casts == 2 and stats.fenced == 1
    held = book.held[0]
    assert held and all(isinstance(t, torch.Tensor) for t in held)
    assert not any(t is m.fc1.weight or t is m.fc2.weight for t in held), "parameters are not transients"
    assert any(t.shape == m.fc1.weight.shape for t in held), "fc1's patched copy is fenced"


def test_interrupt_between_chunks_releases_through_comfy(monkeypatch, stats):
    """ComfyUI's interrupt check (run_every_op) runs before every chunk; when it throws, the
    transients are still fenced and both weights given back through uncast_bias_weight."""
    m = manual_cast_mlp(torch.bfloat16)
    m.fc1.weight_function = [lambda w: w * 2]
    log = []
    CastCounter(monkeypatch, log)
    n = {"c": 0}

    class Interrupted(Exception):
        pass

    def run_every_op():
        n["c"] += 1
        if n["c"] == 3:
            raise Interrupted()
    monkeypatch.setattr(comfy.ops, "run_every_op", run_every_op)
    book = SpyBook(log)
    with pytest.raises(Interrupted):
        mlp.h3_mlp_forward(m, _x(300), 50, fences=book, stats=stats)
    assert log == ["cast", "cast", "hold", "uncast", "uncast"] and stats.chunks == 0


def test_shared_cast_buffer_falls_back(monkeypatch, stats):
    """If ComfyUI hands fc1 and fc2 out of the same cast buffer (one offload stream), fc2's
    copy would overwrite fc1's weight: give both back, run ComfyUI's forward, count it."""
    m = manual_cast_mlp(torch.float32)
    shared = torch.empty(2 * FFN * HIDDEN + 16)
    real = comfy.ops.cast_bias_weight

    def fake(s, input=None, dtype=None, device=None, bias_dtype=None, offloadable=False, **kw):
        w = shared[: s.weight.numel()].view(s.weight.shape)
        w.copy_(s.weight)
        return w, None, (object(), shared, None)
    monkeypatch.setattr(comfy.ops, "cast_bias_weight", fake)
    released = []
    monkeypatch.setattr(comfy.ops, "uncast_bias_weight", lambda *a: released.append(a[0]))
    x = _x(200, torch.float32)
    y = mlp.h3_mlp_forward(m, x, 50, fences=None, stats=stats)
    # ours given back first, then ComfyUI's own forward casts/releases per layer as usual
    assert released == [m.fc1, m.fc2, m.fc1, m.fc2]
    assert stats.fallbacks == {"fc1 and fc2 cast into the same buffer": 1} and stats.chunked_calls == 0
    monkeypatch.setattr(comfy.ops, "cast_bias_weight", real)
    assert torch.equal(y, _unpatched(m, x))


def _ran_comfys_own_mlp(monkeypatch, m, x, chunk, stats):
    """h3_mlp_forward on m, recording which comfy.ops entry points ran."""
    seen = []
    real = comfy.ops.linear_input_act

    def spy(linear, h, act, *a, **k):
        seen.append((linear is m.fc2, tuple(h.shape), act))
        return real(linear, h, act, *a, **k)
    monkeypatch.setattr(comfy.ops, "linear_input_act", spy)
    y = mlp.h3_mlp_forward(m, x, chunk, fences=None, stats=stats)
    monkeypatch.setattr(comfy.ops, "linear_input_act", real)
    return y, seen


def test_passthrough_and_unsupported(monkeypatch, stats):
    """Tokens within one chunk, "off", and a Linear class whose forward is not reproduced: ComfyUI's
    own MLP.forward runs once over all tokens (its linear_input_act on the full fc1 output)."""
    m = manual_cast_mlp(torch.bfloat16)
    x = _x(100)
    cc = CastCounter(monkeypatch)
    _y, seen = _ran_comfys_own_mlp(monkeypatch, m, x, 100, stats)
    assert seen == [(True, (100, 2 * FFN), "swiglu")]
    assert stats.passthrough == 1 and stats.chunked_calls == 0 and stats.chunks == 0 and stats.casts == 0
    assert cc.casts == 2, "ComfyUI's own layers cast (once each, unchunked)"
    _y, seen = _ran_comfys_own_mlp(monkeypatch, m, x, "off", stats)
    assert seen == [(True, (100, 2 * FFN), "swiglu")] and stats.passthrough == 2 and stats.chunks == 0
    # a Linear class that overrides the cast forward (e.g. legacy fp8_ops): ComfyUI's forward, counted
    m2 = h3.MLP(HIDDEN, FFN, dtype=torch.bfloat16, device="cpu", operations=comfy.ops.fp8_ops)
    _init_linear(m2.fc1, torch.bfloat16, 1)
    _init_linear(m2.fc2, torch.bfloat16, 2)
    _y, seen = _ran_comfys_own_mlp(monkeypatch, m2, x, 16, stats)
    assert seen == [(True, (100, 2 * FFN), "swiglu")]
    assert [k for k in stats.fallbacks if "overrides the cast forward" in k]
    assert stats.casts == 0 and stats.chunks == 0, "nothing cast before deciding to fall back"


# ---------------------------------------------------------------------------------------
# each linear_input_act branch: the pack's per-chunk version vs ComfyUI's own function
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_swiglu_matches_comfy_swiglu_eager(dtype):
    """The in-place SwiGLU of the chunk loop vs ComfyUI's _swiglu_eager (what linear_input_act
    applies for "swiglu"): bitwise, gate = first half."""
    h = torch.randn(37, 2 * FFN, generator=torch.Generator().manual_seed(3)).to(dtype) * 4
    want = comfy.ops.INPUT_ACT_EAGER["swiglu"](h.clone())
    assert comfy.ops.INPUT_ACT_EAGER["swiglu"] is comfy.ops._swiglu_eager
    got = mlp.swiglu_inplace(h.clone())
    assert got.shape == want.shape == (37, FFN) and torch.equal(got, want)
    assert not torch.equal(got, mlp.swiglu_inplace(h.roll(FFN, dims=-1).clone())), "halves are not symmetric"
    # the variant for an fc2 that quantises its input: contiguous, same bits, input untouched
    src = h.clone()
    got_c = mlp.swiglu_contiguous(src)
    assert got_c.is_contiguous() and torch.equal(got_c, want) and torch.equal(src, h)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_fp8_matches_comfy_kitchen(dtype):
    """safe_ops.mlp.dequantize_fp8 (bench/bench_mlp.py's weights) vs comfy-kitchen's own
    dequantize_per_tensor_fp8, the one ComfyUI's fp8 QuantizedTensor uses: bitwise."""
    ck = comfy.ops.quant_ops.ck
    state = _fp8_state(torch.nn.Linear(HIDDEN, 2 * FFN), 17)
    q, scale = state["weight"], state["weight_scale"]
    want = ck.dequantize_per_tensor_fp8(q, scale, dtype)
    got = mlp.dequantize_fp8(q, scale, dtype)
    assert got.dtype == want.dtype == dtype and torch.equal(got, want)


def _lora_int8_mlp():
    m = int8_mlp()
    d = torch.randn(m.fc2.weight.shape, generator=torch.Generator().manual_seed(8)) * 1e-3
    m.fc2.weight_function = [lambda w: w + d.to(w.dtype)]
    return m


def _lora_manual_mlp():
    m = manual_cast_mlp(torch.bfloat16)
    d = (torch.randn(m.fc2.weight.shape, generator=torch.Generator().manual_seed(8)) * 1e-2).to(torch.bfloat16)
    m.fc2.weight_function = [lambda w: w + d]
    return m


FC2_KINDS = {
    # kind: (MLP factory, the linear_input_act branch ComfyUI takes for fc2)
    "manual_cast_bf16": (lambda: manual_cast_mlp(torch.bfloat16), "eager"),
    "manual_cast_fp32_weights_bf16": (lambda: manual_cast_mlp(torch.bfloat16, torch.float32), "eager"),
    "manual_cast_lora": (_lora_manual_mlp, "eager"),
    "fp8_native": (lambda: fp8_mlp(), "eager"),
    "fp8_full_precision_mm": (lambda: fp8_mlp(disabled=("float8_e4m3fn", "float8_e5m2")), "eager"),
    "int8_fused": (lambda: int8_mlp(), "int8"),
    "int8_lora_dequantised": (_lora_int8_mlp, "int8-cast-dequantised"),
}


@pytest.mark.parametrize("kind", sorted(FC2_KINDS))
def test_fc2_branch_matches_comfy_linear_input_act(monkeypatch, kind):
    """fc2 = linear_input_act(fc2, h, "swiglu"): the pack's lease (cast once) applied per chunk by
    run_chunked_mlp vs ComfyUI's own linear_input_act on the same fc1 output h, all tokens."""
    make, branch = FC2_KINDS[kind]
    m = make()
    S, chunk = 300, 64
    h = (torch.randn(S, 2 * FFN, generator=torch.Generator().manual_seed(21)) * 2).to(torch.bfloat16)
    int8_calls = _spy_int8_linear(monkeypatch)
    want = comfy.ops.linear_input_act(m.fc2, h.clone(), "swiglu")
    assert int8_calls == (["swiglu"] if branch == "int8" else []), "ComfyUI took the expected branch"
    int8_calls.clear()

    stats = mlp.MlpStats()
    cc = CastCounter(monkeypatch)
    fc2 = mlp.swiglu_fc2_lease(m.fc2, h.dtype, h.device, FFN, stats)
    identity = mlp.CallableLease(lambda t: t.clone())   # the chunk loop's fc1 step: h itself
    got = mlp.run_chunked_mlp(h, identity, fc2, chunk, stats=stats)
    assert cc.casts == 1 and cc.uncasts == 1, "fc2 cast once for all chunks"
    assert int8_calls == (["swiglu"] * -(-S // chunk) if branch == "int8" else [])
    assert got.shape == want.shape and got.dtype == want.dtype
    if not torch.equal(got, want):
        # CPU matmul not row independent at these shapes (see test_mlp.py): ComfyUI per chunk
        per_chunk = torch.cat([comfy.ops.linear_input_act(m.fc2, h[a:a + chunk].clone(), "swiglu")
                               for a in range(0, S, chunk)])
        assert torch.equal(got, per_chunk), kind
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        assert err <= 1e-5, (kind, err)


def test_int8_fc2_with_full_precision_mm_falls_back_counted_and_logged(monkeypatch, stats, caplog):
    """0dd9b154's linear_input_act ignores _full_precision_mm on an INT8 fc2, later ComfyUI takes
    the eager path: not reproduced, so ComfyUI's own MLP runs, with a counted, logged reason."""
    m = int8_mlp()
    m.fc2._full_precision_mm = True
    x = _x(300)
    with caplog.at_level(logging.WARNING, logger="SafeSage.mlp"):
        _y, seen = _ran_comfys_own_mlp(monkeypatch, m, x, 64, stats)
    reason = "INT8 fc2 with full_precision_mm (linear_input_act's branch differs by ComfyUI version)"
    assert stats.fallbacks == {reason: 1} and stats.chunks == 0 and stats.chunked_calls == 0
    assert seen == [(True, (300, 2 * FFN), "swiglu")], "ComfyUI's MLP over all tokens"
    assert any(reason in r.getMessage() for r in caplog.records)


def test_fp16_linear_branch_of_later_comfy_falls_back(monkeypatch, stats, caplog):
    """Later ComfyUI's linear_input_act sends fc2 through ck.fp16_linear when
    comfy.ops._fp16_linear_wanted(x) (fp16 CUDA + fp16 accumulation). Simulated here on CPU:
    the chunk loop does not reproduce that kernel, so ComfyUI's MLP runs, counted and logged;
    a quantised fc2 (which that branch does not take) still runs chunked."""
    m = manual_cast_mlp(torch.float16)
    x = _x(300, torch.float16)
    asked = []
    monkeypatch.setattr(comfy.ops, "_fp16_linear_wanted", lambda t: asked.append(t.dtype) or True, raising=False)
    with caplog.at_level(logging.WARNING, logger="SafeSage.mlp"):
        _y, seen = _ran_comfys_own_mlp(monkeypatch, m, x, 64, stats)
    assert asked and stats.chunks == 0 and len(stats.fallbacks) == 1
    (reason,) = stats.fallbacks
    assert "fp16_linear" in reason and any(reason in r.getMessage() for r in caplog.records)
    assert seen == [(True, (300, 2 * FFN), "swiglu")]
    q = fp8_mlp(compute_dtype=torch.float16)
    mlp.h3_mlp_forward(q, x, 64, fences=None, stats=stats)
    assert stats.chunked_calls == 1 and stats.chunks == 5 and len(stats.fallbacks) == 1

    def broken(t):
        raise TypeError("new signature")
    monkeypatch.setattr(comfy.ops, "_fp16_linear_wanted", broken)
    mlp.h3_mlp_forward(m, x, 64, fences=None, stats=stats)
    assert any("_fp16_linear_wanted failed" in k for k in stats.fallbacks), stats.fallbacks


# ---------------------------------------------------------------------------------------
# installation
# ---------------------------------------------------------------------------------------
H3_CONFIG = dict(
    hidden_size=64, num_layers=2, token_refiner_num_layers=1, num_attention_heads=2,
    attention_head_dim=32, ffn_hidden_size=128, latents_dim=24, audio_latents_dim=32,
    text_dim=1024, timestep_input_dim=256, time_embed_hidden_size=64, time_embed_dim=64,
    rope_inv_freq_len=16,
)


def _tiny_h3(seed=3):
    dm = h3.MiniMaxH3Model(**H3_CONFIG, dtype=torch.bfloat16, device="cpu", operations=comfy.ops.manual_cast)
    for i, mod in enumerate(m for m in dm.modules() if isinstance(m, torch.nn.Linear)):
        _init_linear(mod, torch.bfloat16, seed + i)
    return dm


def _model_patcher(dm):
    """A real comfy.model_patcher.ModelPatcher around dm (CPU load and offload device)."""
    base = torch.nn.Module()
    base.diffusion_model = dm
    return comfy.model_patcher.ModelPatcher(base, torch.device("cpu"), torch.device("cpu"))


def _mlp_keys(dm):
    return sorted(f"diffusion_model.{n}.forward" for n, _ in h3.find_h3_mlps(dm))


def test_install_patches_every_h3_mlp_idempotent_and_reports_conflicts():
    dm = _tiny_h3()
    p = _model_patcher(dm)
    n_expected = H3_CONFIG["num_layers"] + H3_CONFIG["token_refiner_num_layers"]
    r = mlp_patch.install_h3_mlp_patches(p, 32)
    assert r == {"patched": n_expected, "skipped": None, "conflicts": [], "removed": 0}
    keys = sorted(p.object_patches)
    assert keys == _mlp_keys(dm)
    assert any(".token_refiner." in k for k in keys) and any(k.startswith("diffusion_model.blocks.") for k in keys)
    first = dict(p.object_patches)
    r2 = mlp_patch.install_h3_mlp_patches(p, "auto")
    assert r2["patched"] == n_expected and r2["conflicts"] == []
    assert len(p.object_patches) == n_expected
    for k, v in p.object_patches.items():
        assert v is not first[k] and v.chunk_setting == "auto"
        assert not isinstance(getattr(v, "module", None), mlp_patch.H3ChunkedMLPForward)  # never wraps ours

    # a foreign patch on one key is reported, not replaced
    foreign_key = keys[0]
    foreign = lambda x: x
    p.add_object_patch(foreign_key, foreign)
    r3 = mlp_patch.install_h3_mlp_patches(p, 64)
    assert r3["patched"] == n_expected - 1
    assert [c["key"] for c in r3["conflicts"]] == [foreign_key]
    assert p.object_patches[foreign_key] is foreign

    # off removes ours, leaves the foreign one
    r4 = mlp_patch.install_h3_mlp_patches(p, "off")
    assert r4["patched"] == 0 and r4["removed"] == n_expected - 1 and r4["skipped"] == "MLP chunking off"
    assert p.object_patches == {foreign_key: foreign}


def test_model_patcher_patch_unpatch_cycle_with_lora():
    """The real ModelPatcher cycle the node relies on: patches installed on a clone (the loader's
    patcher untouched), patch_model applies them and a LoRA weight patch, the MLP runs chunked
    on the LoRA-patched weights with ComfyUI's numbers, unpatch_model restores forward and
    weights, and a second cycle works the same."""
    dm = _tiny_h3(seed=4)
    loader = _model_patcher(dm)
    mod = dm.blocks[0].mlp
    w_orig = mod.fc1.weight.detach().clone()
    delta = torch.randn(w_orig.shape, generator=torch.Generator().manual_seed(6)) * 0.05
    loader.add_patches({"diffusion_model.blocks.0.mlp.fc1.weight": ("diff", (delta,))}, 1.0)
    mp = loader.clone()
    r = mlp_patch.install_h3_mlp_patches(mp, 48)
    assert r["patched"] == H3_CONFIG["num_layers"] + H3_CONFIG["token_refiner_num_layers"]
    assert sorted(mp.object_patches) == _mlp_keys(dm) and loader.object_patches == {}
    x = _x(200)
    for cycle in range(2):
        mp.patch_model()
        assert getattr(mod.__dict__.get("forward"), "_safesage_mlp", False), cycle
        assert not torch.equal(mod.fc1.weight, w_orig), "LoRA weight patch applied"
        stats0 = mlp.MLP_STATS.as_dict()
        with torch.no_grad():
            y = mod(x)
            ref = _unpatched(mod, x)   # ComfyUI's MLP on the same patched weights
        assert mlp.MLP_STATS.chunks - stats0["chunks"] == 5   # ceil(200 / 48)
        assert mlp.MLP_STATS.chunked_calls - stats0["chunked_calls"] == 1
        assert torch.equal(y, ref) or torch.equal(y, _per_chunk_unpatched(mod, x, 48))
        mp.unpatch_model()
        assert torch.equal(mod.fc1.weight, w_orig), "weights restored"
        assert not getattr(mod.__dict__.get("forward"), "_safesage_mlp", False), "forward restored"
        stats1 = mlp.MLP_STATS.chunks
        with torch.no_grad():
            mod(x)
        assert mlp.MLP_STATS.chunks == stats1, "after unpatch_model the chunked forward is not called"
    # the restored bound forward is not a foreign patch: reinstalling works
    assert mlp_patch.install_h3_mlp_patches(mp, 48)["conflicts"] == []


def test_class_level_foreign_patch_is_reported_not_bypassed(monkeypatch):
    dm = _tiny_h3()
    p = _model_patcher(dm)

    orig = h3.MLP.forward

    def other_pack_forward(self, x):
        return orig(self, x)
    monkeypatch.setattr(h3.MLP, "forward", other_pack_forward)
    r = mlp_patch.install_h3_mlp_patches(p, 64)
    assert r["patched"] == 0 and r["conflicts"][0]["kind"] == "class_forward"
    assert p.object_patches == {}


def test_mlp_forward_of_another_form_is_not_patched(monkeypatch):
    """A ComfyUI whose MLP.forward differs from the one-line form reproduced here (e.g. adds a
    residual) keeps its own MLPs, with the reason reported."""
    dm = _tiny_h3()
    p = _model_patcher(dm)
    assert mlp_patch._forward_is_mirrored(h3.MLP)
    ns = {}
    exec("def forward(self, x):\n"
         "    return comfy.ops.linear_input_act(self.fc2, self.fc1(x), 'swiglu') + x\n", vars(h3), ns)
    changed = ns["forward"]
    changed.__qualname__, changed.__module__ = h3.MLP.forward.__qualname__, h3.MLP.forward.__module__
    monkeypatch.setattr(h3.MLP, "forward", changed)
    r = mlp_patch.install_h3_mlp_patches(p, 64)
    assert r["patched"] == 0 and r["conflicts"] == [] and "not the" in r["skipped"]
    assert p.object_patches == {}


def test_patched_tiny_h3_mlp_chunked_through_object_patch():
    dm = _tiny_h3(seed=4)
    p = _model_patcher(dm)
    mlp_patch.install_h3_mlp_patches(p, 48)
    p.patch_model()
    mod = dm.token_refiner.blocks[0].mlp
    x = _x(200)
    chunks0 = mlp.MLP_STATS.chunks
    with torch.no_grad():
        y = mod(x)
    p.unpatch_model()
    assert mlp.MLP_STATS.chunks == chunks0 + 5
    _check_equal(y, mod, x, 48)
