"""Trust but verify: check a cheap slice of a kernel's real output against SDPA.

Envelopes stop kernels that fault; they cannot stop a kernel that silently
computes garbage (HAZARDS.md H-6: sage 2.2.0 sm_90 built from source returns
noise with no CUDA error; sm_120 FP8-PV turns to noise above ~154-160k tokens).

The first time a kernel family runs a new *class* of call -- on this GPU arch with this build of
the kernel, dtype, head dim,
layout, GQA ratio, and a size class fine enough in sequence length to separate
150k from 160k -- :class:`Verifier` recomputes a few hundred query rows (spread
over the sequence, plus the last tile) of four heads of every batch element
against all keys in float32 and compares
relative L2 error with the family's tolerance. A NaN/Inf in the probed output
where the reference is finite is a failure. A failed class is never trusted again in this process.
After the first call of a class the cost is one dict lookup.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch

from ..ui import run_stats

PROBE_ROWS = 256          # query rows checked per probed head, spread over the sequence
TAIL_ROWS = 64            # plus the last rows (the partial last tile, where padding bugs live)
PROBE_HEADS = 4           # heads checked per batch element: first, last and evenly between
SIZE_CLASS_TOKENS = 4096  # sequence-length bucket width (a cliff between 150k and 160k is caught)


def size_class(n: int) -> int:
    """Bucket of a sequence length, 4096 tokens wide (150k and 160k land in different classes)."""
    return n // SIZE_CLASS_TOKENS


def class_key(family: str, site: str, dtype: str, head_dim: int, layout: str, heads: int, kv_heads: int,
              q_len: int, kv_len: int) -> tuple:
    """The class of a call a verdict covers. ``site``: the GPU arch and kernel build
    (``Runtime.kernel_site``): a kernel checked on one arch or build is not trusted on another."""
    return (family, site, dtype, head_dim, layout, heads // max(kv_heads, 1), size_class(q_len),
            size_class(kv_len))


@dataclass
class Verdict:
    ok: bool
    error: float
    tolerance: float
    detail: str = ""
    conclusive: bool = True


def probe_rows(q_len: int, n: int = PROBE_ROWS, tail: int = TAIL_ROWS) -> torch.Tensor:
    """Query rows spread over the whole sequence (first, last and evenly between) plus the last
    ``tail`` rows."""
    if q_len <= n + tail:
        return torch.arange(q_len)
    spread = torch.linspace(0, q_len - 1, n).round().long()
    return torch.cat([spread, torch.arange(q_len - tail, q_len)]).unique()


def probe_heads(heads: int, n: int = PROBE_HEADS) -> tuple[int, ...]:
    """First, last and evenly spaced heads between."""
    if heads <= n:
        return tuple(range(heads))
    return tuple(sorted({round(i * (heads - 1) / (n - 1)) for i in range(n)}))


#: the probe's own working memory (float32 key/value blocks and scores of one slice): small next
#: to a plan's budget, so the check never asks much of a device the plan already filled
PROBE_MAX_BYTES = 64 * 2 ** 20


def reference_rows(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, scale: float,
                   max_bytes: int = PROBE_MAX_BYTES) -> torch.Tensor:
    """float32 attention of query rows ``qs`` [r, D] over keys ``ks`` / values ``vs`` [Skv, D],
    in key blocks merged by a running max and sum (exact up to float32 rounding), so that no
    [r, Skv] score matrix or whole-sequence float32 copy is made: at most ``max_bytes``."""
    r, d = qs.shape
    n = ks.shape[0]
    per_key = (r + 2 * d) * 4                     # a score column + the float32 key and value rows
    kb = max(1024, int(max_bytes) // per_key)
    q32 = qs.float()
    acc = run_max = run_sum = None
    for c0 in range(0, n, kb):
        sc = (q32 @ ks[c0:c0 + kb].float().T).mul_(scale)         # [r, kb]
        m = sc.amax(dim=-1)
        if acc is None:
            p = (sc - m[:, None]).exp_()
            acc, run_max, run_sum = p @ vs[c0:c0 + kb].float(), m, p.sum(dim=-1)
            continue
        new = torch.maximum(run_max, m)
        old = (run_max - new).exp_()
        p = (sc - new[:, None]).exp_()
        run_sum = run_sum * old + p.sum(dim=-1)
        acc = acc.mul_(old[:, None]).addmm_(p, vs[c0:c0 + kb].float())
        run_max = new
    return acc / run_sum[:, None]


def compare(out_hnd: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            scale: float | None, tolerance: float, heads: tuple[int, ...] | None = None,
            max_bytes: int = PROBE_MAX_BYTES) -> Verdict:
    """Compare ``out_hnd`` ([B,H,Sq,D]) on a slice with float32 attention of the same inputs (HND views).

    Every batch element, :func:`probe_heads` heads and :func:`probe_rows` rows, the reference
    in key blocks within ``max_bytes`` (:func:`reference_rows`), one host read for the whole
    check. The verdict fails on a NaN/Inf in the probed output where the reference row is
    finite, and when the worst relative L2 error of a (batch, head) slice is over ``tolerance``
    or is NaN (NaN compares false with everything, so it is checked explicitly). Rows whose
    reference is NaN/Inf (NaN/Inf inputs) are not the kernel's fault and are left out; if no
    row is left the verdict is inconclusive and not remembered.
    """
    B, H, Sq, D = q.shape
    if Sq == 0 or k.shape[2] == 0:
        return Verdict(True, 0.0, tolerance, "empty")
    hk = k.shape[1]
    ratio = max(H // max(hk, 1), 1)
    heads = heads or probe_heads(H)
    rows = probe_rows(Sq).to(q.device)
    s = scale if scale is not None else D ** -0.5
    slices, stats = [], []
    for b in range(B):
        for h in heads:
            ref = reference_rows(q[b, h].index_select(0, rows), k[b, h // ratio], v[b, h // ratio], s, max_bytes)
            got = out_hnd[b, h].index_select(0, rows).float()
            # Rows whose reference is not finite come from NaN/Inf *inputs*: any kernel gives
            # NaN there, so they are left out. Everywhere else the output must be finite.
            ref_ok = torch.isfinite(ref).all(dim=-1)
            got_ok = torch.isfinite(got).all(dim=-1)
            m = ref_ok.unsqueeze(-1)
            stats.append(torch.stack([(ref_ok & ~got_ok).sum().float(), ref_ok.sum().float(),
                                      (got - ref).where(m, 0.0).norm(), ref.where(m, 0.0).norm()]))
            slices.append((b, h))
            del ref, got
    worst, where, compared = 0.0, "", 0
    for (b, h), (bad_rows, ref_rows, diff, denom) in zip(slices, torch.stack(stats).tolist()):  # one host read
        if bad_rows:
            return Verdict(False, math.inf, tolerance,
                           f"non-finite output (NaN/Inf) in {int(bad_rows)} probed rows of batch {b} "
                           f"head {h} where the reference is finite")
        if not ref_rows:
            continue
        compared += 1
        err = diff / max(denom, 1e-12)
        if not err <= worst:          # also true for NaN: it must never be dropped
            worst, where = err, f"batch {b} head {h}"
    if not compared:
        return Verdict(True, math.nan, tolerance, "inconclusive: the reference is NaN/Inf on every "
                       "probed row (NaN/Inf inputs)", conclusive=False)
    ok = math.isfinite(worst) and worst <= tolerance
    return Verdict(ok, worst, tolerance,
                   f"rel. L2 {worst:.4f} vs tol {tolerance} on {len(rows)} rows x heads {list(heads)}"
                   f" x {B} batch element(s), worst at {where}")


class Verifier:
    """Per-process verdict cache keyed by call class."""

    def __init__(self, mode: str = "first"):
        self.mode = mode                 # "first" | "every" | "off"
        self._verdicts: dict[tuple, Verdict] = {}
        self._lock = threading.Lock()

    def needs_probe(self, key: tuple) -> bool:
        if self.mode == "off":
            return False
        if self.mode == "every":
            return True
        return key not in self._verdicts

    def known_bad(self, key: tuple) -> Verdict | None:
        v = self._verdicts.get(key)
        return v if v is not None and not v.ok else None

    def record(self, key: tuple, verdict: Verdict) -> None:
        if not verdict.conclusive:
            return              # probe this class again on its next call
        with self._lock:
            prev = self._verdicts.get(key)
            if prev is not None and not prev.ok:
                return          # a failed class stays failed
            self._verdicts[key] = verdict
            # bounded like every per-shape store: passed classes go first (at worst probed again)
            run_stats.trim(self._verdicts, expendable=lambda v: v.ok)

    def verdicts(self) -> dict:
        with self._lock:
            return {"/".join(map(str, k)): (v.ok, round(v.error, 5)) for k, v in self._verdicts.items()}
