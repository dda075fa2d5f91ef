"""The ``ck_probe`` section of bench/kernels/gpu_kvchunks.py: where comfy-kitchen's int8_attention first refuses
(or goes wrong), bisected, against what its envelope predicts."""
from __future__ import annotations

import json
import traceback

import torch

from bench.kernels.kvchunks_common import D, HEADS, h3_buffer, h3_views, rel_l2, row_index


# ---------------------------------------------------------------------- ck probe
def sec_ck_probe(args) -> dict:
    """Where comfy-kitchen's int8_attention refuses (an exception) or goes wrong, per layout.

    Key side: 256 query rows against S keys (cheap); query side: S query rows against 256 keys.
    Layouts of the long tensor: H3's strided view, contiguous HND, contiguous NHD seen as HND.
    Bisects the first S that raises; checks rel. L2 vs SDPA at the last passing S and at a few
    fixed sizes."""
    import comfy_kitchen as ck
    res = {"version": getattr(ck, "__version__", None), "probes": []}
    smax = args.ck_max
    flat = torch.empty(HEADS * smax * D, device="cuda", dtype=torch.bfloat16).normal_()
    h3 = h3_buffer(smax, seed=1)
    short = torch.randn(1, HEADS, 256, D, device="cuda", dtype=torch.bfloat16)

    def long_tensor(layout: str, S: int, which: int = 0):
        if layout == "strided":
            return h3_views(h3, S)[which]
        if layout == "hnd":
            return torch.as_strided(flat, (1, HEADS, S, D), (HEADS * S * D, S * D, D, 1))
        return torch.as_strided(flat, (1, HEADS, S, D), (S * HEADS * D, D, HEADS * D, 1))

    def attempt(side: str, layout: str, S: int) -> tuple[bool, str, float | None]:
        L = long_tensor(layout, S)
        if side == "kv":
            q, k, v = short, L, (long_tensor(layout, S, 2) if layout == "strided" else L)
        else:
            q, k, v = L, short, short
        try:
            o = ck.int8_attention(q, k, v)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            return False, f"{type(e).__name__}: {e}", None
        if side == "kv":
            ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            err = rel_l2(o, ref)
        else:
            idx = row_index(S)
            ref = torch.nn.functional.scaled_dot_product_attention(q[:, :, idx], k, v)
            err = rel_l2(o[:, :, idx], ref)
        return True, "", err

    for side in ("kv", "q"):
        for layout in ("strided", "hnd", "nhd"):
            p = {"side": side, "layout": layout}
            try:
                lo, hi = 1024, smax
                ok_hi, msg_hi, err_hi = attempt(side, layout, hi)
                if ok_hi:
                    p.update(first_failing=None, passes_up_to=hi, rel_l2_at_max=err_hi)
                else:
                    ok_lo, msg_lo, _ = attempt(side, layout, lo)
                    if not ok_lo:
                        p.update(first_failing=f"<= {lo}", error=msg_lo)
                    else:
                        while hi - lo > 1:
                            mid = (lo + hi) // 2
                            if attempt(side, layout, mid)[0]:
                                lo = mid
                            else:
                                hi = mid
                        ok, _, err_lo = attempt(side, layout, lo)
                        p.update(first_failing=hi, last_passing=lo, error=attempt(side, layout, hi)[1],
                                 rel_l2_at_last_passing=err_lo)
                p["rel_l2_at"] = {}
                for S in (38_000, 99_865, 99_866, 169_000, 299_520, 299_521):
                    if S <= smax:
                        ok, msg, err = attempt(side, layout, S)
                        p["rel_l2_at"][S] = err if ok else msg
            except Exception as e:  # noqa: BLE001
                p["error"] = f"{type(e).__name__}: {e}"
                p["traceback"] = traceback.format_exc()[-1500:]
            res["probes"].append(p)
            print(json.dumps({k_: v_ for k_, v_ in p.items() if k_ != "traceback"})[:600], flush=True)
    return res
