"""A rank call outside its family's envelope, run inside it: the one-GPU planner's plan, with LSE.

On one GPU a call outside a family's limits is planned (attention.planner.plan_for) into launches
that are each inside them -- q/k/v copied contiguous in a layout with small strides, heads in groups,
queries in chunks -- and only a call no plan fits goes elsewhere. A sequence-parallel rank call gets
the same: :func:`plan_rank_call` asks the same planner for the rank's own geometry (NHD), and
:func:`run_rank_plan` runs it through yunchang's selected sage function, giving back ``(out, lse)``
as the caller expects: each launch's output and LSE written into the rank's result, the launches
split along heads and query rows only, so every query row's LSE is one launch's own.

Key/value chunks are left out here (the planner is asked with ``returns_lse`` off): merging them
needs the chunk-centred keys that sage's ``smooth_k`` would otherwise make per chunk (executor's
kv_chunks), which yunchang's fixed keyword set does not reach. A call no head-group / query-chunk
plan fits is refused (rank_kernel) and runs PyTorch's attention. No memory budget is applied: the
rank's free memory is not read here (the one-GPU budget reads ComfyUI's), so a plan's copies -- at
most q/k/v once, per head group -- come on top of the caller's tensors.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch

from ..attention.planner import Plan, plan_for
from ..families.envelope import AttnCall, Envelope


def plan_rank_call(call: AttnCall, env: Envelope) -> Plan | None:
    """The planner's cheapest plan of ``env``'s kernel for the rank's NHD call, key chunks excluded;
    None where no plan fits (a rule no data movement fixes, or none of the plans)."""
    return plan_for(call, replace(env, returns_lse=False), None, caller_layout="NHD")


def run_rank_plan(plan: Plan, fn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  args: tuple, kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``plan``'s launches of ``fn`` (yunchang's partial: ``tensor_layout`` set per launch) over NHD
    ``q``/``k``/``v``: ``(out NHD [B,S,H,D], lse float32 [B,H,S])``."""
    B, S, H, D = q.shape
    ratio = max(H // k.shape[2], 1)
    g = plan.head_group or H
    qc = plan.q_chunk or S
    hnd = plan.layout == "HND"
    kw = {**kwargs, "tensor_layout": plan.layout}

    def prep(t: torch.Tensor, name: str) -> torch.Tensor:
        """An NHD slice as the kernel takes it: a view in the plan's layout, or a contiguous copy."""
        t = t.transpose(1, 2) if hnd else t
        return t.contiguous() if name in plan.repack else t

    out = torch.empty((B, S, H, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, S), dtype=torch.float32, device=q.device)
    for h0 in range(0, H, g):
        h1 = min(h0 + g, H)
        ks = prep(k[:, :, h0 // ratio:h1 // ratio], "k")
        vs = prep(v[:, :, h0 // ratio:h1 // ratio], "v")
        for s0 in range(0, S, qc):
            s1 = min(s0 + qc, S)
            o, l = fn(prep(q[:, s0:s1, h0:h1], "q"), ks, vs, *args, **kw)[:2]
            out[:, s0:s1, h0:h1].copy_(o.transpose(1, 2) if hnd else o)
            lse[:, h0:h1, s0:s1].copy_(l)
            del o, l
        del ks, vs
    return out, lse
