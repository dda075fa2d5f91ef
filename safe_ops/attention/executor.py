"""Runs a Plan: the launches, the log-sum-exp merge of key chunks, the hop to the legacy stream.

Knows nothing of choice: :class:`Executor` is handed a plan (planner.py) and the normalised
call (call_forms.py) and executes it with the kernel adapters (families/).
"""
from __future__ import annotations

import torch

from .call_forms import Normalised
from .lse_merge import KeyChunkMerge
from .streams import legacy_hop, run_hopped
from ..families.family import Kernel
from .planner import Plan
from ..ui import run_stats


def one_launch(plan: Plan) -> bool:
    """The plan runs the whole call in one launch (no head groups, query or key chunks)."""
    return not (plan.head_group or plan.q_chunk or plan.kv_chunk)


class Executor:
    """Executes plans with ``kernels`` (family -> Kernel)."""

    def __init__(self, kernels: dict, debug_sync: bool = False):
        self.kernels = kernels
        self.debug_sync = debug_sync

    def run(self, plan: Plan, n: Normalised) -> tuple[torch.Tensor, str]:
        """Execute ``plan`` (a guarded kernel's: an ``sdpa`` plan is ComfyUI's own attention, which
        attention.SafeAttention runs itself); returns the result and its layout: a single launch's
        output as the kernel returned it (the plan's layout: in the caller's own layout no view
        is made either way, Normalised.finish), a split plan's HND [B,H,Sq,D].

        Same stream (Triton sage, SDPA): the caching allocator already orders the
        reuse of every temporary after the kernels enqueued on that stream, so a
        copy is freed as soon as the next one is made and peak memory stays at
        one launch's worth. Kernels on the legacy default stream (sage 2.x CUDA)
        while the caller runs on another stream: the call hops there behind an
        event and the caller's stream waits for the result with another event -- no
        host synchronisation either way. Inside the hop the kernel's own
        temporaries and the pack's copies are allocated on the legacy stream, the
        stream that reads them, so stream order protects them there too: nothing is
        held past the call (no fence, no memory beyond the plan's peak, nothing
        alive past the block under ComfyUI's allocation compiler). The caller's
        q/k/v belong to the caller's stream, which waits for the hop's exit event
        before any later work, so their memory cannot be reused early; the result,
        allocated on the legacy stream, gets ``record_stream`` for the caller's.
        """
        kern = self.kernels[plan.kernel]
        on_cuda = n.q4.is_cuda
        hop = legacy_hop(n.q4.device) if on_cuda and kern.envelope.launches_on_legacy_stream else None
        one = not (plan.head_group or plan.q_chunk or plan.kv_chunk)      # one_launch(plan)
        if hop is None:
            if one and not plan.repack and plan.layout == n.layout:       # the caller's own views
                out = kern.fn(n.q4, n.k4, n.v4, plan.layout, n.scale)
            else:
                out = self._launch_one(plan, kern, n) if one else self._launch_split(plan, kern, n)
        else:
            run_stats.count("stream_hops")
            out = run_hopped(hop, lambda: self._launch_all(plan, kern, n))
        layout = plan.layout if one else "HND"
        if self.debug_sync and on_cuda:
            try:
                torch.cuda.synchronize(n.q4.device)
            except RuntimeError as e:
                raise RuntimeError(
                    f"SafeSage debug_sync: CUDA error right after {plan.describe()} "
                    f"for q{tuple(n.q.shape)} k{tuple(n.k.shape)}: {e}") from e
        return out, layout

    def run_captured(self, plan: Plan, n: Normalised) -> tuple[torch.Tensor, str]:
        """Execute ``plan`` during CUDA-graph capture: on the caller's stream only (the caller
        chose a family that launches there), no stream hop, no debug sync."""
        kern = self.kernels[plan.kernel]
        if kern.envelope.launches_on_legacy_stream and n.q4.is_cuda:
            raise RuntimeError(f"{plan.kernel} launches on the legacy stream: not under capture")
        return self._launch_all(plan, kern, n), plan.layout if one_launch(plan) else "HND"

    def _launch_all(self, plan: Plan, kern: Kernel, n: Normalised) -> torch.Tensor:
        """The plan's launches; the result in the plan's layout for one launch, else HND."""
        return self._launch_one(plan, kern, n) if one_launch(plan) else self._launch_split(plan, kern, n)

    @staticmethod
    def _launch_one(plan: Plan, kern: Kernel, n: Normalised) -> torch.Tensor:
        """The whole call in one launch: q/k/v as views in the kernel's layout (none made when that
        is the caller's), the repacked ones copied contiguous in it."""
        layout = plan.layout
        q, k, v = n.in_layout(layout)
        if plan.repack:
            rp = plan.repack
            q, k, v = (q.contiguous() if "q" in rp else q, k.contiguous() if "k" in rp else k,
                       v.contiguous() if "v" in rp else v)
        return kern.fn(q, k, v, layout, n.scale)

    def _launch_split(self, plan: Plan, kern: Kernel, n: Normalised) -> torch.Tensor:
        """A plan of several launches (head groups, query chunks, key chunks) into one HND output."""
        q, k, v = n.q, n.k, n.v
        B, H, Sq, D = q.shape
        Skv = k.shape[2]
        g = plan.head_group or H
        qc = plan.q_chunk or Sq
        kc = plan.kv_chunk or Skv
        ratio = H // k.shape[1]

        nhd = plan.layout == "NHD"

        def prep(t: torch.Tensor, name: str) -> torch.Tensor:
            """A repacked tensor is contiguous in the kernel's layout (still seen as HND here)."""
            if name not in plan.repack:
                return t
            return t.transpose(1, 2).contiguous().transpose(1, 2) if nhd else t.contiguous()

        def launch(qs, ks, vs) -> torch.Tensor:
            if plan.layout == "NHD":
                o = kern.fn(qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2), "NHD", n.scale).transpose(1, 2)
            else:
                o = kern.fn(qs, ks, vs, "HND", n.scale)
            return o

        out = torch.empty((B, H, Sq, D), dtype=q.dtype, device=q.device)
        for h0 in range(0, H, g):
            h1 = min(h0 + g, H)
            kh, vh = k[:, h0 // ratio:h1 // ratio], v[:, h0 // ratio:h1 // ratio]
            if kc < Skv:
                self._launch_kv_chunks(plan, kern, n, prep, out, h0, h1, kh, vh, kc)
                continue
            ks = prep(kh, "k")
            vs = prep(vh, "v")
            for s0 in range(0, Sq, qc):
                s1 = min(s0 + qc, Sq)
                out[:, h0:h1, s0:s1].copy_(launch(prep(q[:, h0:h1, s0:s1], "q"), ks, vs))
            del ks, vs
        return out

    @staticmethod
    def _launch_kv_chunks(plan: Plan, kern: Kernel, n: Normalised, prep, out: torch.Tensor,
                          h0: int, h1: int, kh: torch.Tensor, vh: torch.Tensor, kc: int) -> None:
        """Heads h0:h1 of ``out`` from launches over ``kc`` keys at a time, merged exactly.

        Per (head group x query chunk) block: a running float32 accumulator of the
        normalised output and a running LSE; each key chunk's output ``o_c`` (LSE ``l_c``)
        is folded in as ``acc = acc*exp(L - L') + o_c*exp(l_c - L')`` with
        ``L' = logaddexp(L, l_c)`` (lse_merge.KeyChunkMerge: fused on CUDA, the last chunk's
        merge writing ``out``). Peak beyond the result: the accumulator (4 bytes per
        element of the block), one launch's output and temporaries, the centred key chunk
        and [B, g, qc] float32 LSE vectors -- no full-size temporary (Plan.extra_bytes).

        Every copy (repacked q/v, the centred key chunk), each launch's output and LSE and
        the accumulator are made and consumed on the stream the kernel runs on (Executor.run),
        so each is freed as soon as the next replaces it: the plan's priced peak, nothing held.
        """
        q = n.q
        B, _, Sq, D = q.shape
        Skv = kh.shape[2]
        qc = plan.q_chunk or Sq
        nhd = plan.layout == "NHD"
        centre = kern.envelope.lse_centred_k
        # the unchunked call's smooth_k subtracts this mean (sage core.py: k.mean(seq_dim))
        km = kh.mean(dim=2, keepdim=True) if centre else None

        def key_chunk(c0: int, c1: int) -> torch.Tensor:
            ks = kh[:, :, c0:c1]
            if km is None:
                return prep(ks, "k")
            shape = (B, ks.shape[2], ks.shape[1], D) if nhd else tuple(ks.shape)
            buf = torch.empty(shape, dtype=ks.dtype, device=ks.device)
            buf = buf.transpose(1, 2) if nhd else buf
            return torch.sub(ks, km, out=buf)

        n_chunks = -(-Skv // kc)
        for s0 in range(0, Sq, qc):
            s1 = min(s0 + qc, Sq)
            qs = prep(q[:, h0:h1, s0:s1], "q")
            merge = KeyChunkMerge(out[:, h0:h1, s0:s1], n_chunks)
            for c0 in range(0, Skv, kc):
                c1 = min(c0 + kc, Skv)
                ks = key_chunk(c0, c1)
                vs = prep(vh[:, :, c0:c1], "v")
                if nhd:
                    o, lse = kern.fn_lse(qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2),
                                         "NHD", n.scale)
                    o = o.transpose(1, 2)
                else:
                    o, lse = kern.fn_lse(qs, ks, vs, "HND", n.scale)
                merge.add(o, lse)
                del ks, vs, o, lse
            del merge, qs
