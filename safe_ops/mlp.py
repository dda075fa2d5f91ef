"""Token-chunked SwiGLU MLP for MiniMax H3 (hazards H-3, H-4).

ComfyUI (``comfy/ldm/minimax/model.py`` at ``0dd9b154``) runs each H3 MLP as::

    comfy.ops.linear_input_act(self.fc2, self.fc1(x), "swiglu")

i.e. ``fc1`` over all S tokens (``[S, 2*ffn]``, 9.0 GiB at S = 169k), ``silu(gate) * up``
(another ``[S, ffn]``), then ``fc2`` (plus its fp8 input copy).  Every step is row
independent, so the same numbers come out of a loop over token chunks that writes each
chunk's ``fc2`` result into a preallocated ``[S, hidden]`` output.

This module has two layers (the chunk size is planned in mlp_plan.py, the forward installed on
a ModelPatcher by mlp_patch.py):

* pure torch, no ComfyUI: :func:`chunked_swiglu`,
  :func:`dequantize_fp8`, and the generic chunk loop :func:`run_chunked_mlp` driven by
  *leases* (a weight obtained once, applied to many chunks, then released);
* the ComfyUI-facing part (``comfy`` imported lazily inside functions, guarded with
  ``getattr`` so the pack loads on ComfyUI 0.3.75, which has neither H3 nor
  ``linear_input_act``): :func:`comfy_linear_lease` obtains a Linear's weight ONCE per MLP
  call through ``comfy.ops.cast_bias_weight(..., offloadable=True)`` -- whatever the loading
  mode -- and gives it back through ``comfy.ops.uncast_bias_weight``;
  :func:`h3_mlp_forward` is the replacement forward.

``linear_input_act`` cannot simply be called per chunk: it casts fc2 (``cast_bias_weight``)
on every call, i.e. once per chunk.  Its branches are therefore reproduced on a weight cast
once, and tests/unit/test_mlp_comfy.py compares each with ComfyUI's own ``linear_input_act``
on the same inputs: the eager ``_swiglu_eager`` + fc2 Linear forward (manual_cast, LoRA
weight functions, fp8 mixed precision incl. ``_full_precision_mm``) and the INT8 fused
SwiGLU.  Branches not reproduced run ComfyUI's unchunked MLP with a counted, logged reason
(``MLP_STATS.fallbacks``): INT8 fc2 with ``_full_precision_mm`` (0dd9b154 and later ComfyUI
differ there) and later ComfyUI's fp16-accumulation ``ck.fp16_linear`` (its kernel choice
depends on the token count, so chunks would not give the unchunked numbers).

Fencing.  Transient weight copies (cast buffers, dequantised / LoRA-patched weights) are
used by every chunk's kernels; after the last chunk has been enqueued they are handed to
``FenceBook.hold`` (an event recorded after the last consumer) and only then released
through ComfyUI's release path.  Per-chunk intermediates (fc1 output, activation) are
*not* fenced: they are allocated and consumed on the one current stream and never handed
to another stream, which is exactly the case the caching allocator orders correctly;
fencing them would keep every chunk's intermediate alive until the GPU catches up and
give back the memory the chunking saves.
"""
from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .fences import GLOBAL_FENCES, FenceBook
from .mlp_plan import resolve_chunk

log = logging.getLogger("SafeSage.mlp")


# ---------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------
@dataclass
class MlpStats:
    calls: int = 0             # patched MLP forwards entered
    chunked_calls: int = 0     # ... that ran chunked
    passthrough: int = 0       # ... that ran ComfyUI's own forward because S fits one chunk
    chunks: int = 0            # chunks executed
    casts: int = 0             # comfy.ops.cast_bias_weight calls made by this module
    dequants: int = 0          # weights dequantised once by this module (fp8 fallback)
    fenced: int = 0            # FenceBook.hold calls for transient weights
    fallbacks: dict = field(default_factory=dict)   # reason -> count (unchunked, counted)

    def fallback(self, reason: str) -> None:
        first = reason not in self.fallbacks
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        if first:
            log.warning("SafeSage MLP: running ComfyUI's unchunked MLP (%s)", reason)

    def reset(self) -> None:
        self.__init__()

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["fallbacks"] = dict(self.fallbacks)
        return d


MLP_STATS = MlpStats()
_STATS_LOCK = threading.Lock()


# ---------------------------------------------------------------------------------------
# pure torch core
# ---------------------------------------------------------------------------------------
def swiglu_inplace(h: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` with gate = FIRST half (ComfyUI ``_swiglu_eager``), in place.

    Writes into the gate half of ``h`` and returns that ``[..., ffn]`` view (row stride
    ``2*ffn``).  Elementwise ops on the same values as ``_swiglu_eager``: bit-identical.
    """
    gate, up = h.chunk(2, dim=-1)
    F.silu(gate, inplace=True)
    return gate.mul_(up)


def swiglu_contiguous(h: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` into a new contiguous ``[..., ffn]`` tensor: ComfyUI's
    ``_swiglu_eager`` op for op (``silu`` out of place, then ``mul_``), so bit-identical.

    For an fc2 that needs a contiguous input (the quantised paths quantise it first): one
    pass fewer than :func:`swiglu_inplace` followed by ``.contiguous()``, same peak memory
    (one ``[chunk, ffn]`` tensor either way)."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def dequantize_fp8(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-tensor fp8 dequantisation, the same formula as comfy-kitchen's
    ``dequantize_per_tensor_fp8`` (``q.to(dtype) * scale.to(dtype)``)."""
    return qweight.to(dtype=dtype) * scale.to(device=qweight.device, dtype=dtype)


class Lease:
    """A Linear's weights obtained once for one MLP call, applied to every chunk.

    ``apply(inp)`` returns ``inp @ W.T + b`` for one chunk; ``apply_into(inp, out)`` writes it
    into ``out`` (a row slice of the preallocated result).  ``transients`` are tensors the
    lease created or received that kernels read (cast buffers, dequantised / patched weights):
    they are fenced after the last chunk.  ``release()`` gives them back (ComfyUI's
    ``uncast_bias_weight`` for comfy leases); it runs after the fence is recorded.
    """

    contiguous_input = False   # dense mm accepts the strided activation view

    def __init__(self, transients: Iterable[Any] = (), release: Callable[[], None] | None = None,
                 label: str = ""):
        self.transients = [t for t in transients if isinstance(t, torch.Tensor)]
        self._release = release
        self.released = False
        self.label = label

    def apply(self, inp: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def apply_into(self, inp: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(self.apply(inp))

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        if self._release is not None:
            self._release()


class DenseLease(Lease):
    """Plain weight/bias tensors: ``F.linear`` semantics, written straight into ``out``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 transients: Iterable[Any] = (), release: Callable[[], None] | None = None,
                 label: str = ""):
        super().__init__(transients, release, label)
        self.weight = weight
        self.bias = bias

    def apply(self, inp: torch.Tensor) -> torch.Tensor:
        return F.linear(inp, self.weight, self.bias)

    def apply_into(self, inp: torch.Tensor, out: torch.Tensor) -> None:
        # at::linear on 2-D input is addmm(bias, x, W.t()) / mm(x, W.t()): same kernels.
        if type(self.weight) not in (torch.Tensor, torch.nn.Parameter) \
                or out.dtype != inp.dtype or self.weight.dtype != inp.dtype \
                or (self.bias is not None and self.bias.dtype != inp.dtype):
            out.copy_(F.linear(inp, self.weight, self.bias))
        elif self.bias is None:
            torch.mm(inp, self.weight.t(), out=out)
        else:
            torch.addmm(self.bias, inp, self.weight.t(), out=out)


class CallableLease(Lease):
    """Any per-chunk callable (quantised matmul, INT8 fused kernel, plain module)."""

    contiguous_input = True

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], transients: Iterable[Any] = (),
                 release: Callable[[], None] | None = None, label: str = "",
                 fused_act: bool = False):
        super().__init__(transients, release, label)
        self.fn = fn
        self.fused_act = fused_act   # fn takes the fc1 output and applies swiglu itself

    def apply(self, inp: torch.Tensor) -> torch.Tensor:
        return self.fn(inp)


def _flatten_tokens(x: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    lead = tuple(x.shape[:-1])
    return x.reshape(-1, x.shape[-1]), lead


def run_chunked_mlp(x: torch.Tensor, fc1: Lease, fc2: Lease, chunk_tokens: int,
                    out: torch.Tensor | None = None, fences: FenceBook | None = None,
                    stats: MlpStats | None = None, fence_label: str = "mlp",
                    before_chunk: Callable[[], None] | None = None) -> torch.Tensor:
    """``fc2(swiglu(fc1(x)))`` over token chunks; leases fenced then released.

    ``x``: ``[..., hidden]`` (leading dims flattened).  ``out`` (optional): ``[S, out]`` or
    ``[..., out]`` buffer to write into.  The leases are always released (also on error);
    their transients are fenced first when ``fences`` is given.  ``before_chunk`` runs before
    each chunk (ComfyUI's interrupt check); an exception from it stops the loop cleanly.
    """
    try:
        x2, lead = _flatten_tokens(x)
        S = x2.shape[0]
        c = max(1, int(chunk_tokens))
        if out is not None and not out.is_contiguous():
            raise ValueError("out must be contiguous (chunks are written into row slices of it)")
        if out is not None:
            out2 = out.reshape(S, out.shape[-1]) if S > 0 else out.reshape(0, out.shape[-1])
        else:
            out2 = None
        n_chunks = 0
        for a in range(0, S, c):
            if before_chunk is not None:
                before_chunk()
            b = min(a + c, S)
            h = fc1.apply(x2[a:b])
            if getattr(fc2, "fused_act", False):
                inp = h
            elif fc2.contiguous_input:
                inp = swiglu_contiguous(h)
            else:
                inp = swiglu_inplace(h)
            if out2 is None:
                y = fc2.apply(inp)
                out2 = torch.empty((S, y.shape[-1]), dtype=y.dtype, device=y.device)
                out2[a:b].copy_(y)
                del y
            else:
                fc2.apply_into(inp, out2[a:b])
            del h, inp
            n_chunks += 1
        if out2 is None:
            # S == 0: shape-only pass so the output has the right width / dtype
            h = fc1.apply(x2)
            inp = h if getattr(fc2, "fused_act", False) else swiglu_inplace(h)
            out2 = fc2.apply(inp)
        if stats is not None:
            with _STATS_LOCK:
                stats.chunks += n_chunks
        result = out if out is not None else out2.reshape(*lead, out2.shape[-1])
        return result
    finally:
        transients = list(fc1.transients) + list(fc2.transients)
        if fences is not None and transients:
            # Event recorded now = after the last chunk's kernels on the current stream.
            fences.hold(transients, label=fence_label)
            if stats is not None:
                with _STATS_LOCK:
                    stats.fenced += 1
        try:
            fc1.release()
        finally:
            fc2.release()


def chunked_swiglu(x: torch.Tensor, fc1_weight: torch.Tensor, fc1_bias: torch.Tensor | None,
                   fc2_weight: torch.Tensor, fc2_bias: torch.Tensor | None, chunk_tokens: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``fc2(silu(gate) * up)`` with ``gate, up = fc1(x).chunk(2, -1)``, per token chunk.

    ``x``: ``[S, hidden]`` or ``[..., hidden]``; weights in ``F.linear`` layout
    (``fc1_weight``: ``[2*ffn, hidden]``, ``fc2_weight``: ``[hidden_out, ffn]``).  Each chunk:
    fc1 -> in-place SwiGLU in the gate half -> fc2 written into a slice of the
    preallocated output (``out``, ``[..., hidden_out]``, allocated when None).
    ``chunk_tokens <= 0`` or ``>= S`` runs one chunk.
    """
    x2, lead = _flatten_tokens(x)
    S = x2.shape[0]
    c = int(chunk_tokens) if chunk_tokens and int(chunk_tokens) > 0 else max(S, 1)
    n_out = fc2_weight.shape[0]
    if out is None:
        out = torch.empty((*lead, n_out), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) not in ((*lead, n_out), (S, n_out)):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {(*lead, n_out)}")
    return run_chunked_mlp(x, DenseLease(fc1_weight, fc1_bias, label="fc1"),
                           DenseLease(fc2_weight, fc2_bias, label="fc2"), c, out=out)


def reference_swiglu(x: torch.Tensor, fc1_weight, fc1_bias, fc2_weight, fc2_bias) -> torch.Tensor:
    """The unpatched ComfyUI eager path: fc1 full -> ``_swiglu_eager`` -> fc2."""
    h = F.linear(x, fc1_weight, fc1_bias)
    gate, up = h.chunk(2, dim=-1)
    return F.linear(F.silu(gate).mul_(up), fc2_weight, fc2_bias)


# ---------------------------------------------------------------------------------------
# ComfyUI-facing part (lazy imports only)
# ---------------------------------------------------------------------------------------
class Unsupported(Exception):
    """This Linear cannot be leased safely: run ComfyUI's own forward instead."""


def _comfy_ops():
    import comfy.ops as ops  # lazy: safe_ops never imports ComfyUI at module import time
    return ops


def _is_quantized(t: Any) -> bool:
    qt = getattr(sys.modules.get("comfy.quant_ops"), "QuantizedTensor", None)
    if isinstance(qt, type) and isinstance(t, qt):
        return True
    return hasattr(t, "_qdata") and hasattr(t, "_params")


def _layout_name(t: Any) -> str:
    lc = getattr(t, "_layout_cls", None)
    return lc if isinstance(lc, str) else getattr(lc, "__name__", str(lc))


def _ranges(t: Any) -> list[tuple[int, int]]:
    """Device address ranges a tensor (or QuantizedTensor) reads."""
    out = []
    if t is None:
        return out
    if _is_quantized(t):
        for name in ("_qdata",):
            out += _ranges(getattr(t, name, None))
        params = getattr(t, "_params", None)
        out += _ranges(getattr(params, "scale", None))
        return out
    if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.numel() > 0:
        try:
            p = t.data_ptr()
            out.append((p, p + t.numel() * t.element_size()))
        except Exception:  # pragma: no cover
            pass
    return out


def _overlap(a: Iterable[Any], b: Iterable[Any]) -> bool:
    ra = [r for t in a for r in _ranges(t)]
    rb = [r for t in b for r in _ranges(t)]
    return any(x0 < y1 and y0 < x1 for x0, x1 in ra for y0, y1 in rb)


def _is_param_of(t: Any, linear: torch.nn.Module) -> bool:
    for name in ("weight", "bias"):
        p = getattr(linear, name, None)
        if p is None or t is None:
            continue
        if t is p:
            return True
        try:
            if isinstance(t, torch.Tensor) and not _is_quantized(t) and not _is_quantized(p) \
                    and t.data_ptr() == p.data_ptr() and t.shape == p.shape:
                return True
        except Exception:
            pass
    return False


def _cast_once(linear, stats: MlpStats, **kw):
    """``comfy.ops.cast_bias_weight(linear, ..., offloadable=True)``; returns weight, bias,
    offload_stream, the transients to fence and a release closure."""
    ops = _comfy_ops()
    weight, bias, offload_stream = ops.cast_bias_weight(linear, offloadable=True, **kw)
    with _STATS_LOCK:
        stats.casts += 1
    extra = []
    if isinstance(offload_stream, tuple):
        extra = [t for t in offload_stream[1:] if isinstance(t, torch.Tensor)]
    transients = []
    for t in [weight, bias, *extra]:
        if t is None or _is_param_of(t, linear):
            continue
        if _is_quantized(t):
            transients += [getattr(t, "_qdata", None)]
        else:
            transients.append(t)

    def release():
        _comfy_ops().uncast_bias_weight(linear, weight, bias, offload_stream)

    return weight, bias, offload_stream, transients, release


class _FallbackProbe(logging.Handler):
    """Catches comfy-kitchen's "FP8 _scaled_mm failed ... falling back to dequantization"."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.fell_back = False

    def emit(self, record):
        try:
            if "falling back" in record.getMessage():
                self.fell_back = True
        except Exception:  # pragma: no cover
            pass


_CK_FP8_LOGGER = "comfy_kitchen.tensor.fp8"
#: (device type, device index, layout) -> True when the quantised matmul runs natively
_FP8_NATIVE: dict = {}


def _fp8_probe_key(weight: Any, device: torch.device) -> tuple:
    return (device.type, device.index, _layout_name(weight))


#: input layouts whose quantisation of one row does not depend on other rows when the
#: layer has no input_scale (comfy's FP8 layouts use scale 1.0; MXFP8 scales 1x32 blocks)
_ROW_INDEPENDENT_LAYOUTS = ("TensorCoreFP8Layout", "TensorCoreFP8E4M3Layout",
                            "TensorCoreFP8E5M2Layout", "TensorCoreMXFP8Layout")
#: layouts that are row independent only with a fixed (checkpoint) input scale
_ROW_INDEPENDENT_WITH_SCALE = ("TensorCoreNVFP4Layout",)


def _row_independent_input_quant(layout_type: Any, input_scale: Any) -> bool:
    name = layout_type if isinstance(layout_type, str) else getattr(layout_type, "__name__", "")
    if name in _ROW_INDEPENDENT_LAYOUTS:
        return True
    return name in _ROW_INDEPENDENT_WITH_SCALE and input_scale is not None


def _mixed_precision_kind(linear) -> bool:
    return "MixedPrecisionOps" in type(linear).__qualname__ or hasattr(linear, "_full_precision_mm")


def comfy_linear_lease(linear: torch.nn.Module, sample: torch.Tensor, stats: MlpStats = MLP_STATS,
                       label: str = "") -> Lease:
    """Lease ``linear``'s weight for one MLP call, mirroring what ``linear.forward`` would do
    with ``sample`` (dtype/device of the chunk inputs), with ONE cast.

    Raises :class:`Unsupported` before casting anything when the layer's class is not one
    whose forward is reproduced here exactly.
    """
    ops = _comfy_ops()
    cls = type(linear)
    fn_w = list(getattr(linear, "weight_function", []) or [])
    fn_b = list(getattr(linear, "bias_function", []) or [])

    # plain torch Linear (or any module that is not a comfy cast op): nothing is cast
    if not hasattr(linear, "comfy_cast_weights") and type(linear) is torch.nn.Linear:
        return DenseLease(linear.weight, linear.bias, label=label)

    if _mixed_precision_kind(linear):
        return _mixed_precision_lease(linear, sample, stats, label, fn_w, fn_b)

    dwi = getattr(getattr(ops, "disable_weight_init", None), "Linear", None)
    if dwi is None or not isinstance(linear, dwi):
        raise Unsupported(f"unknown Linear class {cls.__module__}.{cls.__qualname__}")
    # classes that override forward_comfy_cast_weights (legacy fp8_ops, cublas_ops, others'
    # packs) do more than cast + F.linear: not reproduced here.
    if cls.forward_comfy_cast_weights is not dwi.forward_comfy_cast_weights or cls.forward is not dwi.forward:
        raise Unsupported(f"{cls.__module__}.{cls.__qualname__} overrides the cast forward")
    if not (getattr(linear, "comfy_cast_weights", False) or fn_w or fn_b):
        # disable_weight_init without casting: torch.nn.Linear.forward on the parameters
        if _is_quantized(linear.weight):
            raise Unsupported("quantized weight on a non-casting Linear")
        return DenseLease(linear.weight, linear.bias, label=label)
    weight, bias, _os, transients, release = _cast_once(linear, stats, input=sample)
    return _dense_or_dequant(weight, bias, sample, transients, release, stats, label)


def _dequant_once(weight, release, stats):
    try:
        w = weight.dequantize()
    except Exception:
        if release is not None:
            release()
        raise
    with _STATS_LOCK:
        stats.dequants += 1
    return w


def _dense_or_dequant(weight, bias, sample, transients, release, stats, label):
    if _is_quantized(weight):
        # F.linear(bf16, QuantizedTensor) would dequantise inside every call: do it once.
        try:
            w = weight.dequantize()
        except Exception:
            release()
            raise
        with _STATS_LOCK:
            stats.dequants += 1
        transients = list(transients) + [w]
        weight = w
    return DenseLease(weight, bias, transients=transients, release=release, label=label)


def _mixed_precision_lease(linear, sample, stats, label, fn_w, fn_b) -> Lease:
    """``MixedPrecisionOps.Linear.forward`` (inference path) with the cast done once."""
    ops = _comfy_ops()
    mm = sys.modules.get("comfy.model_management")
    if getattr(linear, "pre_quant_scale", None) is not None:
        raise Unsupported("pre_quant_scale (AWQ smoothing) layer")
    QuantizedTensor = getattr(ops, "QuantizedTensor", None)
    QUANT_ALGOS = getattr(ops, "QUANT_ALGOS", {}) or {}
    layout_type = getattr(linear, "layout_type", None)
    use_quantized = (layout_type is not None
                     and not getattr(linear, "_full_precision_mm", False)
                     and not getattr(linear, "comfy_force_cast_weights", False)
                     and not fn_w and not fn_b)
    quantize_input = QUANT_ALGOS.get(getattr(linear, "quant_format", None), {}).get("quantize_input", True)
    compute_dtype = sample.dtype
    device = sample.device

    if use_quantized and quantize_input:
        if QuantizedTensor is None:
            raise Unsupported("comfy.ops.QuantizedTensor missing")
        scale = getattr(linear, "input_scale", None)
        if not _row_independent_input_quant(layout_type, scale):
            # e.g. NVFP4 without input_scale: per-tensor amax over ALL tokens -> chunking
            # would change the numbers.
            raise Unsupported(f"input quantisation of {layout_type} depends on all tokens")
        if scale is not None:
            scale = mm.cast_to_device(scale, device, None)
        # cast_bias_weight(self, input=<QuantizedTensor>) derives dtype = orig_dtype = sample
        # dtype, bias_dtype = dtype, device = input device: pass them explicitly.
        weight, bias, _os, transients, release = _cast_once(
            linear, stats, input=None, dtype=compute_dtype, device=device, bias_dtype=compute_dtype,
            compute_dtype=compute_dtype, want_requant=True)
        state = {"deq": None}
        key = _fp8_probe_key(weight, device) if _is_quantized(weight) else None
        if key is not None and _FP8_NATIVE.get(key) is False:
            state["deq"] = _dequant_once(weight, release, stats)
            transients = list(transients) + [state["deq"]]

        def fn(inp, weight=weight, bias=bias, scale=scale):
            q = QuantizedTensor.from_float(inp, layout_type, scale=scale)
            if state["deq"] is not None:
                # what comfy-kitchen's fallback computes (dequantize_args), weight dequantised once
                return F.linear(q.dequantize(), state["deq"], bias)
            if key is None or key in _FP8_NATIVE:
                return F.linear(q, weight, bias)
            # first call for this device/layout: does the native quantised matmul run, or
            # does comfy-kitchen fall back to dequantising the weight inside every call?
            probe = _FallbackProbe()
            lg = logging.getLogger(_CK_FP8_LOGGER)
            lg.addHandler(probe)
            try:
                y = F.linear(q, weight, bias)
            finally:
                lg.removeHandler(probe)
            _FP8_NATIVE[key] = not probe.fell_back
            if probe.fell_back:
                state["deq"] = _dequant_once(weight, None, stats)
                lease.transients.append(state["deq"])
            return y
        lease = CallableLease(fn, transients=transients, release=release, label=label)
        return lease

    weight_only_quant = use_quantized and not quantize_input and _is_quantized(linear.weight)
    if weight_only_quant:
        weight, bias, _os, transients, release = _cast_once(
            linear, stats, input=None, dtype=linear.weight.dtype, device=device,
            bias_dtype=compute_dtype, compute_dtype=compute_dtype, want_requant=True)
        weight = weight.to(dtype=compute_dtype)
        return CallableLease(lambda inp, w=weight, b=bias: F.linear(inp, w, b),
                             transients=transients, release=release, label=label)

    weight, bias, _os, transients, release = _cast_once(
        linear, stats, input=sample, compute_dtype=compute_dtype, want_requant=False)
    return _dense_or_dequant(weight, bias, sample, transients, release, stats, label)


def _int8_fused_fc2_lease(fc2, h_dtype, device, stats, label) -> Lease | None:
    """``linear_input_act``'s INT8 path (activation fused into the INT8 quantiser), per chunk.

    Returns None when that path would not be taken (then fc2 is an ordinary Linear call on
    ``_swiglu_eager(x)``)."""
    ops = _comfy_ops()
    mm = sys.modules.get("comfy.model_management")
    w = getattr(fc2, "weight", None)
    if (getattr(mm, "in_training", False) or not _is_quantized(w)
            or getattr(w, "_layout_cls", None) != "TensorWiseINT8Layout"
            or getattr(getattr(w, "_params", None), "transposed", False)):
        return None
    if getattr(fc2, "_full_precision_mm", False):
        # 0dd9b154's linear_input_act still takes the fused INT8 path here; later ComfyUI takes
        # the eager path instead. Which one this ComfyUI takes is not reproduced: its own MLP.
        raise Unsupported("INT8 fc2 with full_precision_mm (linear_input_act's branch differs by ComfyUI version)")
    quant_ops = getattr(ops, "quant_ops", None)
    ck = getattr(quant_ops, "ck", None)
    layout = getattr(ops, "TensorWiseINT8Layout", None)
    if ck is None or layout is None:
        raise Unsupported("INT8 fc2 but comfy-kitchen is not available")
    weight, bias, _os, transients, release = _cast_once(
        fc2, stats, input=None, dtype=h_dtype, device=device, bias_dtype=h_dtype,
        compute_dtype=h_dtype, want_requant=True)
    if not _is_quantized(weight):
        # a LoRA / dtype change handed back a dequantised weight: eager act + F.linear
        return DenseLease(weight, bias, transients=transients, release=release, label=label)
    qdata, scale = layout.get_plain_tensors(weight)
    convrot = getattr(weight._params, "convrot", False)
    group = getattr(weight._params, "convrot_groupsize", 256)

    def fn(h):
        return ck.int8_linear(h, qdata, scale, bias, h.dtype, convrot=convrot,
                              convrot_groupsize=group, input_act="swiglu")
    return CallableLease(fn, transients=transients, release=release, label=label, fused_act=True)


def swiglu_fc2_lease(fc2: torch.nn.Module, dtype: torch.dtype, device: torch.device, ffn: int,
                     stats: MlpStats = MLP_STATS) -> Lease:
    """``comfy.ops.linear_input_act(fc2, h, "swiglu")`` for one MLP call, fc2 cast once: the
    INT8 path with SwiGLU fused into the input quantiser, else fc2's own Linear forward on
    the eager SwiGLU (which :func:`run_chunked_mlp` applies per chunk).  Raises
    :class:`Unsupported` where neither is reproduced exactly."""
    lease = _int8_fused_fc2_lease(fc2, dtype, device, stats, "fc2")
    if lease is None:
        lease = comfy_linear_lease(fc2, torch.empty((1, ffn), dtype=dtype, device=device), stats, label="fc2")
    return lease


def _unmirrored_branch(ops, fc2, x: torch.Tensor) -> str | None:
    """Why ComfyUI's ``linear_input_act`` would take a branch for ``fc2`` that the chunk loop
    does not reproduce, or None.

    Later ComfyUI (not 0dd9b154) runs fc2 through comfy-kitchen's fp16-accumulation GEMM
    (``ck.fp16_linear``) when ``comfy.ops._fp16_linear_wanted(x)`` (fp16 CUDA activations with
    fp16 accumulation enabled) and fc2's weight is neither quantised nor full-precision-mm.
    That kernel picks its implementation by token count, so per-chunk calls would not give
    the unchunked numbers: run ComfyUI's own MLP instead (counted, logged).
    """
    wanted = getattr(ops, "_fp16_linear_wanted", None)
    if wanted is None:
        return None
    try:
        fp16_gemm = bool(wanted(x))
    except Exception as e:  # an unknown signature: do not guess which branch runs
        return f"comfy.ops._fp16_linear_wanted failed ({type(e).__name__}: {e})"
    if fp16_gemm and not _is_quantized(getattr(fc2, "weight", None)) \
            and not getattr(fc2, "_full_precision_mm", False):
        return "fp16 accumulation: ComfyUI's linear_input_act uses comfy-kitchen fp16_linear (not reproduced per chunk)"
    return None


def _mlp_dims(module) -> tuple[int, int]:
    fc1, fc2 = module.fc1, module.fc2
    hidden = getattr(fc1, "in_features", None) or fc1.weight.shape[-1]
    ffn = getattr(fc2, "in_features", None) or fc2.weight.shape[-1]
    return int(hidden), int(ffn)


def _unpatched(module, x):
    return type(module).forward(module, x)


def h3_mlp_forward(module: torch.nn.Module, x: torch.Tensor, chunk_setting: Any = "auto",
                   fences: FenceBook | None = GLOBAL_FENCES, stats: MlpStats = MLP_STATS,
                   budget_bytes: int | None = None) -> torch.Tensor:
    """Replacement for ``comfy.ldm.minimax.model.MLP.forward``: same result, token chunks,
    each weight cast once per call, transients fenced, released through ComfyUI."""
    with _STATS_LOCK:
        stats.calls += 1
    S = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in module.parameters())):
        stats.fallback("autograd enabled")
        return _unpatched(module, x)
    mm = sys.modules.get("comfy.model_management")
    if getattr(mm, "in_training", False):
        stats.fallback("comfy in_training")
        return _unpatched(module, x)
    hidden, ffn = _mlp_dims(module)
    c = resolve_chunk(chunk_setting, S, hidden, ffn, x.dtype, x.device, budget_bytes)
    if c >= S:
        with _STATS_LOCK:
            stats.passthrough += 1
        return _unpatched(module, x)
    ops = _comfy_ops()
    if getattr(ops, "linear_input_act", None) is None:
        stats.fallback("comfy.ops.linear_input_act missing")
        return _unpatched(module, x)
    why = _unmirrored_branch(ops, module.fc2, x)
    if why is not None:
        stats.fallback(why)
        return _unpatched(module, x)

    x2, lead = _flatten_tokens(x)
    sample = x2[:1]
    fc1 = fc2 = None
    try:
        fc1 = comfy_linear_lease(module.fc1, sample, stats, label="fc1")
        # fc1's output (the fc2 input) has x's dtype in every path reproduced here
        fc2 = swiglu_fc2_lease(module.fc2, x.dtype, x.device, ffn, stats)
    except Unsupported as e:
        for lease in (fc1, fc2):
            if lease is not None:
                lease.release()
        stats.fallback(str(e))
        return _unpatched(module, x)
    except BaseException:
        for lease in (fc1, fc2):
            if lease is not None:
                lease.release()
        raise

    # Both casts are done before any chunk reads them.  If ComfyUI handed both out of the
    # same stream cast buffer (one offload stream), fc2's copy overwrote fc1's weight:
    # give both back untouched and run ComfyUI's own forward.
    fc1_reads = [getattr(fc1, "weight", None), getattr(fc1, "bias", None)] + list(fc1.transients)
    if _overlap(fc1_reads, list(fc2.transients)):
        fc1.release()
        fc2.release()
        stats.fallback("fc1 and fc2 cast into the same buffer")
        return _unpatched(module, x)

    with _STATS_LOCK:
        stats.chunked_calls += 1
    # ComfyUI's Linear.forward calls run_every_op() (the interrupt check) per layer call
    y = run_chunked_mlp(x2, fc1, fc2, c, fences=fences, stats=stats, fence_label="h3_mlp",
                        before_chunk=getattr(_comfy_ops(), "run_every_op", None))
    return y.reshape(*lead, y.shape[-1])


# ---------------------------------------------------------------------------------------
# installation on a ModelPatcher
# ---------------------------------------------------------------------------------------
