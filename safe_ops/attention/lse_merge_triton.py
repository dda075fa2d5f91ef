"""The fused key-chunk merge as one Triton kernel (imported only by lse_merge.py, lazily: importing
this module imports triton).

:func:`merge` computes, for every query row of two (output, LSE) pairs, in one pass over them::

    new = logaddexp(la, lb)
    out = a * exp(la - new) + b * exp(lb - new)       (in float32, stored in out's dtype)
    lse_out = new                                     (when asked for)

``a``/``b``/``out`` are [B,H,S,D] tensors of any strides (views of NHD or HND storage; ``out`` may
be ``a`` itself: each program reads its rows before it writes them), ``la``/``lb``/``lse_out``
[B,H,S] float32. The launch goes on the current stream of ``out``'s device (the stream
Executor.run runs the kernel on); nothing waits on the host.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

#: elements per program (rows x next power of two of D); 4 warps. Memory-bound: one read of each
#: input and one write of the output, 16-byte accesses where D's stride is 1.
BLOCK_ELEMS = 4096
NUM_WARPS = 4
MAX_D = 1024


@triton.jit
def merge_kernel(a_ptr, la_ptr, b_ptr, lb_ptr, o_ptr, lo_ptr,
                  R, N1, N2, D,
                  sa0, sa1, sa2, sad, sla0, sla1, sla2,
                  sb0, sb1, sb2, sbd, slb0, slb1, slb2,
                  so0, so1, so2, sod, slo0, slo1, slo2,
                  WRITE_LSE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    rmask = rows < R
    i2 = rows % N2
    t = rows // N2
    i1 = t % N1
    i0 = t // N1
    la = tl.load(la_ptr + (i0 * sla0 + i1 * sla1 + i2 * sla2), mask=rmask, other=0.0)
    lb = tl.load(lb_ptr + (i0 * slb0 + i1 * slb1 + i2 * slb2), mask=rmask, other=0.0)
    # torch.logaddexp's max + log1p(exp(-|la - lb|)); where la == lb == +-inf torch's is that infinity
    # and this is NaN, but then both merges' weights are exp(inf - inf) = NaN: the same NaN row
    m = tl.maximum(la, lb)
    new = m + tl.log(1.0 + tl.exp(-tl.abs(la - lb)))
    wa = tl.exp(la - new)
    wb = tl.exp(lb - new)
    d = tl.arange(0, BLOCK_D)
    mask = rmask[:, None] & (d < D)[None, :]
    a = tl.load(a_ptr + ((i0 * sa0 + i1 * sa1 + i2 * sa2)[:, None] + d[None, :] * sad), mask=mask, other=0.0)
    b = tl.load(b_ptr + ((i0 * sb0 + i1 * sb1 + i2 * sb2)[:, None] + d[None, :] * sbd), mask=mask, other=0.0)
    o = a.to(tl.float32) * wa[:, None] + b.to(tl.float32) * wb[:, None]
    tl.store(o_ptr + ((i0 * so0 + i1 * so1 + i2 * so2)[:, None] + d[None, :] * sod),
             o.to(o_ptr.dtype.element_ty), mask=mask)
    if WRITE_LSE:
        tl.store(lo_ptr + (i0 * slo0 + i1 * slo1 + i2 * slo2), new, mask=rmask)


#: built for the Triton interpreter (TRITON_INTERPRET=1 when triton was imported): runs on CPU tensors
INTERPRETED = type(merge_kernel).__name__ == "InterpretedFunction"


def launch_args(a: torch.Tensor, la: torch.Tensor, b: torch.Tensor, lb: torch.Tensor,
                out: torch.Tensor, lse_out: torch.Tensor | None) -> tuple[tuple, tuple, dict]:
    """(grid, positional arguments, keyword arguments) of :func:`merge`'s launch."""
    B, H, S, D = out.shape
    # rows in the order of ``b``'s storage (the launch output: NHD or HND), so neighbouring
    # programs read neighbouring memory; every tensor's (B, H, S) axes are permuted alike
    perm = sorted(range(3), key=lambda i: -b.stride(i))
    sizes = [(B, H, S)[i] for i in perm]
    lo = lse_out if lse_out is not None else la          # not written when WRITE_LSE is off

    def s4(t):
        return [t.stride(i) for i in perm] + [t.stride(3)]

    def s3(t):
        return [t.stride(i) for i in perm]

    block_d = triton.next_power_of_2(D)
    block_r = max(1, BLOCK_ELEMS // block_d)
    rows = B * H * S
    args = (a, la, b, lb, out, lo, rows, sizes[1], sizes[2], D,
            *s4(a), *s3(la), *s4(b), *s3(lb), *s4(out), *s3(lo))
    kwargs = dict(WRITE_LSE=lse_out is not None, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=NUM_WARPS)
    return (triton.cdiv(rows, block_r),), args, kwargs


def merge(a: torch.Tensor, la: torch.Tensor, b: torch.Tensor, lb: torch.Tensor,
          out: torch.Tensor, lse_out: torch.Tensor | None) -> None:
    """``out = a*exp(la-new) + b*exp(lb-new)``, ``lse_out = new = logaddexp(la, lb)`` (see the
    module's docstring) in one launch. Shapes are the caller's to match (lse_merge.fused_for)."""
    grid, args, kwargs = launch_args(a, la, b, lb, out, lse_out)
    dev = out.device
    if dev.type == "cuda" and dev.index is not None and dev.index != torch.cuda.current_device():
        with torch.cuda.device(dev):        # triton launches on the current device's current stream
            merge_kernel[grid](*args, **kwargs)
    else:
        merge_kernel[grid](*args, **kwargs)
