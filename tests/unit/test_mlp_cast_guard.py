"""The cast memo's guard and containment under ComfyUI's classic offload (CPU; issue 26 points 2, 7).

ComfyUI's classic lowvram path (``comfy.ops.cast_bias_weight`` with a weight off the compute
device) copies each weight into a per-offload-stream cast buffer (``comfy.model_management.
get_cast_buffer``), rotating ComfyUI's two offload streams (``get_offload_stream``). The memo
keeps fc1's and fc2's casts for the whole chunked MLP call, so a third cast inside a chunk lands
on fc1's buffer. Here that path runs for real on the CPU: ComfyUI's own ``cast_bias_weight``,
``get_offload_stream``, ``get_cast_buffer`` and ``uncast_bias_weight``, with two stand-in streams
(the CPU has none), weights that report another device (as offloaded weights do), and
``args.cuda_malloc`` off. The GPU version with ComfyUI's real CUDA offload streams is
tests/gpu/test_gpu_mlp_offload.py.

Proved: every chunk is bitwise ComfyUI's forward on that chunk; a memoised cast is given back
(ComfyUI's uncast: on the GPU, the offload stream waits for the compute that read it) *before*
anything is written over it; the memo holds where no buffer is reused. And the wrappers are
contained: a fault in the memo's own code runs ComfyUI's cast / uncast for that call (counted,
logged once); an exception from ComfyUI's own cast or uncast passes through untouched.
"""
import contextlib
import logging
import os
import sys

import pytest
import torch

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
if not COMFYUI_PATH or not os.path.isfile(os.path.join(COMFYUI_PATH, "comfy", "ops.py")):
    _reason = "COMFYUI_PATH not set (point it at a ComfyUI tree with MiniMax H3, e.g. 0dd9b154)"
    print(f"\n[test_mlp_cast_guard] skipped: {_reason}")
    pytest.skip(_reason, allow_module_level=True)
if COMFYUI_PATH not in sys.path:
    sys.path.insert(0, COMFYUI_PATH)
import comfy.cli_args

comfy.cli_args.args.cpu = True  # before comfy.model_management is imported
import comfy.model_management as mm  # noqa: E402
import comfy.ops  # noqa: E402

try:
    import comfy.ldm.minimax.model as h3
except Exception as e:  # pragma: no cover - 0.3.75
    print(f"\n[test_mlp_cast_guard] skipped: comfy.ldm.minimax.model does not import: {e!r}")
    pytest.skip(f"comfy.ldm.minimax.model does not import: {e!r}", allow_module_level=True)
if getattr(mm, "get_cast_buffer", None) is None:  # pragma: no cover
    pytest.skip("this ComfyUI has no comfy.model_management.get_cast_buffer", allow_module_level=True)

from safe_ops.models.h3 import mlp, cast_memo as mlp_comfy
from safe_ops.ui import run_stats  # noqa: E402

from rowcount import per_chunk  # noqa: E402

HIDDEN, FFN = 64, 96
OFF_DEVICE = torch.device("cpu", 0)      # != torch.device("cpu"): "another device" to ComfyUI


class _Offloaded(torch.nn.Parameter):
    """A weight kept off the compute device (lowvram): ComfyUI's cast copies it into a buffer."""

    @property
    def device(self):
        return OFF_DEVICE


class _Stream:
    """Stand-in for a CUDA offload stream (the CPU has none): ComfyUI only enters it and waits."""

    def wait_stream(self, other):
        pass

    @staticmethod
    def as_context(stream):
        return contextlib.nullcontext()


def _offload(lin, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(lin.out_features, lin.in_features, generator=g) * lin.in_features ** -0.5
    lin.weight = _Offloaded(w.to(torch.bfloat16), requires_grad=False)


class SideMLP(h3.MLP):
    """H3's MLP plus a third Linear cast inside every chunk (another pack's layer, a side path)."""

    def __init__(self):
        super().__init__(HIDDEN, FFN, dtype=torch.bfloat16, device="cpu", operations=comfy.ops.manual_cast)
        self.side = comfy.ops.manual_cast.Linear(HIDDEN, HIDDEN, bias=False, dtype=torch.bfloat16)

    def forward(self, x):
        return super().forward(x) + self.side(x)


def side_mlp():
    m = SideMLP()
    for i, lin in enumerate((m.fc1, m.fc2, m.side)):
        _offload(lin, 20 + i)
    return m


def plain_mlp():
    m = h3.MLP(HIDDEN, FFN, dtype=torch.bfloat16, device="cpu", operations=comfy.ops.manual_cast)
    _offload(m.fc1, 20)
    _offload(m.fc2, 21)
    return m


def _x(S, seed=5):
    return torch.randn(S, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _comfy_per_chunk(m, x, chunk):
    return per_chunk(lambda t: type(m).forward(m, t), x, chunk)


class Ledger:
    """ComfyUI's real cast and uncast, recorded (installed under the memo's wrappers): every
    cast, and for every uncast whether the weight it gives back still holds the layer's weight
    -- in ComfyUI's own order a cast's memory is never reused before its uncast."""

    def __init__(self, monkeypatch):
        self.casts, self.uncasts, self.clobbered = [], [], []
        cast, uncast = comfy.ops.cast_bias_weight, comfy.ops.uncast_bias_weight

        def rec_cast(s, *a, **k):
            self.casts.append(s)
            return cast(s, *a, **k)

        def rec_uncast(s, weight, bias, offload_stream, *a, **k):
            self.uncasts.append(s)
            if not torch.equal(weight, torch.Tensor.as_subclass(s.weight, torch.Tensor)):
                self.clobbered.append(s)
            return uncast(s, weight, bias, offload_stream, *a, **k)
        monkeypatch.setattr(comfy.ops, "cast_bias_weight", rec_cast)
        monkeypatch.setattr(comfy.ops, "uncast_bias_weight", rec_uncast)

    def clear(self):
        self.casts.clear(), self.uncasts.clear(), self.clobbered.clear()


@pytest.fixture(autouse=True)
def _restore(monkeypatch):
    """ComfyUI's own functions and state before each test; everything set here is undone after."""
    for owner, name in ((comfy.ops, "cast_bias_weight"), (comfy.ops, "uncast_bias_weight"),
                        (mm, "get_cast_buffer"), (mm, "get_aimdo_cast_buffer")):
        fn = getattr(owner, name, None)
        if fn is not None:
            while getattr(fn, mlp_comfy._MARK, False):
                fn = fn.__wrapped__
            monkeypatch.setattr(owner, name, fn)
    run_stats.reset()


@pytest.fixture
def stats():
    s = run_stats.Section("test_mlp_guard", mlp.MLP_COUNTERS)
    s.reset()
    return s


def _two_offload_streams(monkeypatch):
    """ComfyUI's classic offload on the CPU: its own get_offload_stream / get_cast_buffer over two
    stand-in streams (one cast buffer per stream, handed out in turn), no cudaMallocAsync."""
    monkeypatch.setattr(comfy.cli_args.args, "cuda_malloc", False)
    monkeypatch.setattr(mm, "NUM_STREAMS", 2)
    monkeypatch.setattr(mm, "STREAMS", {torch.device("cpu"): [_Stream(), _Stream()]})
    monkeypatch.setattr(mm, "stream_counters", {})
    monkeypatch.setattr(mm, "STREAM_CAST_BUFFERS", {})
    monkeypatch.setattr(mm, "LARGEST_CASTED_WEIGHT", (None, 0))


@pytest.fixture(params=["two_streams", "one_buffer"])
def offload(request, monkeypatch):
    """ComfyUI's classic offload on the CPU. two_streams: ComfyUI's own get_offload_stream and
    get_cast_buffer over two stand-in streams (one cast buffer per stream, handed out in turn);
    one_buffer: get_cast_buffer hands every cast the same buffer."""
    _two_offload_streams(monkeypatch)
    if request.param == "one_buffer":
        shared = torch.empty(1 << 16, dtype=torch.int8)
        monkeypatch.setattr(mm, "get_cast_buffer", lambda stream, device, size, ref: shared)
    return request.param


# ---------------------------------------------------------------------------------------
# point 2: every cast and every buffer a cast writes is checked
# ---------------------------------------------------------------------------------------
def test_a_third_cast_on_a_memoised_buffer_gives_the_memo_back_first(monkeypatch, stats, offload):
    m, x, chunk = side_mlp(), _x(200), 50
    led = Ledger(monkeypatch)
    want = _comfy_per_chunk(m, x, chunk)
    assert len(led.casts) == 3 * 4 and not led.clobbered, "ComfyUI's own order: each cast intact until its uncast"
    assert len({id(b) for b in mm.STREAM_CAST_BUFFERS.values()}) == (2 if offload == "two_streams" else 0)
    led.clear()
    assert mlp_comfy.install()
    y = mlp.h3_mlp_forward(m, x, chunk, stats=stats)
    assert torch.equal(y, want), "each chunk is ComfyUI's forward on that chunk"
    assert stats.memo_dropped == 1 and stats.cast_reuses == 0 and stats.cast_faults == 0
    assert led.clobbered == [], "a memoised cast was written over before it was given back"
    assert sorted(map(id, led.casts)) == sorted(map(id, led.uncasts)), "every cast given back once"


def test_without_a_reused_buffer_the_memo_holds(monkeypatch, stats):
    """Two offload streams, fc1 and fc2 only: each has its own stream's buffer, nothing is
    dropped -- the guard is not a blanket 'no memo under offload'."""
    _two_offload_streams(monkeypatch)
    m, x = plain_mlp(), _x(200)
    led = Ledger(monkeypatch)
    want = _comfy_per_chunk(m, x, 50)
    led.clear()
    assert mlp_comfy.install()
    y = mlp.h3_mlp_forward(m, x, 50, stats=stats)
    assert torch.equal(y, want)
    assert stats.memo_dropped == 0 and stats.cast_reuses == 6 and len(led.casts) == 2 and not led.clobbered


def test_any_layers_cast_result_on_memoised_memory_drops_the_memo(monkeypatch, stats):
    """A cast that reuses memory without a buffer handed out by ComfyUI (here: a cast that puts
    fc1's and the third layer's weight at the start of one buffer of its own) is caught by its
    result, for any layer cast inside the chunk, not only fc1 / fc2."""
    m = side_mlp()
    for lin in (m.fc1, m.fc2, m.side):
        lin.weight = torch.nn.Parameter(torch.Tensor.as_subclass(lin.weight, torch.Tensor), requires_grad=False)
    x = _x(200)
    want = _comfy_per_chunk(m, x, 50)
    shared = torch.empty(2 * FFN * HIDDEN, dtype=torch.bfloat16)

    def one_buffer_cast(s, input=None, dtype=None, device=None, bias_dtype=None, offloadable=False, **kw):
        w = torch.empty_like(s.weight) if s is m.fc2 else shared[: s.weight.numel()].view(s.weight.shape)
        w.copy_(s.weight)
        return (w, None, (None, w, None)) if offloadable else (w, None)
    monkeypatch.setattr(comfy.ops, "cast_bias_weight", one_buffer_cast)
    monkeypatch.setattr(comfy.ops, "uncast_bias_weight", lambda s, *a: None)
    assert mlp_comfy.install()
    y = mlp.h3_mlp_forward(m, x, 50, stats=stats)
    assert torch.equal(y, want) and stats.memo_dropped == 1


# ---------------------------------------------------------------------------------------
# point 7 (the wrappers' part): contained
# ---------------------------------------------------------------------------------------
INTERNALS = ["_sig", "_ranges", "_buffer_ranges", "_Scope._lookup", "_Scope._record", "_Scope._defers"]


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("internal", INTERNALS)
def test_a_fault_in_the_memo_runs_comfys_cast(monkeypatch, stats, caplog, internal):
    """An error in the memo's own code: that call runs ComfyUI's own cast / uncast, the memo is
    dropped (its deferred uncasts run), counted in the MLP stats and logged once."""
    _two_offload_streams(monkeypatch)
    m, x = side_mlp(), _x(200)
    led = Ledger(monkeypatch)
    want = _comfy_per_chunk(m, x, 50)
    led.clear()
    assert mlp_comfy.install()
    owner, name = (mlp_comfy._Scope, internal.split(".")[1]) if "." in internal else (mlp_comfy, internal)

    def boom(*a, **k):
        raise Boom(f"injected into {internal}")
    monkeypatch.setattr(owner, name, boom)
    with caplog.at_level(logging.ERROR, logger="SafeSage.mlp"):
        y = mlp.h3_mlp_forward(m, x, 50, stats=stats)
        y2 = mlp.h3_mlp_forward(m, x, 50, stats=stats)
    assert torch.equal(y, want) and torch.equal(y2, want)
    assert stats.cast_faults == 2, "one fault per MLP call: after it, the call casts as ComfyUI does"
    assert sorted(map(id, led.casts)) == sorted(map(id, led.uncasts)), "every cast given back once"
    assert not led.clobbered
    logged = [r for r in caplog.records if "internal error in the cast memo" in r.getMessage()]
    assert len(logged) == 1 and isinstance(logged[0].exc_info[1], Boom)


@pytest.mark.parametrize("which", ["cast", "uncast"])
def test_comfys_own_cast_error_passes_through(monkeypatch, stats, which):
    """ComfyUI's cast or uncast raising (its interrupt, an out-of-memory it raises): the same
    exception comes out, not counted as the pack's fault; the memoised casts are given back."""
    m, x = plain_mlp(), _x(200)
    m.fc1.weight = torch.nn.Parameter(torch.Tensor.as_subclass(m.fc1.weight, torch.Tensor), requires_grad=False)
    m.fc2.weight = torch.nn.Parameter(torch.Tensor.as_subclass(m.fc2.weight, torch.Tensor), requires_grad=False)
    led = Ledger(monkeypatch)
    err = Boom("ComfyUI's own")
    real = getattr(comfy.ops, f"{which}_bias_weight")
    calls = []

    def raising(s, *a, **k):
        calls.append(s)
        if len(calls) == 2:
            raise err
        return real(s, *a, **k)
    monkeypatch.setattr(comfy.ops, f"{which}_bias_weight", raising)
    assert mlp_comfy.install()
    with pytest.raises(Boom) as got:
        mlp.h3_mlp_forward(m, x, 50, stats=stats)
    assert got.value is err
    assert stats.cast_faults == 0
    if which == "cast":
        assert [type(s).__name__ for s in led.uncasts] == ["Linear"], "fc1's memoised cast given back"
