"""The log-sum-exp merge of kv_chunks' key chunks: one fused Triton pass per chunk on CUDA,
PyTorch's ops elsewhere.

:class:`KeyChunkMerge` folds one block's key-chunk outputs ``o_c`` (LSE ``l_c``) into the block's
slice of the result: ``acc = acc*exp(L - L') + o_c*exp(l_c - L')`` with ``L' = logaddexp(L, l_c)``,
in float32, the last chunk's merge writing the result (in its dtype) directly. Exact up to float32
rounding: softmax over the union of the chunks' keys, as long as every ``l_c`` is off by the same
per-row constant.

Two implementations of the same math, chosen per block on its first chunk:

* **fused** (lse_merge_triton.py, one Triton launch per chunk after the first, on the current
  stream): with 2 chunks the first output is kept as it is (no float32 copy) and the second
  chunk's launch writes the result; with more, the first output becomes the float32 accumulator,
  each middle chunk updates it and the running LSE in place in one pass, and the last writes the
  result. Memory never exceeds the torch path's (Plan.extra_bytes prices that one): the kept first
  output is half the accumulator's size.
* **torch** (:func:`lse_merge`, the reference): logaddexp, two exps, ``mul_`` and ``addcmul_`` per
  chunk, then a copy into the result. Used on the CPU, where triton cannot be imported, for dtypes
  the kernel does not take, during CUDA-graph capture (a first Triton launch compiles and loads a
  module), and for the rest of the process after a fused launch raised (counted, logged once).

triton is imported on the first block that could use it (once per process), never when the pack
loads: a CPU-only ComfyUI never imports it. On the CPU, once the kernel was built for the Triton
interpreter (triton imported with ``TRITON_INTERPRET=1``: the unit tests), the fused path runs on CPU
tensors.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from ..ui import run_stats
from .errors import is_cuda_error, is_oom

log = logging.getLogger("SafeSage")

#: dtypes the fused kernel reads (chunk outputs) and writes (the result)
FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: the largest head dimension the fused kernel takes (one power-of-two block of D per row)
MAX_D = 1024


def lse_merge(acc: torch.Tensor | None, run: torch.Tensor | None, o: torch.Tensor,
              lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference merge with PyTorch's ops: fold one key chunk's normalised output ``o``
    [B,H,S,D] with LSE ``lse`` [B,H,S] into the running float32 ``acc`` / ``run`` (None to start).
    The first ``o`` becomes the accumulator (a float32 launch output is updated in place, not
    copied: it is the launch's own tensor, which nothing else reads)."""
    lse = lse.float()
    if acc is None:
        return o.float(), lse
    new = torch.logaddexp(run, lse)
    acc.mul_(torch.exp(run - new).unsqueeze(-1))
    acc.addcmul_(o, torch.exp(lse - new).unsqueeze(-1))
    return acc, new


# ---------------------------------------------------------------------- which implementation
_fused: Any = None          # None: not asked yet; the lse_merge_triton module; False: unavailable
_enabled: bool = True       # False: the torch merge everywhere (set_fused(False): benchmarks, tests)


def _import_fused() -> Any:
    from . import lse_merge_triton
    return lse_merge_triton


def fused_module() -> Any:
    """The Triton merge (module lse_merge_triton), imported on the first call, once per process;
    None where it cannot be imported or a fused launch failed before."""
    global _fused
    if _fused is None:
        try:
            _fused = _import_fused()
        except Exception as e:  # noqa: BLE001 - no triton, or one that cannot load: the torch merge
            _fused = False
            run_stats.once(("kv_merge", "import"), logging.INFO,
                           "SafeSage: key chunks are merged with PyTorch ops (the fused merge needs Triton: "
                           "%s: %s)", type(e).__name__, e)
    return _fused or None


def set_fused(enabled: bool) -> None:
    """Use the fused merge where it can run (True, the default) or the torch merge everywhere."""
    global _enabled
    _enabled = bool(enabled)


def fused_for(o: torch.Tensor, lse: torch.Tensor, dst: torch.Tensor) -> Any:
    """The fused merge's module when it can merge a block with chunk outputs like ``o``/``lse``
    into ``dst``, else None (the torch merge)."""
    if not _enabled:
        return None
    if (o.dtype not in FUSED_DTYPES or dst.dtype not in FUSED_DTYPES or o.dim() != 4
            or o.shape != dst.shape or tuple(lse.shape) != tuple(o.shape[:3]) or o.shape[-1] > MAX_D
            or o.device != dst.device or lse.device != o.device):
        return None
    dev = o.device.type
    if dev == "cuda":
        return None if torch.cuda.is_current_stream_capturing() else fused_module()
    # CPU tensors: only a kernel already built for the Triton interpreter (the tests) takes them;
    # a CPU block never imports triton
    return _fused if dev == "cpu" and _fused and getattr(_fused, "INTERPRETED", False) else None


def _fused_failed(e: Exception) -> None:
    """A fused launch raised before running (no compiler, a Triton that cannot build for this GPU):
    the torch merge from now on, in this process."""
    global _fused
    _fused = False
    run_stats.count("kv_merge_fused_failed")
    run_stats.once(("kv_merge", "failed"), logging.WARNING,
                   "SafeSage: the fused key-chunk merge failed (%s: %s); key chunks are merged with "
                   "PyTorch ops from now on", type(e).__name__, e)


# ---------------------------------------------------------------------- one block
class KeyChunkMerge:
    """Merges the ``n`` key chunks of one block, given in order with :meth:`add`, into ``dst`` (a
    [B,H,S,D] view of the result). After the ``n``-th chunk ``dst`` holds the merged output and
    nothing is kept. ``fused``: the fused module to use (tests); by default :func:`fused_for`
    chooses on the first chunk."""

    __slots__ = ("dst", "n", "seen", "fused", "choose", "acc", "run", "first")

    def __init__(self, dst: torch.Tensor, n: int, fused: Any = None):
        self.dst, self.n = dst, n
        self.seen = 0
        self.fused = fused
        self.choose = fused is None
        self.acc = self.run = None          # float32 accumulator and running LSE
        self.first = None                   # fused, 2 chunks: the first (o, lse), kept as they are

    def add(self, o: torch.Tensor, lse: torch.Tensor) -> None:
        self.seen += 1
        last = self.seen >= self.n
        lse = lse.float()
        if self.seen == 1 and self.choose:
            self.fused = fused_for(o, lse, self.dst)
            run_stats.count("kv_merge_fused" if self.fused is not None else "kv_merge_torch")
        if self.fused is not None:
            try:
                self._add_fused(o, lse, last)
                return
            except Exception as e:  # noqa: BLE001 - see _fused_failed; a sticky CUDA error or OOM propagates
                if is_cuda_error(e) or is_oom(e):
                    raise
                _fused_failed(e)
                self.fused = None
                if self.first is not None:
                    self.acc, self.run = lse_merge(None, None, *self.first)
                    self.first = None
        self.acc, self.run = lse_merge(self.acc, self.run, o, lse)
        if last:
            self.dst.copy_(self.acc)
            self.acc = self.run = None

    def _add_fused(self, o: torch.Tensor, lse: torch.Tensor, last: bool) -> None:
        """One chunk, fused. State changes only after the launch returned (a launch that raises
        leaves the block as it was, for the torch merge to go on from)."""
        f = self.fused
        if self.seen == 1:
            if last:
                self.dst.copy_(o)
            elif self.n == 2:
                self.first = (o, lse)
            else:
                # the accumulator keeps o's layout (.float() preserves a dense view's strides);
                # the running LSE is our own (written in place)
                self.acc = o.float()
                self.run = torch.empty(lse.shape, dtype=torch.float32, device=lse.device).copy_(lse)
            return
        if self.first is not None:                     # n == 2: the last chunk
            a, la = self.first
            f.merge(a, la, o, lse, self.dst, None)
            self.first = None
        elif last:
            f.merge(self.acc, self.run, o, lse, self.dst, None)
            self.acc = self.run = None
        else:
            f.merge(self.acc, self.run, o, lse, self.acc, self.run)
