"""The cast memo under ComfyUI's classic offload with its real CUDA offload streams (issue 26 point 2).

Lowvram-style classic offload: ComfyUI 0dd9b154's ``manual_cast`` Linears with their bf16 weights
in pinned host memory (what ComfyUI's lowvram leaves unloaded), the input on the GPU. Every cast
is ComfyUI's own ``cast_bias_weight``: a copy on one of ComfyUI's two offload streams
(``get_offload_stream``, handed out in turn), into that stream's cast buffer
(``get_cast_buffer``, ``args.cuda_malloc`` off: ComfyUI's default without cudaMallocAsync) or a
fresh allocation on the offload stream (``cuda_malloc`` on). H3's MLP with a third Linear cast in
every chunk (its cast lands on fc1's stream buffer), and H3's plain MLP; with the compute stream
idle and delayed (``torch.cuda._sleep`` before the call, so that the offload streams run ahead
of it wherever ComfyUI's ordering would let them). Each chunk must be bitwise ComfyUI's forward on
that chunk (same code, same shapes).

Run on the GPU machine (ComfyUI 0dd9b154 importable: ``source bench/device_setup.sh; ss_base``):

    SAFESAGE_GPU_JSON=bench/results/mlp_offload_streams_h200.json COMFYUI_PATH=$SS_COMFY \\
        python -m pytest tests/gpu/test_gpu_mlp_offload.py -v -rs

``SAFESAGE_GPU_JSON`` (optional) receives every case's outcome and the command. Skipped without
CUDA or without a ComfyUI with MiniMax H3 (reason printed).
"""
import json
import os
import platform
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

COMFY = os.environ.get("COMFYUI_PATH") or os.environ.get("SS_COMFY")
_skip = None
if not torch.cuda.is_available():
    _skip = "GPU test: no CUDA device here"
elif not COMFY or not os.path.isfile(os.path.join(COMFY, "comfy", "ops.py")):
    _skip = "GPU test: set COMFYUI_PATH (or SS_COMFY) to ComfyUI 0dd9b154"
if _skip:
    print(f"\n[test_gpu_mlp_offload] skipped: {_skip}")
    pytest.skip(_skip, allow_module_level=True)
if COMFY not in sys.path:
    sys.path.insert(0, COMFY)
try:
    import comfy.cli_args
    import comfy.model_management as mm
    import comfy.ops
    import comfy.ldm.minimax.model as h3
except Exception as e:  # noqa: BLE001
    print(f"\n[test_gpu_mlp_offload] skipped: ComfyUI with H3 does not import: {e!r}")
    pytest.skip(f"ComfyUI with H3 does not import: {e!r}", allow_module_level=True)

from safe_ops.models.h3 import mlp, cast_memo
from safe_ops.ui import run_stats  # noqa: E402

HIDDEN, FFN, S, CHUNK = 1024, 2816, 4096, 512
SLEEP_CYCLES = 50_000_000            # ~25 ms of the compute stream before the call
RESULTS: list = []


class SideMLP(h3.MLP):
    """H3's MLP plus a third Linear cast inside every chunk."""

    def __init__(self):
        super().__init__(HIDDEN, FFN, dtype=torch.bfloat16, device="cpu", operations=comfy.ops.manual_cast)
        self.side = comfy.ops.manual_cast.Linear(HIDDEN, HIDDEN, bias=False, dtype=torch.bfloat16)

    def forward(self, x):
        return super().forward(x) + self.side(x)


def _build(kind):
    m = SideMLP() if kind == "side" else h3.MLP(HIDDEN, FFN, dtype=torch.bfloat16, device="cpu",
                                                 operations=comfy.ops.manual_cast)
    g = torch.Generator().manual_seed(7)
    for lin in [mod for mod in m.modules() if isinstance(mod, torch.nn.Linear)]:
        w = torch.randn(lin.out_features, lin.in_features, generator=g) * lin.in_features ** -0.5
        lin.weight = torch.nn.Parameter(w.to(torch.bfloat16).pin_memory(), requires_grad=False)
    return m


def _comfy_per_chunk(m, x):
    return torch.cat([type(m).forward(m, x[a:a + CHUNK]) for a in range(0, x.shape[0], CHUNK)])


@pytest.fixture(autouse=True)
def _comfy_state(monkeypatch):
    for owner, name in ((comfy.ops, "cast_bias_weight"), (comfy.ops, "uncast_bias_weight"),
                        (mm, "get_cast_buffer"), (mm, "get_aimdo_cast_buffer")):
        fn = getattr(owner, name, None)
        if fn is not None:
            while getattr(fn, cast_memo._MARK, False):
                fn = fn.__wrapped__
            monkeypatch.setattr(owner, name, fn)
    monkeypatch.setattr(mm, "STREAM_CAST_BUFFERS", {})
    monkeypatch.setattr(mm, "LARGEST_CASTED_WEIGHT", (None, 0))
    run_stats.reset()
    yield
    torch.cuda.synchronize()


@pytest.mark.parametrize("delayed", [False, True], ids=["idle", "delayed"])
@pytest.mark.parametrize("cuda_malloc", [False, True], ids=["cast_buffers", "cuda_malloc"])
@pytest.mark.parametrize("kind", ["side", "plain"])
def test_chunks_bitwise_comfys_under_real_offload_streams(monkeypatch, kind, cuda_malloc, delayed):
    assert mm.NUM_STREAMS == 2, f"ComfyUI's default: two offload streams on NVIDIA (got {mm.NUM_STREAMS})"
    monkeypatch.setattr(comfy.cli_args.args, "cuda_malloc", cuda_malloc)
    stats = run_stats.Section("gpu_mlp_offload", mlp.MLP_COUNTERS)
    stats.reset()
    m = _build(kind)
    x = torch.randn(S, HIDDEN, device="cuda", generator=torch.Generator("cuda").manual_seed(3)).to(torch.bfloat16)
    with torch.no_grad():
        want = _comfy_per_chunk(m, x)
        torch.cuda.synchronize()
        assert cast_memo.install()
        if delayed:
            torch.cuda._sleep(SLEEP_CYCLES)
        y = mlp.h3_mlp_forward(m, x, CHUNK, stats=stats)
        torch.cuda.synchronize()
    equal = bool(torch.equal(y, want))
    row = {"kind": kind, "cuda_malloc": cuda_malloc, "delayed": delayed, "bitwise_equal": equal,
           "max_abs_diff": float((y.float() - want.float()).abs().max()),
           "stats": {k: v for k, v in stats.as_dict().items() if k != "fallbacks"},
           "stream_cast_buffers": len(mm.STREAM_CAST_BUFFERS)}
    RESULTS.append(row)
    assert equal, row
    assert stats.chunked_calls == 1 and stats.cast_faults == 0, row
    if kind == "side" and not cuda_malloc:
        assert stats.memo_dropped == 1, "the third cast is handed fc1's stream buffer: memo given back first"
    if kind == "plain":
        assert stats.memo_dropped == 0 and stats.cast_reuses == 2 * (S // CHUNK - 1), row


def teardown_module(module):
    path = os.environ.get("SAFESAGE_GPU_JSON")
    if not path or not RESULTS:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    doc = {"command": "SAFESAGE_GPU_JSON=%s COMFYUI_PATH=%s %s" % (path, COMFY, " ".join(sys.argv)),
           "argv": sys.argv, "comfyui": COMFY, "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name(0), "host": platform.node(),
           "shapes": {"hidden": HIDDEN, "ffn": FFN, "tokens": S, "chunk": CHUNK},
           "num_streams": mm.NUM_STREAMS, "cases": RESULTS,
           "all_bitwise_equal": all(r["bitwise_equal"] for r in RESULTS)}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
