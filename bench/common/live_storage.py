"""Which tensor storages are live at a region's peak, and where each was allocated (CPU or GPU).

:class:`LiveStorages` is a ``TorchDispatchMode``: every op's output whose storage is not the storage
of one of the op's inputs (a view or an in-place result shares its input's) and is not already
known is a new allocation. It is recorded with its bytes, dtype, shape, the op and a short Python
stack (file:line:function outside torch: ComfyUI's, SafeSage's, the caller's), and a weak reference
on its ``UntypedStorage`` (PyTorch keeps one Python object per storage, so the reference dies
exactly when the storage is freed: a view keeps it alive, ``del`` of the last user frees it).
The running total of live bytes and a copy of the live set at its largest are kept.

What it does not see: memory a C++/CUDA kernel allocates inside one op and frees before returning
(its workspace), the caching allocator's slack, and storages made before the mode was entered
unless handed to :meth:`LiveStorages.add` (a region's inputs). ``torch.cuda.memory._record_memory_history``
is not used: it raises under ``cudaMallocAsync``, the allocator of the GPU runs.

No ComfyUI import; :func:`top_sites` and :func:`fit_linear` are pure.
"""
from __future__ import annotations

import os
import sys
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_THIS = os.path.abspath(__file__)


@dataclass
class Storage:
    """One live storage: its bytes, the tensor it was first seen as, where it was made."""
    nbytes: int
    dtype: str
    shape: tuple
    op: str
    stack: tuple          # innermost first: "path:line:function"
    label: str = ""       # set for storages handed to add() (a region's inputs)

    @property
    def site(self) -> str:
        return self.label or " < ".join(self.stack) or self.op


def _short_path(path: str, roots: tuple) -> str:
    p = os.path.abspath(path)
    for r in roots:
        if r and p.startswith(r.rstrip(os.sep) + os.sep):
            return os.path.relpath(p, r)
    i = p.find("site-packages" + os.sep)
    return p[i + len("site-packages") + 1:] if i >= 0 else os.path.basename(p)


def python_stack(depth: int, roots: tuple, skip: int = 2) -> tuple:
    """The innermost ``depth`` frames of the calling Python stack outside torch and this file, as
    ``path:line:function`` (paths relative to the first of ``roots`` holding them)."""
    out = []
    f = sys._getframe(skip)
    while f is not None and len(out) < depth:
        fn = os.path.abspath(f.f_code.co_filename)
        if not fn.startswith(_TORCH_DIR) and fn != _THIS:
            out.append(f"{_short_path(fn, roots)}:{f.f_lineno}:{f.f_code.co_name}")
        f = f.f_back
    return tuple(out)


def _storages(t) -> list:
    """The untyped storages behind a tensor (a wrapper subclass: its inner tensors')."""
    if not isinstance(t, torch.Tensor):
        return []
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is not None and type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return [s for n in names for s in _storages(getattr(t, n))]
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):       # a tensor without storage (meta, functional)
        return []


class LiveStorages(TorchDispatchMode):
    """Tracks live storages while active (``with LiveStorages(...) as tr:``).

    ``depth``: frames kept per allocation; ``roots``: folders paths are shown relative to.
    The peak is only taken inside a window: :meth:`enter` / :meth:`leave` open and close nested named
    windows (e.g. one block's forward, and inside it its attention and its MLP); ``peak`` /
    ``at_peak`` / ``peak_phase`` are over all of them, ``phase_peaks`` per name (the innermost window
    open when the bytes were reached). A tracker made with ``window=True`` (the default) takes the
    peak everywhere, under the name ``""``. Storages are tracked either way."""

    def __init__(self, depth: int = 4, roots: tuple = (), window: bool = True):
        super().__init__()
        self.depth = depth
        self.roots = tuple(os.path.abspath(r) for r in roots if r)
        self.live: dict[int, tuple] = {}        # id(storage) -> (Storage, weakref)
        self.bytes = 0
        self.peak = 0
        self.peak_phase: str | None = None
        self.at_peak: list[Storage] = []
        self.phase_peaks: dict[str, int] = {}
        self.allocations = 0
        self._phases: list[str] = [""] if window else []

    # ---------------------------------------------------------------- the peak windows
    def enter(self, phase: str) -> None:
        """Open the window ``phase`` (inside whatever is open); the bytes live now count for it."""
        self._phases.append(phase)
        self._note_peak()

    def leave(self) -> None:
        """Close the innermost window."""
        self._phases.pop()

    # ---------------------------------------------------------------- recording
    def add(self, t: torch.Tensor, label: str) -> None:
        """Count a storage made before tracking began (a region's input), under ``label``."""
        for st in _storages(t):
            if id(st) not in self.live and st.nbytes():
                self._record(st, Storage(st.nbytes(), str(t.dtype).replace("torch.", ""), tuple(t.shape),
                                         "input", (), label))
        self._note_peak()

    def _record(self, st, info: Storage) -> None:
        key = id(st)

        def freed(_ref, key=key):
            entry = self.live.get(key)
            if entry is not None and entry[1] is _ref:      # not a later storage that took the id
                del self.live[key]
                self.bytes -= entry[0].nbytes
        self.live[key] = (info, weakref.ref(st, freed))
        self.bytes += info.nbytes
        self.allocations += 1

    def _note_peak(self) -> None:
        if not self._phases:
            return
        phase = self._phases[-1]
        if self.bytes > self.phase_peaks.get(phase, -1):
            self.phase_peaks[phase] = self.bytes
        if self.bytes > self.peak:
            self.peak = self.bytes
            self.peak_phase = phase
            self.at_peak = [e[0] for e in self.live.values()]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = None
        new = False
        for t in tree_leaves(out):
            for st in _storages(t):
                key = id(st)
                entry = self.live.get(key)
                if entry is not None and entry[1]() is st:
                    if entry[0].nbytes != st.nbytes():          # resized in place (an out= argument)
                        self.bytes += st.nbytes() - entry[0].nbytes
                        entry[0].nbytes = st.nbytes()
                        new = True
                    continue
                if inputs is None:
                    inputs = {id(s) for a in tree_leaves((args, kwargs)) for s in _storages(a)}
                if key in inputs or not st.nbytes():            # a view / in-place result of an input
                    continue
                self._record(st, Storage(st.nbytes(), str(t.dtype).replace("torch.", ""), tuple(t.shape),
                                         str(func), python_stack(self.depth, self.roots)))
                new = True
        if new:
            self._note_peak()
        return out


@dataclass
class SiteBytes:
    site: str
    bytes: int
    storages: int
    dtype: str
    shapes: list = field(default_factory=list)

    def as_dict(self, per: int | None = None) -> dict:
        d = {"site": self.site, "bytes": self.bytes, "storages": self.storages, "dtype": self.dtype,
             "shapes": self.shapes[:4]}
        if per:
            d["units"] = round(self.bytes / per, 3)
        return d


def top_sites(storages: list, n: int = 15) -> list[SiteBytes]:
    """``storages`` grouped by allocation site, largest bytes first (ties: site name), ``n`` of them."""
    by: dict[str, SiteBytes] = {}
    for s in storages:
        g = by.get(s.site)
        if g is None:
            g = by[s.site] = SiteBytes(s.site, 0, 0, s.dtype)
        g.bytes += s.nbytes
        g.storages += 1
        if list(s.shape) not in g.shapes:
            g.shapes.append(list(s.shape))
    return sorted(by.values(), key=lambda g: (-g.bytes, g.site))[:n]


def fit_linear(xs: list, ys: list) -> tuple[float, float, float]:
    """Least squares ``y = a + b * x``: (a, b, the largest absolute residual). Needs two distinct xs."""
    n = len(xs)
    if n < 2 or len(set(xs)) < 2 or len(ys) != n:
        raise ValueError("fit_linear needs at least two distinct x values and one y per x")
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    return a, b, max(abs(y - (a + b * x)) for x, y in zip(xs, ys))
