"""safe_ops.models.h3.mlp (H3's MLP chunked through ComfyUI's own forward) against ComfyUI's own classes (CPU).

Needs a ComfyUI tree with MiniMax H3 (0dd9b154 or newer): set COMFYUI_PATH (`bash .ci/run` does,
in its 0dd9b154 pass, where .ci/check_junit.py requires every test here to run). Without it
every test here is skipped with the reason printed.

What is proved here, on every ComfyUI tree the CI runs with H3 (0dd9b154, 783545f6) and every
weight format it can build on the CPU (bf16/fp16/fp32 manual cast, fp32 weights with bf16
compute, LoRA weight functions, fp8 with ComfyUI's quantised matmul, fp8 with
_full_precision_mm, fp8 + LoRA, INT8 with comfy-kitchen's fused SwiGLU, INT8 + LoRA):
* the chunked forward is BITWISE ComfyUI's own MLP.forward run on the same chunks (same code,
  same shapes), and equals ComfyUI's unchunked forward within the tolerance this machine's
  matmul row-count sensitivity gives (tests/unit/rowcount.py; bitwise where it is 0 here);
* ``comfy.ops.cast_bias_weight`` runs once per Linear per MLP call and ``uncast_bias_weight``
  once, after the last chunk (also when a chunk raised), where ComfyUI's layers called per
  chunk cast once per chunk; a LoRA weight function runs once per call;
* a cast that reuses a memoised cast's memory drops the memo (cast per chunk, counted, logged),
  a layer that casts in its own code is counted and logged, torch.compile and calls outside a
  chunked forward pass straight through, a row-dependent input quantiser runs unchunked;
* install on a real ``comfy.model_patcher.ModelPatcher``: every H3 MLP of a tiny
  MiniMaxH3Model patched on a clone, ``patch_model`` / ``unpatch_model`` (with a LoRA weight
  patch) route calls through the chunked forward and back, idempotent, foreign patches
  reported; an MLP.forward of another form is chunked too (ComfyUI's code runs, whatever it is).
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

from safe_ops.models.h3 import dims as h3_facts
from safe_ops.models.h3 import mlp, cast_memo, mlp_patch
from safe_ops.ui import run_stats

from rowcount import assert_within, mlp_tolerance, per_chunk

HIDDEN, FFN = 64, 96


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------
class CastCounter:
    """Counts the real comfy.ops.cast_bias_weight / uncast_bias_weight calls (installed before
    the pack's memo, so the memo wraps the counters: what is counted is what ComfyUI really
    ran). The layers look the names up in comfy.ops' globals at call time."""

    def __init__(self, monkeypatch, log=None):
        self.casts = 0
        self.uncasts = 0
        self.log = log if log is not None else []
        cast, uncast = comfy.ops.cast_bias_weight, comfy.ops.uncast_bias_weight
        cast = getattr(cast, "__wrapped__", cast) if getattr(cast, cast_memo._MARK, False) else cast
        uncast = getattr(uncast, "__wrapped__", uncast) if getattr(uncast, cast_memo._MARK, False) else uncast

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
        assert cast_memo.install(), "this ComfyUI has cast_bias_weight / uncast_bias_weight"


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


def _quant_state(lin, seed, fmt):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(lin.out_features, lin.in_features, generator=g) * lin.in_features ** -0.5
    if fmt == "int8_tensorwise":
        scale = w.abs().amax() / 127.0
        q = (w / scale).round().clamp(-127, 127).to(torch.int8)
    else:
        scale = w.abs().amax() / 448.0
        q = (w / scale).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale.float(),
            "comfy_quant": torch.tensor(list(json.dumps({"format": fmt}).encode()), dtype=torch.uint8)}


def quant_mlp(fmt="float8_e4m3fn", compute_dtype=torch.bfloat16, disabled=()):
    ops = comfy.ops.mixed_precision_ops({}, compute_dtype=compute_dtype, disabled=set(disabled))
    m = h3.MLP(HIDDEN, FFN, dtype=compute_dtype, device="cpu", operations=ops)
    m.fc1.load_state_dict(_quant_state(m.fc1, 11, fmt), strict=False)
    m.fc2.load_state_dict(_quant_state(m.fc2, 12, fmt), strict=False)
    assert isinstance(m.fc1.weight, QuantizedTensor) and m.fc1.layout_type
    return m


def with_lora(m, which=("fc1", "fc2"), calls=None):
    """A LoRA-style weight_function on the named layers (counts its calls in ``calls``)."""
    for name in which:
        lin = getattr(m, name)
        d = torch.randn(lin.weight.shape, generator=torch.Generator().manual_seed(9)) * 1e-2

        def fn(w, name=name, d=d):
            if calls is not None:
                calls[name] = calls.get(name, 0) + 1
            return w + d.to(w.dtype)
        lin.weight_function = [fn]
    return m


def _x(S, dtype=torch.bfloat16, seed=5):
    return torch.randn(S, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _unpatched(m, x):
    return type(m).forward(m, x)


def _tolerance(m, x, chunk):
    """This machine's row-count sensitivity of ComfyUI's own two MLP stages."""
    return mlp_tolerance(m.fc1, lambda h: comfy.ops.linear_input_act(m.fc2, h.clone(), "swiglu"), x, chunk)


def _check(y, m, x, chunk, tag=""):
    """Bitwise ComfyUI's forward on the same chunks; ComfyUI's unchunked forward within the
    measured tolerance."""
    assert torch.equal(y, per_chunk(lambda t: _unpatched(m, t), x, chunk)), tag
    assert_within(y, _unpatched(m, x), _tolerance(m, x, chunk), tag)


@pytest.fixture
def stats():
    s = run_stats.Section("test_mlp", mlp.MLP_COUNTERS)
    s.reset()
    return s


@pytest.fixture(autouse=True)
def _restore_comfy_cast(monkeypatch):
    """Whatever a test installs on comfy.ops (the memo, counters) is undone after it."""
    for name in ("cast_bias_weight", "uncast_bias_weight"):
        monkeypatch.setattr(comfy.ops, name, getattr(comfy.ops, name))


# ---------------------------------------------------------------------------------------
# every weight format: ComfyUI's numbers, one cast per Linear per call
# ---------------------------------------------------------------------------------------
FORMATS = {
    "manual_cast_bf16": lambda: manual_cast_mlp(torch.bfloat16),
    "manual_cast_fp16": lambda: manual_cast_mlp(torch.float16),
    "manual_cast_fp32": lambda: manual_cast_mlp(torch.float32),
    "manual_cast_fp32_weights_bf16": lambda: manual_cast_mlp(torch.bfloat16, torch.float32),
    "manual_cast_lora": lambda: with_lora(manual_cast_mlp(torch.bfloat16)),
    "fp8_native": lambda: quant_mlp(),
    "fp8_full_precision_mm": lambda: quant_mlp(disabled=("float8_e4m3fn", "float8_e5m2")),
    "fp8_lora": lambda: with_lora(quant_mlp(), ("fc1",)),
    "int8_fused_swiglu": lambda: quant_mlp("int8_tensorwise"),
    "int8_lora": lambda: with_lora(quant_mlp("int8_tensorwise"), ("fc2",)),
}


@pytest.mark.parametrize("kind", sorted(FORMATS))
@pytest.mark.parametrize("S,chunk", [(333, 64), (300, 100)])
def test_chunked_is_comfys_forward_with_one_cast_per_linear(monkeypatch, stats, kind, S, chunk):
    m = FORMATS[kind]()
    dtype = m.fc1.weight.dtype if kind.startswith("manual_cast_fp") and "weights" not in kind else torch.bfloat16
    x = _x(S, dtype)
    cc = CastCounter(monkeypatch)
    y = mlp.h3_mlp_forward(m, x, chunk, stats=stats)
    n = -(-S // chunk)
    assert (cc.casts, cc.uncasts) == (2, 2), "one cast and one uncast per Linear per MLP call"
    assert (stats.casts, stats.cast_reuses, stats.chunks, stats.chunked_calls) == (2, 2 * (n - 1), n, 1)
    assert stats.memo_dropped == 0 and stats.own_cast == 0 and stats.fallbacks == {}
    # the alternative (ComfyUI's forward per chunk, no memo) casts once per Linear per chunk
    cc.casts = 0
    per_chunk(lambda t: _unpatched(m, t), x, chunk)
    assert cc.casts == 2 * n
    _check(y, m, x, chunk, kind)


def test_comfys_own_branches_run_per_chunk(monkeypatch, stats):
    """INT8 fc2 takes comfy-kitchen's fused SwiGLU (linear_input_act's INT8 branch) in every chunk,
    on the one cast weight; a LoRA on the INT8 fc2 makes ComfyUI's cast dequantise: eager branch."""
    ck = comfy.ops.quant_ops.ck
    acts = []
    real = ck.int8_linear

    def spy(*a, **k):
        acts.append(k.get("input_act"))
        return real(*a, **k)
    monkeypatch.setattr(ck, "int8_linear", spy)
    CastCounter(monkeypatch)
    mlp.h3_mlp_forward(quant_mlp("int8_tensorwise"), _x(300), 64, stats=stats)
    assert acts == ["swiglu"] * 5
    acts.clear()
    mlp.h3_mlp_forward(with_lora(quant_mlp("int8_tensorwise"), ("fc2",)), _x(300), 64, stats=stats)
    assert acts == [], "fc2 dequantised: ComfyUI's eager SwiGLU and matmul, not the INT8 kernel"


def test_lora_weight_function_runs_once_per_call(monkeypatch, stats):
    calls = {}
    m = with_lora(manual_cast_mlp(torch.bfloat16), calls=calls)
    CastCounter(monkeypatch)
    mlp.h3_mlp_forward(m, _x(500), 128, stats=stats)
    assert calls == {"fc1": 1, "fc2": 1}
    calls.clear()
    per_chunk(lambda t: _unpatched(m, t), _x(500), 128)
    assert calls == {"fc1": 4, "fc2": 4}, "ComfyUI's layers per chunk run the LoRA per chunk"


# ---------------------------------------------------------------------------------------
# the cast memo's scope: release order, errors, shared buffers, own casts, compile
# ---------------------------------------------------------------------------------------
def test_uncasts_run_after_the_last_chunk_and_on_interrupt(monkeypatch, stats):
    m = with_lora(manual_cast_mlp(torch.bfloat16), ("fc1",))
    log = []
    CastCounter(monkeypatch, log)
    chunk_ops = []
    real_every = comfy.ops.run_every_op
    monkeypatch.setattr(comfy.ops, "run_every_op", lambda: (log.append("op"), chunk_ops.append(1), real_every()))
    mlp.h3_mlp_forward(m, _x(300), 100, stats=stats)
    # 3 chunks x 2 Linear calls, each preceded by ComfyUI's interrupt check
    assert log == ["op", "cast", "op", "cast"] + ["op", "op"] * 2 + ["uncast", "uncast"]

    class Interrupted(Exception):
        pass

    def interrupt():
        log.append("op")
        if len(chunk_ops) == 3:
            raise Interrupted()
        chunk_ops.append(1)
    log.clear()
    chunk_ops.clear()
    monkeypatch.setattr(comfy.ops, "run_every_op", interrupt)
    with pytest.raises(Interrupted):
        mlp.h3_mlp_forward(m, _x(300), 100, stats=stats)
    assert log == ["op", "cast", "op", "cast", "op", "op", "uncast", "uncast"], "released on error too"


def test_outside_a_chunked_call_and_while_compiling_casts_pass_through(monkeypatch, stats):
    m = manual_cast_mlp(torch.bfloat16)
    cc = CastCounter(monkeypatch)
    x = _x(300)
    per_chunk(lambda t: _unpatched(m, t), x, 100)
    assert (cc.casts, cc.uncasts) == (6, 6), "ComfyUI's layers outside the scope: unchanged"
    cc.casts = cc.uncasts = 0
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    y = mlp.h3_mlp_forward(m, x, 100, stats=stats)
    assert (cc.casts, cc.uncasts) == (6, 6) and stats.casts == 0, "no memo while torch compiles"
    monkeypatch.undo()
    assert torch.equal(y, per_chunk(lambda t: _unpatched(m, t), x, 100))


def test_a_cast_into_memoised_memory_drops_the_memo(monkeypatch, stats, caplog):
    """One cast buffer handed to fc1 and then fc2 (classic lowvram with one offload stream):
    fc2's cast overwrites fc1's memoised weight, so the memo is dropped for that call -- the
    deferred uncast runs at once and every later chunk casts and uncasts as ComfyUI does."""
    m = manual_cast_mlp(torch.float32)
    shared = torch.empty(2 * FFN * HIDDEN + 16)
    uncasts = []

    def one_buffer_cast(s, input=None, dtype=None, device=None, bias_dtype=None, offloadable=False, **kw):
        w = shared[: s.weight.numel()].view(s.weight.shape)
        w.copy_(s.weight)
        return w, None, (object(), w, None)
    monkeypatch.setattr(comfy.ops, "cast_bias_weight", one_buffer_cast)
    monkeypatch.setattr(comfy.ops, "uncast_bias_weight", lambda s, *a: uncasts.append(s))
    assert cast_memo.install()
    x = _x(200, torch.float32)
    with caplog.at_level(logging.WARNING, logger="SafeSage.mlp"):
        y = mlp.h3_mlp_forward(m, x, 50, stats=stats)
    assert stats.memo_dropped == 1 and stats.casts == 8 and stats.cast_reuses == 0
    assert uncasts == [m.fc1, m.fc2] * 4, "every cast given back once, the memoised one first"
    assert any("cast per chunk" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    assert torch.equal(y, per_chunk(lambda t: _unpatched(m, t), x, 50))


def test_layer_with_its_own_cast_is_chunked_counted_and_logged(monkeypatch, stats, caplog):
    """A Linear that casts in its own code (as GGUF's layers do), not through comfy.ops: it casts
    per chunk, ComfyUI's numbers, and the log says so once."""
    class OwnCastLinear(comfy.ops.manual_cast.Linear):
        def forward_comfy_cast_weights(self, input):
            return F.linear(input, self.weight.to(input.dtype), None if self.bias is None else self.bias.to(input.dtype))
    m = manual_cast_mlp(torch.bfloat16)
    own = OwnCastLinear(HIDDEN, 2 * FFN, dtype=torch.bfloat16)
    own.weight, own.bias = m.fc1.weight, m.fc1.bias
    m.fc1 = own
    CastCounter(monkeypatch)
    x = _x(300)
    with caplog.at_level(logging.WARNING, logger="SafeSage.mlp"):
        y = mlp.h3_mlp_forward(m, x, 100, stats=stats)
        mlp.h3_mlp_forward(m, x, 100, stats=stats)
    assert stats.own_cast == 2 and stats.casts == 2 and stats.cast_reuses == 4   # fc2 still memoised
    msgs = [r.getMessage() for r in caplog.records if "OwnCastLinear" in r.getMessage()]
    assert len(msgs) == 1 and "own code" in msgs[0]
    _check(y, m, x, 100)


def test_row_dependent_input_quantisation_runs_unchunked(monkeypatch, stats, caplog):
    """An input quantiser that takes its scale over all tokens (NVFP4 without an input_scale)
    would give other numbers per chunk: ComfyUI's unchunked MLP runs, counted and logged."""
    m = quant_mlp()
    monkeypatch.setattr(m.fc1, "layout_type", "TensorCoreNVFP4Layout", raising=False)
    seen = []
    monkeypatch.setattr(type(m), "forward", lambda self, x: seen.append(x.shape[0]) or x)
    with caplog.at_level(logging.WARNING, logger="SafeSage.mlp"):
        mlp.h3_mlp_forward(m, _x(300), 64, stats=stats)
    assert seen == [300] and stats.chunked_calls == 0
    (reason,) = stats.fallbacks
    assert "TensorCoreNVFP4Layout" in reason and any(reason in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(m.fc1, "input_scale", torch.tensor(1.0), raising=False)
    mlp.h3_mlp_forward(m, _x(300), 64, stats=stats)
    assert seen[1:] == [64] * 4 + [44], "with a fixed input scale: chunked"


def test_one_chunk_and_off_run_comfys_forward_once(monkeypatch, stats):
    m = manual_cast_mlp(torch.bfloat16)
    x = _x(100)
    cc = CastCounter(monkeypatch)
    y = mlp.h3_mlp_forward(m, x, 100, stats=stats)
    y2 = mlp.h3_mlp_forward(m, x, "off", stats=stats)
    assert stats.passthrough == 2 and stats.chunked_calls == 0 and stats.casts == 0 and cc.casts == 4
    assert torch.equal(y, _unpatched(m, x)) and torch.equal(y2, y)


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
    return sorted(f"diffusion_model.{n}.forward" for n, _ in h3_facts.find_h3_mlps(dm))


def test_install_patches_every_h3_mlp_idempotent_and_reports_conflicts():
    dm = _tiny_h3()
    p = _model_patcher(dm)
    n_expected = H3_CONFIG["num_layers"] + H3_CONFIG["token_refiner_num_layers"]
    r = mlp_patch.install_h3_mlp_patches(p, 32)
    assert r == {"patched": n_expected, "skipped": None, "conflicts": [], "removed": 0, "cast_once": True}
    assert getattr(comfy.ops.cast_bias_weight, cast_memo._MARK, False), "ComfyUI's cast wrapped once"
    wrapped = comfy.ops.cast_bias_weight
    keys = sorted(p.object_patches)
    assert keys == _mlp_keys(dm)
    assert any(".token_refiner." in k for k in keys) and any(k.startswith("diffusion_model.blocks.") for k in keys)
    first = dict(p.object_patches)
    r2 = mlp_patch.install_h3_mlp_patches(p, "auto")
    assert r2["patched"] == n_expected and r2["conflicts"] == []
    assert comfy.ops.cast_bias_weight is wrapped, "installing again does not wrap twice"
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
        assert mlp.MLP_STATS.chunks - stats0["chunks"] == 5   # ceil(200 / 48)
        assert mlp.MLP_STATS.chunked_calls - stats0["chunked_calls"] == 1
        _check(y, mod, x, 48, f"cycle {cycle}")
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


def test_mlp_forward_of_another_form_is_chunked_through_it(monkeypatch, stats):
    """A ComfyUI whose MLP.forward has another form (here: a residual added) is chunked too: its
    own forward runs per chunk, so the result is that forward's, whatever it computes."""
    ns = {}
    exec("def forward(self, x):\n"
         "    return comfy.ops.linear_input_act(self.fc2, self.fc1(x), 'swiglu') + x\n", vars(h3), ns)
    changed = ns["forward"]
    changed.__qualname__, changed.__module__ = h3.MLP.forward.__qualname__, h3.MLP.forward.__module__
    monkeypatch.setattr(h3.MLP, "forward", changed)
    dm = _tiny_h3(seed=4)
    p = _model_patcher(dm)
    assert mlp_patch.install_h3_mlp_patches(p, 48)["patched"] == 3
    p.patch_model()
    mod = dm.token_refiner.blocks[0].mlp
    x = _x(200)
    chunks0 = mlp.MLP_STATS.chunks
    with torch.no_grad():
        y = mod(x)
    p.unpatch_model()
    assert mlp.MLP_STATS.chunks == chunks0 + 5
    _check(y, mod, x, 48)
    assert not torch.equal(y, _unpatched(mod, x) - x), "the residual form ran"
