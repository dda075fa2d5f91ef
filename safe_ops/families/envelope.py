"""Kernel envelopes: what each attention kernel can index, as data.

An :class:`Envelope` lists the integer products a kernel family computes when it
turns (batch, head, token) indices into element offsets, for every tensor it
reads or writes -- the caller's q/k/v and the temporaries and output it
allocates itself -- and the integer type each product is computed in. A call is
inside the envelope when every product fits its type, and the shape rules
(head dims, dtypes, masks, padding) hold.

Triton specialises an integer argument to i64 when its value does not fit in
i32; ``tl.program_id`` and ``tl.arange`` are i32. A product ``index * stride``
is therefore computed in i32 when the stride fits in i32 and in i64 otherwise,
unless the kernel casts the index to i64 first. Pointer additions are 64-bit,
so each product term must fit on its own, not their sum: measured with
sageattention 1.0.6 on an H200 (HAZARDS.md H-1: 99,865 vs 99,866 strided;
305,040 vs 305,041 contiguous, 56 heads x 128).

Every tensor a term names is a *role* of the call: the caller's ``q``/``k``/``v``,
``x:alloc`` (``torch.empty(x.shape)`` in the kernel's layout, :meth:`AttnCall.derived`), or a
tensor the family itself makes from the call (a quantised copy, a transposed V, ...), listed
in the family's ``Envelope.roles``. One :func:`check` evaluates every term on every role.

``check(call, envelope)`` returns :class:`Violation` records with the numbers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

I32_MAX = 2**31 - 1
U32_MAX = 2**32 - 1
I64_MAX = 2**63 - 1
# i16/u16 exist so tests can drive the same mechanism at CPU-sized shapes.
LIMITS = {"i16": 2**15 - 1, "u16": 2**16 - 1, "i32": I32_MAX, "u32": U32_MAX, "i64": I64_MAX}

_AXIS_INDEX = {"b": 0, "h": 1, "s": 2, "d": 3}

# Bytes: the most any envelope asks of a base pointer (comfy-kitchen's V, 16). A fresh allocation
# (CUDA caching allocator: 512; CPU: 64) has at least this, so it is also the default.
ALIGN_CAP = 16


def byte_alignment(n: int, cap: int = ALIGN_CAP) -> int:
    """The largest power of two, at most ``cap``, that divides ``n`` (an address or a byte
    offset); ``cap`` for 0."""
    n = abs(int(n))
    return cap if n == 0 else min(n & -n, cap)


# --------------------------------------------------------------------------- call
@dataclass(frozen=True)
class TensorDesc:
    """A tensor as the kernel sees it, in canonical (b, h, s, d) order.

    ``align``: bytes the base pointer is aligned to (:func:`byte_alignment` of ``data_ptr()``,
    at most :data:`ALIGN_CAP`): a view at an odd element offset into a buffer has less. The
    default is a fresh allocation's (what :meth:`contiguous` describes)."""
    shape: tuple[int, int, int, int]
    stride: tuple[int, int, int, int]
    align: int = ALIGN_CAP

    @staticmethod
    def contiguous(shape: tuple[int, int, int, int], layout: str) -> "TensorDesc":
        """Strides of ``torch.empty(shape_in_layout)`` seen in (b, h, s, d) order."""
        b, h, s, d = shape
        if layout == "HND":
            return TensorDesc(shape, (h * s * d, s * d, d, 1))
        if layout == "NHD":
            return TensorDesc(shape, (s * h * d, d, h * d, 1))
        raise ValueError(f"unknown layout {layout!r}")

    @property
    def numel(self) -> int:
        n = 1
        for x in self.shape:
            n *= x
        return n


@dataclass(frozen=True)
class AttnCall:
    """One attention call, reduced to what envelopes and plans depend on.

    q/k/v are described in canonical (b, h, s, d) order whatever the caller's
    layout; ``layout`` is the layout the kernel is asked to use, which decides
    the strides of the tensors the kernel allocates itself.
    """
    q: TensorDesc
    k: TensorDesc
    v: TensorDesc
    dtype: str                      # "float16" | "bfloat16" | "float32" | ...
    layout: str = "HND"             # kernel tensor_layout
    has_mask: bool = False
    device: str = "cuda"            # "cuda" | "cpu" | ...
    arch: str = ""                  # e.g. "sm_90"
    elt_bytes: int = 2

    @property
    def heads(self) -> int:
        return self.q.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def q_len(self) -> int:
        return self.q.shape[2]

    @property
    def kv_len(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.q.shape[3]

    def derived(self, role: str) -> TensorDesc:
        """Caller tensors by name, or a kernel-allocated tensor (contiguous in ``layout``)."""
        if role in ("q", "k", "v"):
            return getattr(self, role)
        base, _, how = role.partition(":")
        src = getattr(self, base)
        if how == "alloc":              # torch.empty(x.shape) in the kernel's layout
            return TensorDesc.contiguous(src.shape, self.layout)
        raise KeyError(role)


# ----------------------------------------------------------------------- envelope
@dataclass(frozen=True)
class IndexTerm:
    """``index(axis) * stride(axis)`` of ``tensor`` computed by ``kernel``.

    ``itype`` is the integer type of the product when the stride fits in its
    type (a kernel that casts the index to i64 first is listed as "i64").
    ``cite`` names the source line the term comes from.

    ``stride_only``: the stride itself is handed over in ``itype`` (a C ``int`` parameter, a
    TMA descriptor, a host-side check), so it must fit whatever the extent -- a batch stride
    with one batch included -- and no Triton-style widening applies.
    """
    kernel: str
    tensor: str        # a role: "q", "k", "v", "q:alloc", or one of the family's Envelope.roles
    axis: str          # "b" | "h" | "s" | "d"
    itype: str         # "i32" | "u32" | "i64"
    cite: str
    stride_only: bool = False


@dataclass(frozen=True)
class Violation:
    kernel: str
    rule: str          # "index" | "head_dim" | "dtype" | "mask" | "layout" | "padding" | "length" | "device"
    #                    | "align" ("length" rules are on the key length only: key/value chunks can
    #                    satisfy them; "align" rules on base pointers and strides: a copy satisfies them)
    detail: str
    tensor: str = ""
    axis: str = ""
    value: int = 0
    limit: int = 0
    cite: str = ""

    def __str__(self) -> str:
        if self.rule == "index":
            return (f"{self.kernel}: {self.tensor}.{self.axis} offset {self.value:,} > {self.limit:,} "
                    f"({self.detail}) [{self.cite}]")
        return f"{self.kernel}: {self.rule}: {self.detail}" + (f" [{self.cite}]" if self.cite else "")


@dataclass(frozen=True)
class Envelope:
    family: str
    source: str                                  # package/version the entries were read from
    head_dims: tuple[int, ...]
    dtypes: tuple[str, ...]
    supports_mask: bool
    terms: tuple[IndexTerm, ...]
    launches_on_legacy_stream: bool = False      # CUDA <<<>>> on stream 0 (sage 2.x C++)
    devices: tuple[str, ...] = ("cuda",)
    last_dim_contiguous: bool = True             # kernel asserts stride(-1) == 1
    extra_rules: tuple[Callable[["AttnCall"], list[Violation]], ...] = field(default=(), compare=False)
    temp_bytes: Callable[["AttnCall"], int] | None = field(default=None, compare=False)
    # Tensors the kernel makes from the call (quantised copies, transposed/padded V, ...), by
    # role name: terms name them like "q" or "k:alloc" (see role()).
    roles: Mapping[str, Callable[["AttnCall"], TensorDesc]] = field(default_factory=dict, compare=False)
    note: str = ""
    # The kernel can return the log-sum-exp of each query row (sage 2.x ``return_lse=True``),
    # so launches over slices of the keys can be merged exactly: the planner's ``kv_chunks``.
    # Kernels without it (sage 1.0.6 ``sageattn``, comfy-kitchen ``int8_attention``) never get
    # key/value chunks.
    returns_lse: bool = False
    # kv_chunks hands this kernel keys minus the whole sequence's mean (a per-chunk copy) and
    # turns the kernel's own per-chunk smoothing off, so every chunk is quantised exactly as
    # the unchunked call would (sage 2.x ``smooth_k``): the row-constant q.mean(k) term then
    # drops out of every chunk's LSE alike and cancels in the merge.
    lse_centred_k: bool = False
    # Time of the LSE-returning call relative to the plain one on the same inputs (measured):
    # what a kv_chunks plan pays before any split, which the priced choice of ``auto`` counts.
    lse_time_factor: float = 1.0


def role(call: AttnCall, env: Envelope, name: str) -> TensorDesc:
    """The tensor ``name`` of ``call`` as ``env``'s kernel sees it: one of the family's own
    :attr:`Envelope.roles`, else a caller tensor or ``x:alloc`` (:meth:`AttnCall.derived`)."""
    make = env.roles.get(name)
    return make(call) if make is not None else call.derived(name)


def term_value(call: AttnCall, term: IndexTerm, env: Envelope) -> tuple[int, str]:
    """Largest value ``env``'s kernel computes for ``term`` and its effective int type: the last
    index times the stride, or (``stride_only``) the stride itself."""
    t = role(call, env, term.tensor)
    ax = _AXIS_INDEX[term.axis]
    stride = t.stride[ax]
    if term.stride_only:
        return stride, term.itype
    extent = t.shape[ax]
    if extent <= 0:
        return 0, term.itype
    itype = term.itype
    if itype in ("i16", "i32") and stride > LIMITS[itype]:
        itype = "i64"    # Triton passes a stride >= 2**31 as i64, the product is i64
    return (extent - 1) * stride, itype


def check(call: AttnCall, env: Envelope) -> list[Violation]:
    """Every way ``call`` leaves ``env``; empty list = safe to launch."""
    out: list[Violation] = []
    if call.device not in env.devices:
        out.append(Violation(env.family, "device", f"tensors on {call.device}, kernel runs on {env.devices}"))
    if call.head_dim not in env.head_dims:
        out.append(Violation(env.family, "head_dim", f"head_dim {call.head_dim} not in {env.head_dims}"))
    if call.dtype not in env.dtypes:
        out.append(Violation(env.family, "dtype", f"dtype {call.dtype} not in {env.dtypes}"))
    if call.has_mask and not env.supports_mask:
        out.append(Violation(env.family, "mask", "attention mask not supported"))
    if call.heads % max(call.kv_heads, 1) != 0:
        out.append(Violation(env.family, "layout", f"q heads {call.heads} not a multiple of kv heads {call.kv_heads}"))
    for tname in ("q", "k", "v") if env.last_dim_contiguous else ():
        if call.derived(tname).stride[3] != 1 and call.derived(tname).shape[3] > 1:
            out.append(Violation(env.family, "layout", f"{tname} last dim not contiguous"))
    for term in env.terms:
        value, itype = term_value(call, term, env)
        limit = LIMITS[itype]
        if value > limit:
            t = role(call, env, term.tensor)
            ax = _AXIS_INDEX[term.axis]
            shape = "x".join(f"{n:,}" for n in t.shape)
            what = (f"stride {value:,} of {term.tensor}.{term.axis} [{shape}] passed as {itype}" if term.stride_only
                    else f"({t.shape[ax]:,}-1) x stride {t.stride[ax]:,} in {itype}")
            out.append(Violation(
                env.family, "index", f"{term.kernel}: {what}",
                tensor=term.tensor, axis=term.axis, value=value, limit=limit, cite=term.cite))
    for rule in env.extra_rules:
        out.extend(rule(call))
    return out


# The envelopes of every registered family, by name: each family module registers its own
# (registry.py imports them all).
FAMILIES: dict[str, Envelope] = {}


def register(env: Envelope) -> Envelope:
    FAMILIES[env.family] = env
    return env
