"""One rank of tests/unit/test_multigpu_ranks.py: ``python multigpu_rank.py RANK WORLD PORT OUT``.

Runs yunchang's sequence-parallel attention (``LongContextAttention``, whose ring calls
``select_flash_attn_impl(attn_type, stage="fwd-only")`` once per key chunk, as xFuser's ring does)
over torch.distributed gloo, with a fake ``sageattention`` whose ``sageattn_qk_int8_pv_fp16_cuda`` is
tests/unit/fake_family.py's kernel (sage's index arithmetic shrunk to 16 bits: it raises -- the CPU
stand-in of an illegal memory access -- when launched outside its envelope) plus its LSE, and
SafeSage's hook held to that fake family. Each case's result goes to OUT as JSON.
"""
from __future__ import annotations

import datetime
import json
import sys
import types

import torch

RANK, WORLD, PORT, OUT = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
H, D = 8, 16                   # heads x head dim: the fake family's head dim, 8 heads like H3's 56 scaled
FAULT: dict = {}               # rank -> "raise" | "nan": what this rank's fake kernel does
CALLS: list = []               # this rank's launches of the fake kernel


def _fake_sage_module(kernel_fn):
    mod = types.ModuleType("sageattention")
    mod.__version__ = "2.2.0"

    def sageattn_qk_int8_pv_fp16_cuda(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None,
                                      return_lse=False, **kwargs):
        assert tensor_layout in ("NHD", "HND") and return_lse
        scale = sm_scale or q.shape[-1] ** -0.5
        out = kernel_fn(q, k, v, tensor_layout, scale)    # asserts that the launch is inside its envelope
        CALLS.append((tensor_layout, tuple(q.shape)))
        if FAULT.get(RANK) == "raise":
            raise RuntimeError("forced kernel fault on this rank")
        hnd = (lambda t: t) if tensor_layout == "HND" else (lambda t: t.transpose(1, 2))
        lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            hnd(q), hnd(k), hnd(v), 0.0, False, scale=scale)[1]
        if FAULT.get(RANK) == "nan":
            out = torch.full_like(out, float("nan"))
        return out, lse

    mod.sageattn_qk_int8_pv_fp16_cuda = sageattn_qk_int8_pv_fp16_cuda
    return mod


def main() -> None:
    import fake_family
    from safe_ops.families.registry import KIT
    from safe_ops.multigpu import rank_kernel, xfuser_hook

    fam, = fake_family.kernel_families(KIT)
    kernel_fn, _ = fam.call()
    sys.modules["sageattention"] = _fake_sage_module(kernel_fn)     # before yunchang looks for it
    import yunchang
    from yunchang.kernels import AttnType

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{PORT}", rank=RANK,
                                         world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    results = {"yunchang": getattr(yunchang, "__version__", "?")}

    def case(name, ulysses, ring, seq, guarded, fault=None, dtype=torch.float32):
        yunchang.set_seq_parallel_pg(ulysses, ring, RANK, WORLD)
        FAULT.clear()
        FAULT.update(fault or {})
        CALLS.clear()
        rank_kernel.SECTION.reset()
        xfuser_hook.uninstall()
        if guarded:
            xfuser_hook.install(families={"sageattn_qk_int8_pv_fp16_cuda": fam})
        g = torch.Generator().manual_seed(seq)
        # H3's call: q/k/v are strided views of one fused qkv projection [B, S, 3*H*D]
        qkv = torch.randn(1, seq, 3 * H * D, generator=g).to(dtype)
        q, k, v = (qkv[..., i * H * D:(i + 1) * H * D].unflatten(-1, (H, D)) for i in range(3))
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        n = seq // WORLD
        local = slice(RANK * n, (RANK + 1) * n)
        attn = yunchang.LongContextAttention(ring_impl_type="basic", attn_type=AttnType.SAGE_FP16)
        r = {"raised": None, "launches": 0}
        ref = ref.to(torch.float32)
        try:
            out = attn(q[:, local], k[:, local], v[:, local])
            r["rel_err"] = float((out.float() - ref[:, local]).norm() / ref[:, local].norm())
        except Exception as e:  # noqa: BLE001 - the unguarded run: the fake kernel's out-of-envelope launch
            r["raised"] = f"{type(e).__name__}: {str(e)[:200]}"
        r["launches"] = len(CALLS)
        r["launch_shapes"] = sorted(set(CALLS))
        stats = rank_kernel.SECTION.as_dict()
        r["stats"] = {c: stats[c] for c in rank_kernel.SECTION.counters}
        r["fallbacks"] = stats["fallbacks"]
        results[name] = r
        torch.distributed.barrier()

    case("ulysses_in", 2, 1, 384, True)
    case("ulysses_out", 2, 1, 1024, True)
    case("ring_in", 1, 2, 128, True)
    case("ring_out", 1, 2, 1024, True)
    case("ulysses_no_plan", 2, 1, 384, True, dtype=torch.float64)     # a dtype no data movement fixes
    case("ulysses_fault_raise", 2, 1, 384, True, {1: "raise"})
    case("ring_fault_nan", 1, 2, 128, True, {1: "nan"})
    # last: without the hook the fake kernel raises mid-ring, with its chunk exchange posted
    case("ulysses_out_unguarded", 2, 1, 1024, False)
    case("ring_out_unguarded", 1, 2, 1024, False)
    with open(OUT, "w") as f:
        json.dump(results, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
