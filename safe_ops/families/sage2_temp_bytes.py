"""What each sage 2.2.0 family allocates itself in one launch (``Envelope.temp_bytes``).

Quantised q/k (int8), ``k - km`` and its mean, the fp16 V copy, the transposed/padded V and
its fp8 copy, scales, the output -- read from the same sources as ``sage2`` (line
citations are SageAttention@v2.2.0 ``core.py`` / ``quant_per_thread.py`` / ``quant_per_block.py``).
The planner counts them in a plan's peak (``Plan.kernel_temp_bytes``).
"""
from __future__ import annotations

from .envelope import AttnCall


def ceil_to(x: int, m: int) -> int:
    """``x`` rounded up to a multiple of ``m`` (sage's pads of V)."""
    return -(-x // m) * m


def _bytes_common(call: AttnCall) -> tuple[int, int, int, int, int, int]:
    b, h, sq, d = call.q.shape
    _, hk, sk, _ = call.k.shape
    return b, h, sq, hk, sk, d


def _qk_int8_bytes(call: AttnCall) -> int:
    b, h, sq, hk, sk, d = _bytes_common(call)
    return b * h * sq * d + b * hk * sk * d


def _out_bytes(call: AttnCall) -> int:
    b, h, sq, hk, sk, d = _bytes_common(call)
    return call.elt_bytes * b * h * sq * d


def _k_smooth_bytes(call: AttnCall) -> int:
    b, h, sq, hk, sk, d = _bytes_common(call)
    return call.elt_bytes * b * hk * sk * d + call.elt_bytes * b * hk * d   # k - km, km


def _v_fp8_bytes(call: AttnCall, pad: int) -> int:
    b, h, sq, hk, sk, d = _bytes_common(call)
    sp = ceil_to(sk, pad)
    return 3 * b * hk * d * sp + 8 * b * hk * d     # transposed (2 B) + fp8 (1 B) + scale, mean


def sm80_temp_bytes(call: AttnCall) -> int:
    b, h, sq, hk, sk, d = _bytes_common(call)
    n = _qk_int8_bytes(call) + _k_smooth_bytes(call) + _out_bytes(call)
    n += 4 * (b * h * (-(-sq // 128)) * 4 * 8 + b * hk * (-(-sk // 64)) * 4)   # :180-181
    if call.dtype != "float16":
        n += 2 * b * hk * sk * d                      # v.to(float16) (core.py:611)
    return n


def sm86_temp_bytes(call: AttnCall) -> int:
    b, h, sq, hk, sk, d = _bytes_common(call)
    n = _qk_int8_bytes(call) + _k_smooth_bytes(call) + _out_bytes(call)
    n += 4 * (b * h * (-(-sq // 128)) + b * hk * (-(-sk // 64)))   # quant_per_block.py:75-76
    if call.dtype != "float16":
        n += 2 * b * hk * sk * d                                     # core.py:296
    return n


def fp8_temp_bytes(call: AttnCall, per_thread: bool, pad: int = 64, blkq: int = 128,
                   warpq: int = 32, blkk: int = 64, warpk: int = 64) -> int:
    b, h, sq, hk, sk, d = _bytes_common(call)
    n = _qk_int8_bytes(call) + _out_bytes(call) + _v_fp8_bytes(call, pad)
    if per_thread:
        n += _k_smooth_bytes(call)
        n += 4 * (b * h * (-(-sq // blkq)) * (blkq // warpq) * 8 + b * hk * (-(-sk // blkk)) * (blkk // warpk) * 4)
    else:
        n += call.elt_bytes * b * hk * d                                   # km
        n += 4 * (b * h * (-(-sq // blkq)) * (blkq // warpq) + b * hk * (-(-sk // blkk)))
    return n


def sm90_temp_bytes(call: AttnCall) -> int:
    b, h, sq, hk, sk, d = _bytes_common(call)
    n = fp8_temp_bytes(call, per_thread=True, pad=128, blkq=64, warpq=16, blkk=128, warpk=128)
    if sk % 128:
        n += call.elt_bytes * b * hk * (ceil_to(sk, 128) + (ceil_to(sk, 128) - sk)) * d   # cat + zeros
    return n
