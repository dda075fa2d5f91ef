"""What the sections of bench/kernels/gpu_kvchunks.py share: H3's buffer and views, reference rows, the kernels to
measure, a guarded SafeAttention, result recording."""
from __future__ import annotations

import json
import traceback

import torch

from bench.common import benchutil

HEADS, D = 56, 128
ROWS = 1024
SAGE2_FAMILIES = ("sage2_sm80", "sage2_sm86_triton", "sage2_sm89_fp8pv", "sage2_fp8pv_perwarp", "sage2_sm90")
SM120_KV_RULE = 150_000     # families.sage2.FP8_SM120_MAX_KV_LEN: the rule kv_chunks exists for


def env_info() -> dict:
    info = benchutil.env_info("kernels.gpu_kvchunks")
    try:
        import sageattention
        info["sageattention_file"] = sageattention.__file__
    except Exception as e:  # noqa: BLE001
        info["sageattention_import_error"] = f"{type(e).__name__}: {e}"
    return info


def h3_buffer(S: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(S, 3 * HEADS * D, device="cuda", dtype=torch.bfloat16, generator=g)


def h3_views(buf: torch.Tensor, S: int | None = None):
    S = S or buf.shape[0]
    return [t.view(S, HEADS, D).transpose(0, 1).unsqueeze(0) for t in buf[:S].split(HEADS * D, -1)]


def row_index(S: int) -> torch.Tensor:
    n = min(ROWS, S // 2)
    return torch.cat([torch.arange(0, n), torch.arange(S - n, S)]).cuda()


def sdpa_rows(q, k, v, idx) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q[:, :, idx], k, v)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def noop(*a, **k):
    raise AssertionError("unreachable: the override handles every call here")


def flops(S: int) -> float:
    return 4.0 * S * S * HEADS * D


def kernels() -> dict:
    """Every family that can run here: name -> safe_ops Kernel (errors recorded by the caller)."""
    from safe_ops.families.registry import kernel_of
    out = {}
    for fam in SAGE2_FAMILIES:
        k = kernel_of(fam)
        if k is not None:
            out[fam] = k
    try:
        from safe_ops.families.registry import ck_kernel
        ck = ck_kernel()
        if ck is not None:
            out[ck.family] = ck
    except Exception:  # noqa: BLE001  (older checkout without the ck family)
        pass
    return out


def guarded(kern, policy=None):
    from safe_ops.attention.override import SafeAttention
    from safe_ops.policy import Policy
    from safe_ops.facts.devices import runtime
    return SafeAttention(policy or Policy(kernel="sage", verify="off"), kernels=[kern], rt=runtime())


# ---------------------------------------------------------------------- kvchunks
def with_kv_rule(kern, limit: int):
    """``kern`` with sm_120's key-length rule added (what makes the planner chunk keys)."""
    import dataclasses

    from safe_ops.families.family import Kernel
    from safe_ops.families.rules import KvLenRule
    env = kern.envelope
    env = dataclasses.replace(env, family=env.family,
                              extra_rules=env.extra_rules + (KvLenRule(env.family, limit, "issue 11 bench",
                                                                       "sm_120 rule applied on the H200"),))
    return Kernel(env, kern.fn, kern.tolerance, kern.fn_lse)


def record_error(r: dict, e: BaseException) -> None:
    r["error"] = f"{type(e).__name__}: {e}"
    r["traceback"] = traceback.format_exc()[-1500:]


def emit(r: dict) -> None:
    print(json.dumps({k_: v_ for k_, v_ in r.items() if k_ != "traceback"})[:600], flush=True)


def first_call(att, fn):
    """(output, extra peak bytes, plan) of the first call of ``fn`` through ``att``."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    o = fn()
    torch.cuda.synchronize()
    return o, torch.cuda.max_memory_allocated() - base, att.prepared_plans()[0].plan
