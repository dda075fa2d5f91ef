"""Stand-ins for the GPU's attention kernels on a machine without them (the CPU), for memory benches.

:func:`sage_like` allocates what sage 2.2.0's sm_120 path allocates in one call -- ``sageattn`` there runs
``sageattn_qk_int8_pv_fp8_cuda(qk_quant_gran="per_warp", pv_accum_dtype="fp32+fp16")`` (core.py:153),
the path the GPU length runs emulate -- in the same order and with the same lives, and writes PyTorch's
SDPA into its output one head at a time (a head's SDPA result is the only storage of its own):

  ``km = k.mean(seq)`` (smooth_k: ``sageattn`` drops the caller's ``smooth_k=False``, core.py:143-155),
  int8 q and k and their per-warp / per-block scales (quant.py ``per_warp_int8``), the output
  ``torch.empty(q.size())`` (core.py), the transposed V padded to 64 keys in the caller's dtype and its
  fp8 copy with scale and mean (quant.py ``per_channel_fp8``: the transposed copy dies on its return),
  then the kernel writes the output. The values of the quantised copies are not computed.

Loaded through ``SAFESAGE_EXTRA_FAMILIES=bench.common.standin_families`` (the registry hands them its kit;
nothing of the pack is imported here): ``standin_sage`` (kind "sage") runs :func:`sage_like` in the
layout it is handed, as SafeSage's ``sage2_sm120_fp8pv`` adapter calls sage; ``standin_ck`` (kind "ck")
runs SDPA and allocates nothing but its output. ComfyUI's ``attention_sage`` calls ``sageattn(q, k, v,
**kw)``: :func:`sageattn` is :func:`sage_like` with that signature, for the unguarded sage arm.
"""
from __future__ import annotations

SAGE, CK = "standin_sage", "standin_ck"
LAUNCHES: dict = {SAGE: 0, CK: 0, "sageattn": 0}
V_PAD = 64          # per_channel_fp8 pads the keys of the transposed V to a multiple of 64 (quant.py)


def _ceil(x: int, m: int) -> int:
    return -(-x // m) * m


def sage_like(q, k, v, layout: str = "HND", scale=None):
    """sage 2.2.0 sm_120's allocations around SDPA's result (module docstring); ``[B, H, S, D]`` in
    ``layout`` (HND or NHD), the output contiguous in that layout as sage's."""
    import torch
    hnd = layout == "HND"
    seq = 2 if hnd else 1
    b, h, sq, d = q.shape if hnd else (q.shape[0], q.shape[2], q.shape[1], q.shape[3])
    hk, sk = (k.shape[1], k.shape[2]) if hnd else (k.shape[2], k.shape[1])
    dev = q.device
    km = k.mean(dim=seq, keepdim=True)                                              # noqa: F841 -- smooth_k
    q_int8 = torch.empty(q.shape, dtype=torch.int8, device=dev)                    # noqa: F841
    k_int8 = torch.empty(k.shape, dtype=torch.int8, device=dev)                    # noqa: F841
    q_scale = torch.empty((b, h, _ceil(sq, 128) // 128 * 4), dtype=torch.float32, device=dev)   # noqa: F841
    k_scale = torch.empty((b, hk, _ceil(sk, 64) // 64), dtype=torch.float32, device=dev)       # noqa: F841
    o = torch.empty(q.size(), dtype=q.dtype, device=dev)
    v_fp8, v_scale, vm = _per_channel_fp8(v, hnd, b, hk, sk, d)                    # noqa: F841
    qh, kh, vh, oh = (t if hnd else t.transpose(1, 2) for t in (q, k, v, o))
    rep = h // hk
    kw = {} if scale is None else {"scale": scale}
    for i in range(h):
        j = i // rep
        oh[:, i:i + 1].copy_(torch.nn.functional.scaled_dot_product_attention(
            qh[:, i:i + 1], kh[:, j:j + 1], vh[:, j:j + 1], **kw))
    return o


def _per_channel_fp8(v, hnd: bool, b: int, hk: int, sk: int, d: int):
    import torch
    shape = (b, hk, d, _ceil(sk, V_PAD)) if hnd else (b, d, hk, _ceil(sk, V_PAD))
    vt = torch.empty(shape, dtype=v.dtype, device=v.device)
    vt[..., :sk].copy_(v.transpose(2, 3) if hnd else v.permute(0, 3, 2, 1))
    v_fp8 = torch.empty(shape, dtype=torch.float8_e4m3fn, device=v.device)
    v_scale = torch.empty((b, hk, d), dtype=torch.float32, device=v.device)
    vm = torch.empty((b, hk, d), dtype=torch.float32, device=v.device)
    return v_fp8, v_scale, vm                      # vt dies here, as in quant.py


def sage_like_temp_bytes(call) -> int:
    """What :func:`sage_like` allocates besides SDPA's one head at a time (``Envelope.temp_bytes``):
    int8 q and k, the output, the transposed V (2 B) and its fp8 copy, the scales and means."""
    b, h, sq, d = call.q.shape
    _, hk, sk, _ = call.k.shape
    sp = _ceil(sk, V_PAD)
    return (b * h * sq * d + b * hk * sk * d + call.elt_bytes * b * h * sq * d + (call.elt_bytes + 1) * b * hk * d * sp
            + 8 * b * hk * d + call.elt_bytes * b * hk * d
            + 4 * (b * h * _ceil(sq, 128) // 128 * 4 + b * hk * _ceil(sk, 64) // 64))


def sageattn(q, k, v, tensor_layout: str = "HND", is_causal: bool = False, sm_scale=None, **kwargs):
    """``sageattention.sageattn``'s signature over :func:`sage_like` (ComfyUI's ``attention_sage`` calls
    it with ``is_causal=False``, ``smooth_k=False``, ``sm_scale``; no mask in H3's calls)."""
    if is_causal or kwargs.get("attn_mask") is not None:
        raise NotImplementedError("the sage stand-in has no causal or masked form")
    LAUNCHES["sageattn"] += 1
    return sage_like(q, k, v, tensor_layout, sm_scale)


def kernel_families(kit):
    def make(name, kind, fn_of, temp_bytes):
        env = kit.Envelope(family=name, source="bench/common/standin_families.py", head_dims=(16, 32, 64, 128),
                           dtypes=("bfloat16", "float16", "float32"), supports_mask=False, terms=(),
                           devices=("cpu",), temp_bytes=temp_bytes)

        def fn(q, k, v, layout, scale):
            LAUNCHES[name] += 1
            return fn_of(q, k, v, layout, scale)

        return kit.KernelFamily(env, kind=kind, tolerance=0.05, call=lambda: (fn, None),
                                function=f"bench/common/standin_families.py {name}", detect=lambda rt: rt.arch is None)

    return [make(SAGE, "sage", sage_like, sage_like_temp_bytes),
            make(CK, "ck", kit.sdpa_fn, lambda call: 0)]
