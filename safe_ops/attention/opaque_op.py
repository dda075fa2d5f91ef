"""A guarded attention call as ONE opaque op to torch.compile (``torch.ops.safesage.attention``).

Under ``torch.compiler.is_compiling()`` a call that a guarded kernel may take is handed to the
custom op registered here (``torch.library.custom_op`` with a fake implementation, the way
flash-attn registers its kernels): dynamo sees one node whose output has the shape of ComfyUI's
attention output, and no graph break. The op's body runs eagerly when the compiled graph runs,
and runs SafeSage's whole path there (plan, execute, verify, count; fallbacks to ComfyUI's
function) by calling the SafeAttention it is keyed to. Eager calls never come here.

The op takes only what a custom op can take: q/k/v, ints, bools, a float, a dtype, and an int
key into this module's registry of (SafeAttention, ComfyUI function) pairs -- the key is made at
trace time by :func:`target_key` (``torch.compiler.assume_constant_result``: dynamo runs it, it
is not traced). What a call carries besides (e.g. ``transformer_options`` other than the block
index) does not reach the body: a call the body hands to ComfyUI's function gets the tensors,
``heads``, the reshape flags, ``scale``, ``enable_gqa``, ``attn_precision``,
``low_precision_attention`` and the block index. Masked calls, full-precision calls and calls
of other forms never come here (special_calls.py passes them to ComfyUI's function traced).

Registered once per process (two copies of this module, e.g. the pack loaded under two names,
share one registry and one op, kept in ``sys.modules[STATE_MODULE]``). On a torch without
``torch.library.custom_op`` :data:`OP` is None and SafeSage hands calls under torch.compile to
ComfyUI's function (special_calls.py says so once).
"""
from __future__ import annotations

import itertools
import sys
import types
import weakref
from typing import Any, Callable, Optional

import torch

from .call_forms import BASE_KEY, call_arguments

OP_NAME = "safesage::attention"
#: ``block_index`` of a call that is not the base model's own block's (quality/blocks.py BASE_KEY)
OTHER_TOWER = -2
STATE_MODULE = "safesage_opaque_op_state"      # the process-wide registry and op


def _body(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, skip_reshape: bool,
          skip_output_reshape: bool, scale: Optional[float], low_precision: bool, block_index: int,
          enable_gqa: bool, attn_precision: Optional[torch.dtype], target: int) -> torch.Tensor:
    """The op at run time: SafeSage's eager path for this call (or, when its SafeAttention is
    gone, what ComfyUI runs)."""
    att_ref, func = _state().targets[target]
    kwargs: dict[str, Any] = {"skip_reshape": skip_reshape, "skip_output_reshape": skip_output_reshape,
                              "attn_precision": attn_precision, "_inside_attn_wrapper": True}
    if scale is not None:
        kwargs["scale"] = scale
    if not low_precision:
        kwargs["low_precision_attention"] = False
    if enable_gqa:
        kwargs["enable_gqa"] = True
    if block_index >= 0:
        kwargs["transformer_options"] = {"block_index": block_index}
    elif block_index == OTHER_TOWER:          # not the base model's block (quality/blocks.py): not measured
        kwargs["transformer_options"] = {BASE_KEY: None}
    att = att_ref()
    if att is not None:
        out = att(func, q, k, v, heads, **kwargs)
    else:
        from .comfy_functions import comfy_function
        out = comfy_function(func)(q, k, v, heads, **kwargs)
    out = out.contiguous()                    # the fake's strides
    if any(out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in (q, k, v)):
        out = out.clone()                     # a custom op's output never aliases an input
    return out


def _fake(q, k, v, heads, skip_reshape, skip_output_reshape, scale, low_precision, block_index,
          enable_gqa, attn_precision, target):
    """ComfyUI's output shape: [B,H,Sq,D] with skip_output_reshape, else [B,Sq,H*D] (D: q's head
    width; read_call only sends calls whose v has it)."""
    if skip_reshape:
        b, h, s, d = q.shape
    else:
        b, s, hd = q.shape
        h, d = heads, hd // heads
    shape = (b, h, s, d) if skip_output_reshape else (b, s, h * d)
    return q.new_empty(shape)


def _state() -> types.ModuleType:
    st = sys.modules.get(STATE_MODULE)
    if st is None:
        st = types.ModuleType(STATE_MODULE)
        st.targets = {}                       # key -> (weakref to SafeAttention, function)
        st.by_id = {}                         # (att key, id(function)) -> key
        st.keys = itertools.count(1)
        st.atts = weakref.WeakValueDictionary()   # att key -> SafeAttention
        st.op = None
        custom_op = getattr(getattr(torch, "library", None), "custom_op", None)
        if custom_op is not None:
            op = custom_op(OP_NAME, mutates_args=())(_body)
            op.register_fake(_fake)
            st.op = torch.ops.safesage.attention
        sys.modules[STATE_MODULE] = st       # registered: never again in this process
    return st


_STATE = _state()
OP: Callable | None = _STATE.op     # torch.ops.safesage.attention, or None (no custom_op here)
_assume_constant = getattr(getattr(torch, "compiler", None), "assume_constant_result", None) or (lambda f: f)


def register(att: Any) -> int:
    """A key for ``att`` (a SafeAttention), made when it is built (eagerly)."""
    key = next(_STATE.keys)
    _STATE.atts[key] = att
    return key


@_assume_constant
def target_key(att_key: int, func: Callable) -> int:
    """The op's int key for (SafeAttention ``att_key``, ComfyUI's ``func``): run by dynamo at trace
    time (not traced), so the registry is touched outside the graph; one key per pair."""
    hit = _STATE.by_id.get((att_key, id(func)))
    if hit is not None and _STATE.targets[hit][1] is func:
        return hit
    att = _STATE.atts.get(att_key)
    key = next(_STATE.keys)
    _STATE.targets[key] = ((weakref.ref(att) if att is not None else (lambda: None)), func)
    _STATE.by_id[(att_key, id(func))] = key
    return key


def read_call(args: tuple, kwargs: dict) -> tuple | None:
    """The op's arguments for a call a guarded kernel may take (dynamo traces this: no caches, no
    exceptions), or None: a masked or full-precision call, one that needs a gradient (the guarded
    kernels have no backward), or one of another form."""
    get = kwargs.get
    q, k, v, heads, mask, prec, skip_reshape, skip_out = call_arguments(args, kwargs)
    scale = get("scale")
    to = get("transformer_options")
    bi = to.get("block_index") if isinstance(to, dict) else None
    other = isinstance(to, dict) and BASE_KEY in to and (to[BASE_KEY] is None or to[BASE_KEY] != bi)
    T = torch.Tensor
    if (len(args) > 8 or mask is not None or get("low_precision_attention", True) is False
            or not (isinstance(q, T) and isinstance(k, T) and isinstance(v, T))
            or type(heads) is not int or heads < 1 or not isinstance(skip_reshape, bool)
            or not isinstance(skip_out, bool) or not (prec is None or isinstance(prec, torch.dtype))
            or not (scale is None or type(scale) in (float, int)) or not (bi is None or type(bi) is int)
            or q.dtype != k.dtype or q.dtype != v.dtype or q.device != k.device or q.device != v.device
            or q.requires_grad or k.requires_grad or v.requires_grad):     # the op has no backward
        return None
    if skip_reshape:
        if (q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[1] != heads
                or k.shape[3] != q.shape[3] or v.shape[3] != q.shape[3]):
            return None
    else:
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or q.shape[2] % heads or k.shape[2] != v.shape[2]:
            return None
        d = q.shape[2] // heads
        if d == 0 or k.shape[2] % d:
            return None
    return (q, k, v, heads, skip_reshape, skip_out, None if scale is None else float(scale), True,
            OTHER_TOWER if other else (-1 if bi is None else bi), bool(get("enable_gqa", False)), prec)


def call(att_key: int, func: Callable, c: tuple) -> torch.Tensor:
    """``c`` (read_call's tuple) through the op, for (SafeAttention ``att_key``, ``func``)."""
    return OP(*c, target_key(att_key, func))
