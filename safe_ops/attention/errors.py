"""Which errors a kernel call can raise, and what each means for the call.

* a sticky CUDA error (illegal address, launch failure, device-side assert): the context is poisoned,
  nothing can be recomputed -- it propagates (:func:`is_cuda_error`);
* a build that cannot run here (a missing extension, a build for another GPU): nothing was launched,
  the family is switched off for the process (:func:`is_build_error`);
* out of memory: this call only goes to ComfyUI's own attention (:func:`is_oom`);
* anything else: this call only.
"""
from __future__ import annotations

import torch


# CUDA errors that leave the context unusable (sticky): nothing can be recomputed after them.
# Others ("no kernel image is available", "invalid device function": a build for another GPU)
# mean nothing was launched, so the call can be recomputed with another kernel.
_STICKY_CUDA_ERRORS = ("illegal memory access", "illegal address", "unspecified launch failure",
                       "misaligned address", "device-side assert", "illegal instruction",
                       "hardware stack error", "CUBLAS_STATUS_EXECUTION_FAILED", "launch timed out")


def is_cuda_error(e: BaseException) -> bool:
    """A sticky CUDA error (asynchronous, poisons the context): it cannot be recovered by
    recomputing, so it must propagate."""
    msg = str(e)
    return any(s in msg for s in _STICKY_CUDA_ERRORS)


# A kernel build that cannot run on this GPU at all: nothing was launched, and nothing will be
# (sage's "SM90 kernel is not available", CUDA's "no kernel image", a missing extension).
_BUILD_ERRORS = ("is not available", "no kernel image", "invalid device function", "not compiled",
                 "No module named", "undefined symbol")


def is_build_error(e: BaseException) -> bool:
    """The kernel's build cannot run here (every call would fail the same way): a missing
    extension, or an error that says the build has no kernel for this GPU. Not an error that only
    refuses one call (e.g. a ``NotImplementedError`` for one shape or dtype): that call falls back,
    the family stays on."""
    msg = str(e)
    return isinstance(e, ImportError) or any(s in msg for s in _BUILD_ERRORS)


def is_oom(e: BaseException) -> bool:
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", ())
    return isinstance(e, oom) or "out of memory" in str(e)
