"""Token-chunked MiniMax H3 MLP, run by ComfyUI's own MLP forward per chunk (hazard H-4).

ComfyUI runs each H3 MLP over all S tokens at once (``comfy/ldm/minimax/model.py``:
``comfy.ops.linear_input_act(self.fc2, self.fc1(x), "swiglu")``): fc1's ``[S, 2*ffn]`` output
(9.0 GiB at S = 169k), the SwiGLU's ``[S, ffn]`` and fc2's input copies live at once. Every
step is row independent, so :func:`h3_mlp_forward` runs ComfyUI's own forward (whatever this
ComfyUI's ``MLP.forward`` is) on token chunks and writes each chunk's result into one ``[S,
hidden]`` output. Each Linear's weight is still cast once per MLP call, not once per chunk:
cast_memo.cast_once memoises ComfyUI's own cast for the call and runs ComfyUI's own uncast
after the last chunk.

Nothing is copied from ComfyUI, so whatever its layers do (manual cast, fp8 / int8 / NVFP4
weights, LoRA weight functions, comfy-kitchen's fused INT8 SwiGLU, fp16 accumulation) is what
runs, per chunk. Two things decide whether a call is chunked: the chunk size (mlp_plan.py), and
whether chunking could change ComfyUI's numbers beyond a matmul's rounding -- an input
quantiser whose scale is taken over all tokens (:func:`row_dependent_reason`); such calls run
ComfyUI's unchunked forward, counted and logged.

No fences: every chunk's intermediates are made and consumed on the current stream, where
the caching allocator orders their reuse, and ComfyUI's own uncast orders the weights' release.
"""
from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from ...facts import compiler
from ... import contain
from . import cast_memo
from ...ui import run_stats
from ...facts import budget
from .mlp_plan import auto_budget_bytes, chunk_tokens, parse_chunk_setting, per_token_bytes

log = logging.getLogger("SafeSage.mlp")


# ---------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------
# the MLP's counters, a section of the one store (run_stats.snapshot()["mlp"])
MLP_COUNTERS = (
    "calls",            # patched MLP forwards entered
    "chunked_calls",    # ... that ran chunked
    "passthrough",      # ... that ran ComfyUI's own forward because S fits one chunk
    "chunks",           # chunks executed
    "casts",            # ComfyUI casts of fc1/fc2 inside chunked calls (2 per call when memoised)
    "cast_reuses",      # ... and the chunks that got a memoised cast back instead
    "memo_dropped",     # calls whose memo was dropped (a cast buffer reused): cast per chunk
    "own_cast",         # calls with a layer that casts outside comfy.ops (e.g. GGUF): per chunk
    "cast_faults",      # errors in the cast memo's own code: that cast ran ComfyUI's own, memo dropped
    "internal_errors",  # calls where SafeSage's own code raised: ComfyUI's forward ran instead (contain.py)
)
MLP_STATS = run_stats.Section("mlp", MLP_COUNTERS, "SafeSage MLP: running ComfyUI's unchunked MLP ({reason})")
#: ``snapshot()[PEAK_INFO]``: the largest intermediates one patched MLP call kept live (bytes, mlp_plan.per_token_bytes
#: x the chunk's tokens, or the whole input's where the call ran unchunked), since the store's last reset
PEAK_INFO = "mlp_peak_intermediate_bytes"


# ---------------------------------------------------------------------------------------
# the chunk loop (pure torch)
# ---------------------------------------------------------------------------------------
def run_chunked(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, chunk_tokens: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``fn`` over row chunks of ``x`` (``[..., in]``, leading dims flattened into tokens), each
    chunk's ``[c, width]`` result copied into one output (``out``, contiguous, ``[..., width]``
    or ``[S, width]``; allocated from the first chunk's result when None). Returns
    ``[..., width]``. ``chunk_tokens <= 0`` runs one chunk; ``S = 0`` calls ``fn`` once on the
    empty input so that the output has the right width and dtype."""
    lead = tuple(x.shape[:-1])
    x2 = x.reshape(-1, x.shape[-1])
    S = x2.shape[0]
    c = int(chunk_tokens) if chunk_tokens and int(chunk_tokens) > 0 else max(S, 1)
    out2 = None
    if out is not None:
        if not out.is_contiguous():
            raise ValueError("out must be contiguous (chunks are written into row slices of it)")
        out2 = out.reshape(S, out.shape[-1])
    if S == 0:
        y = fn(x2)
        if out2 is None:
            return y.reshape(*lead, y.shape[-1])
        return out
    for a in range(0, S, c):
        y = fn(x2[a:a + c])
        if out2 is None:
            out2 = torch.empty((S, y.shape[-1]), dtype=y.dtype, device=y.device)
        out2[a:a + c].copy_(y)
        del y
    return out if out is not None else out2.reshape(*lead, out2.shape[-1])


# ---------------------------------------------------------------------------------------
# ComfyUI's H3 MLP, chunked
# ---------------------------------------------------------------------------------------
#: input quantisation layouts whose scale for one row does not depend on other rows when the
#: layer has no input_scale (comfy's FP8 layouts quantise with scale 1.0; MXFP8 per 1x32 block)
ROW_INDEPENDENT_LAYOUTS = ("TensorCoreFP8Layout", "TensorCoreFP8E4M3Layout", "TensorCoreFP8E5M2Layout",
                           "TensorCoreMXFP8Layout")
#: ... and those that are row independent only with a fixed (checkpoint) input scale: NVFP4
#: without one takes a per-tensor amax over all tokens
ROW_INDEPENDENT_WITH_SCALE = ("TensorCoreNVFP4Layout",)


def row_dependent_reason(linear: Any) -> str | None:
    """Why chunking ``linear``'s input could change its numbers beyond rounding, or None: a
    quantised layer (``layout_type``) that quantises its input (QUANT_ALGOS' ``quantize_input``,
    true by default) with a layout not known to quantise each row on its own. Conservative: it
    does not ask whether ComfyUI would take the quantised path for this call at all."""
    layout = getattr(linear, "layout_type", None)
    if layout is None:
        return None
    ops = sys.modules.get("comfy.ops")
    algos = getattr(ops, "QUANT_ALGOS", None) or {}
    if not algos.get(getattr(linear, "quant_format", None), {}).get("quantize_input", True):
        return None
    name = layout if isinstance(layout, str) else getattr(layout, "__name__", str(layout))
    if name in ROW_INDEPENDENT_LAYOUTS:
        return None
    if name in ROW_INDEPENDENT_WITH_SCALE and getattr(linear, "input_scale", None) is not None:
        return None
    return f"{name} input quantisation may depend on all tokens"


class MLPFacts:
    """What every call of one patched MLP needs and no call changes: the parsed chunk setting,
    the dims, and why chunking could change the numbers (:func:`row_dependent_reason`). Made once
    per patched module (mlp_patch.H3ChunkedMLPForward keeps it) and made again when
    :meth:`current` says the module or the setting changed: other Linear objects in fc1 / fc2, or
    a quantisation loaded into one of them since (``layout_type`` / ``quant_format`` /
    ``input_scale`` as ComfyUI's loader sets them on the layer)."""

    __slots__ = ("setting", "fc1", "fc2", "state", "hidden", "ffn", "row_dependent")

    def __init__(self, module, setting: Any):
        self.setting = setting
        self.fc1, self.fc2 = module.fc1, module.fc2
        self.state = (_quant_state(self.fc1), _quant_state(self.fc2))
        self.hidden, self.ffn = _mlp_dims(module)
        self.row_dependent = row_dependent_reason(self.fc1) or row_dependent_reason(self.fc2)

    def current(self, module, setting: Any) -> bool:
        """Still true of ``module`` with ``setting`` (a few attribute reads, no ComfyUI lookups)."""
        fc1, fc2 = module.fc1, module.fc2
        return (setting is self.setting and fc1 is self.fc1 and fc2 is self.fc2
                and self.state == (_quant_state(fc1), _quant_state(fc2)))


def _quant_state(linear) -> tuple:
    """The attributes ComfyUI's quantised-layer loader sets on a layer (instance attributes and
    parameters only: no nn.Module.__getattr__ miss per call)."""
    d = getattr(linear, "__dict__", {})
    params = d.get("_parameters") or {}
    scale = params.get("input_scale", d.get("input_scale"))
    return d.get("layout_type"), d.get("quant_format"), scale is None


_RUN_CHUNKS: dict = {}      # (run id, call signature) -> tokens per chunk, under ComfyUI's compiler
_RUN_CHUNKS_LOCK = threading.Lock()     # held while _RUN_CHUNKS changes (its trim iterates it)


def chunk_for_call(chunk_setting: Any, S: int, hidden: int, ffn: int, dtype: torch.dtype,
                   device: torch.device, budget_bytes: int | None = None) -> int:
    """mlp_plan.resolve_chunk, except that under ComfyUI's allocation compiler an "auto" chunk size
    is chosen at a signature's first call of a sampling run and kept for the run: "auto" follows
    free memory, and another chunk size on a later step would allocate differently."""
    return _chunk_for(parse_chunk_setting(chunk_setting), S, hidden, ffn, dtype, device, budget_bytes)


def _chunk_for(setting: Any, S: int, hidden: int, ffn: int, dtype: torch.dtype,
               device: torch.device, budget_bytes: int | None = None) -> int:
    """:func:`chunk_for_call` for a parsed setting."""
    if setting != "auto" or budget_bytes is not None or not compiler.enabled_now(device):
        return chunk_tokens(setting, S, hidden, ffn, dtype, device, budget_bytes)
    key = (compiler.run_id(), S, hidden, ffn, dtype, device)
    c = _RUN_CHUNKS.get(key)
    if c is None:
        c = chunk_tokens(setting, S, hidden, ffn, dtype, device, budget_bytes)
        with _RUN_CHUNKS_LOCK:
            c = _RUN_CHUNKS.setdefault(key, c)     # another thread's choice for this run, if first
            run_stats.trim(_RUN_CHUNKS)       # the store's bound; the oldest (earlier runs') go first
    return c


def _mlp_dims(module) -> tuple[int, int]:
    fc1, fc2 = module.fc1, module.fc2
    hidden = getattr(fc1, "in_features", None) or fc1.weight.shape[-1]
    ffn = getattr(fc2, "in_features", None) or fc2.weight.shape[-1]
    return int(hidden), int(ffn)


def _unpatched(module, x):
    """ComfyUI's own MLP forward: whatever it raises is ComfyUI's (contain.run_comfy)."""
    return contain.run_comfy(type(module).forward, module, x)


def h3_mlp_forward(module: torch.nn.Module, x: torch.Tensor, chunk_setting: Any = "auto",
                   stats: run_stats.Section = MLP_STATS, budget_bytes: int | None = None,
                   facts: MLPFacts | None = None) -> torch.Tensor:
    """Replacement for an H3 ``MLP.forward``: ComfyUI's own forward per token chunk, each Linear
    cast once per call (cast_memo.cast_once); ComfyUI's unchunked forward where chunking is not
    needed or could change the numbers (counted, logged once per reason).

    ``facts``: the module's :class:`MLPFacts` for ``chunk_setting`` (the patch's, made once);
    made here when None. While torch compiles, free memory is read as it is (nothing cached,
    no lock: budget.MLP_READER and the per-run chunk sizes are skipped)."""
    traced = cast_memo.compiling()
    stats.bump("calls")
    S = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in module.parameters())):
        stats.fallback("autograd enabled")
        return _unpatched(module, x)
    if getattr(sys.modules.get("comfy.model_management"), "in_training", False):
        stats.fallback("comfy in_training")
        return _unpatched(module, x)
    if facts is None:
        facts = MLPFacts(module, parse_chunk_setting(chunk_setting))
    if traced and budget_bytes is None and facts.setting == "auto":
        budget_bytes = auto_budget_bytes(x.device, budget.free_device_bytes)
    c = _chunk_for(facts.setting, S, facts.hidden, facts.ffn, x.dtype, x.device, budget_bytes)
    # the MLP's intermediates at their largest (one chunk's, or the whole input's when it runs unchunked)
    run_stats.info_max(PEAK_INFO, min(c, S) * per_token_bytes(facts.hidden, facts.ffn, x.element_size()))
    if c >= S:
        stats.bump("passthrough")
        return _unpatched(module, x)
    layers = (facts.fc1, facts.fc2)
    if facts.row_dependent is not None:
        stats.fallback(facts.row_dependent)
        return _unpatched(module, x)

    stats.bump("chunked_calls")
    n = -(-S // c)
    with cast_memo.cast_once(layers, stats) as scope:
        y = run_chunked(lambda xc: _unpatched(module, xc), x, c)
    own = [type(m).__name__ for m in layers if id(m) not in scope.seen and cast_memo.casts_itself(m)]
    if own and scope.active:
        # GGUF and other packs' layers cast in their own code, not through comfy.ops: correct,
        # but every chunk casts again
        stats.bump("own_cast")
        stats.once_warning(f"SafeSage MLP: {', '.join(own)} cast(s) weights in its own code, not "
                           "comfy.ops.cast_bias_weight: each MLP chunk casts them again (set "
                           "mlp_chunking to 'off' if that is slower than the memory it saves)")
    stats.bump("chunks", n)
    return y
