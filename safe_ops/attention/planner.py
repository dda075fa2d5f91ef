"""From a call to a Plan that is inside every envelope and inside the memory budget.

A :class:`Plan` is printable data. Executing it is executor.py's job. The
planner is a pure function of (call, envelope, budget): it enumerates the
transformations that keep results identical to an in-envelope run --

* ``direct``        launch as called;
* ``repack``        copy some of q/k/v to a contiguous layout first (small strides),
                    HND or NHD, whichever copy keeps the source's memory order;
* ``head_groups``   launch per group of heads (each group's tensors repacked or
                    as views), writing into one preallocated output;
* ``query_chunks``  launch per slice of query tokens (keys/values whole);
* ``kv_chunks``     launch per slice of key/value tokens and merge the partial outputs
                    exactly by their log-sum-exp (kernels whose envelope says
                    ``returns_lse``); combines with head groups and query chunks;

checks each candidate's sub-calls against the envelope, drops those whose memory
(copies, merge accumulator *and* the kernel's own temporaries of one launch) is
over the budget, and keeps the cheapest by a simple cost model (bytes moved plus
a per-launch overhead). When none fits it returns ``None`` and the caller falls
back to another kernel (SDPA last).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from ..families.envelope import AttnCall, Envelope, TensorDesc, byte_alignment, check

# Cost model constants: bytes per microsecond an HBM copy moves (read + write
# counted separately), and the fixed cost of one extra launch sequence.
COPY_BYTES_PER_US = 2.0e6         # ~2 TB/s effective for strided copies
LAUNCH_US = 25.0                  # sage launches 2-3 kernels per call
MIN_Q_CHUNK = 1024                # below this, per-launch overhead dominates: prefer another plan
KV_ALIGN = 128                    # key chunks are multiples of this (sage's K tiles and sm90's V pad)
MIN_KV_CHUNK = 4096               # smaller key chunks: re-quantising q per chunk dominates
# Rules that moving data can fix: index products (copies, groups, chunks), base-pointer and
# stride alignment (a copy is a fresh, aligned allocation: comfy-kitchen's #15494 rule) and
# key-length rules (key/value chunks, only for kernels that return their LSE).
SOFT_RULES = ("index", "align")
SOFT_RULES_LSE = ("index", "align", "length")
# A copy that changes memory order vs one that keeps it. On the H200 the two repacks of H3's
# views timed the same end to end (bench/results/attention_h200.json, other_layout_repack_ms),
# so this only breaks the tie -- toward NHD for H3, whose [B,S,H*D] output is then a free view.
TRANSPOSE_COPY_FACTOR = 2.0


@dataclass(frozen=True)
class Plan:
    kind: str                      # direct | repack | head_groups | query_chunks | kv_chunks | sdpa
    kernel: str                    # envelope family that runs
    layout: str                    # tensor_layout handed to the kernel
    repack: tuple[str, ...] = ()   # which of q/k/v are copied, contiguous in `layout`
    head_group: int = 0            # heads per launch (0 = all)
    q_chunk: int = 0               # query tokens per launch (0 = all)
    launches: int = 1
    extra_bytes: int = 0           # predicted peak bytes beyond a direct call
    cost_us: float = 0.0           # predicted extra device time vs a direct call
    reasons: tuple[str, ...] = ()  # why not direct (violations of the kernel that was asked)
    kernel_temp_bytes: int = 0     # what one launch allocates itself (quantised copies, output), if known
    kv_chunk: int = 0              # key/value tokens per launch (0 = all), merged by log-sum-exp
    time_factor: float = 1.0       # the kernel's own time vs a plain call (kv_chunks: its LSE variant)
    note: str = ""                 # why this plan won a priced choice (auto on a measured GPU)

    @property
    def peak_bytes(self) -> int:
        """What the plan needs beyond the caller's tensors and the result: the budgeted number."""
        return self.extra_bytes + self.kernel_temp_bytes

    def describe(self, reasons: bool = True) -> str:
        if self.kind == "sdpa":
            # no guarded kernel: the call runs what ComfyUI would run (attention.SafeAttention)
            parts = ["sdpa: ComfyUI's own attention (no guarded kernel)"]
        else:
            parts = [f"{self.kind} on {self.kernel} ({self.layout})"]
        if self.repack:
            parts.append("repack " + "/".join(self.repack) + f" to contiguous {self.layout}")
        if self.head_group:
            parts.append(f"{self.head_group} heads per launch")
        if self.q_chunk:
            parts.append(f"{self.q_chunk:,} query tokens per launch")
        if self.kv_chunk:
            parts.append(f"{self.kv_chunk:,} key tokens per launch merged by log-sum-exp"
                         + (f" (LSE kernel x{self.time_factor:.3f})" if self.time_factor != 1.0 else ""))
        parts.append(f"{self.launches} launch(es), +{self.extra_bytes / 2**20:.1f} MiB, ~+{self.cost_us:.0f} us")
        if self.kernel_temp_bytes:
            parts.append(f"kernel temporaries {self.kernel_temp_bytes / 2**20:.0f} MiB per launch")
        s = ", ".join(parts)
        if self.note:
            s += "; " + self.note
        if reasons and self.reasons:
            s += "; because " + "; ".join(self.reasons)
        return s

    __str__ = describe


def sub_call(call: AttnCall, heads: int, q_len: int, repack: tuple[str, ...], layout: str,
              kv_len: int | None = None) -> AttnCall:
    """The call one launch of a plan makes (worst-case group/chunk). A view's base pointer is
    aligned as the worst launch's: launch i of a split starts ``i`` groups/chunks further in."""
    kv_len = call.kv_len if kv_len is None else kv_len
    groups = max(call.heads // max(call.kv_heads, 1), 1)
    kv_heads = max(heads // groups, 1)

    def desc(name: str, h: int, s: int) -> TensorDesc:
        src: TensorDesc = getattr(call, name)
        shape = (src.shape[0], h, s, src.shape[3])
        if name in repack:
            return TensorDesc.contiguous(shape, layout)   # copied into the kernel's layout
        align = src.align
        for ax, n in ((1, h), (2, s)):
            if n < src.shape[ax]:                 # more than one launch along this axis
                align = min(align, byte_alignment(n * src.stride[ax] * call.elt_bytes))
        return TensorDesc(shape, src.stride, align)   # a view into the caller's tensor

    return replace(call, q=desc("q", heads, q_len), k=desc("k", kv_heads, kv_len),
                   v=desc("v", kv_heads, kv_len), layout=layout)


def _nbytes(desc: TensorDesc, elt: int) -> int:
    return desc.numel * elt


def _candidates_g(call: AttnCall) -> list[int]:
    """Head-group sizes to try: all heads, then every multiple of the GQA ratio, large first."""
    ratio = max(call.heads // max(call.kv_heads, 1), 1)
    return sorted({g for g in range(ratio, call.heads + 1, ratio) if call.heads % g == 0}, reverse=True)


def _largest_fitting(lo: int, hi: int, ok) -> int:
    """Largest n in [lo, hi] with ok(n) (ok monotone: true for small n); 0 if none."""
    if hi < lo or not ok(lo):
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def plan_for(call: AttnCall, env: Envelope, budget_bytes: int | None = None,
             caller_layout: str | None = None) -> Plan | None:
    """Cheapest plan of ``env``'s kernel that is inside the envelope and the budget, or None.

    The budget covers :attr:`Plan.peak_bytes`: the plan's own copies and merge state plus the
    temporaries the kernel allocates in one launch (``Envelope.temp_bytes``).
    """
    caller_layout = caller_layout or call.layout
    direct = replace(call, layout=caller_layout)
    viol = check(direct, env)
    budget = float("inf") if budget_bytes is None else budget_bytes
    if not viol:
        plan = Plan("direct", env.family, caller_layout, kernel_temp_bytes=_temp(env, direct))
        if plan.peak_bytes <= budget:
            return plan
    # Shape/dtype/device/mask rules cannot be fixed by moving data around.
    soft = SOFT_RULES_LSE if env.returns_lse else SOFT_RULES
    if any(v.rule not in soft for v in viol):
        return None
    reasons = tuple(str(v) for v in viol) or (
        f"kernel temporaries {_temp(env, direct) / 2**20:,.0f} MiB over the "
        f"{budget / 2**20:,.0f} MiB budget",)
    elt = call.elt_bytes
    best: Plan | None = None

    for r in range(0, 4):
        for repack, layout in _repack_options(r, caller_layout):
            for g in _candidates_g(call):
                for kc in _kv_chunk_options(call, env, g, repack, layout):
                    # largest query chunk that fits for this (repack, g, kc)
                    def fits(qc: int, g=g, repack=repack, layout=layout, kc=kc) -> bool:
                        return not check(sub_call(call, g, qc, repack, layout, kc), env)
                    qc_max = call.q_len if fits(call.q_len) else _largest_fitting(1, call.q_len, fits)
                    # try the largest fitting chunk first, then halve it while over budget
                    qc = qc_max
                    while qc > 0:
                        plan = _priced(call, env, repack, layout, g, qc, elt, reasons, kc)
                        if plan.peak_bytes <= budget:
                            if best is None or (plan.cost_us, plan.peak_bytes) < (best.cost_us, best.peak_bytes):
                                best = plan
                            break
                        if qc <= MIN_Q_CHUNK:
                            break
                        qc = max(qc // 2, MIN_Q_CHUNK)
    return best


def _kv_chunk_options(call: AttnCall, env: Envelope, g: int, repack: tuple[str, ...], layout: str) -> list[int]:
    """Key/value chunk lengths worth pricing for (g, repack, layout): all keys, and -- for a
    kernel that returns its LSE -- equal chunks (multiples of KV_ALIGN) no longer than the
    longest that keeps the key side inside the envelope, and half that (less memory)."""
    opts = [call.kv_len]
    if not env.returns_lse or call.kv_len <= MIN_KV_CHUNK:
        return opts
    if env.lse_centred_k and "k" not in repack:
        return opts          # the centred key chunk is a copy: only plans that copy k
    q1 = min(call.q_len, KV_ALIGN)

    def fits(kc: int) -> bool:
        return not check(sub_call(call, g, q1, repack, layout, kc * KV_ALIGN), env)

    longest = _largest_fitting(1, -(-call.kv_len // KV_ALIGN), fits) * KV_ALIGN
    if longest < MIN_KV_CHUNK:
        return opts
    for n in (-(-call.kv_len // longest), 2 * -(-call.kv_len // longest)):
        if n < 2:
            continue
        kc = -(-call.kv_len // n)
        kc = min(-(-kc // KV_ALIGN) * KV_ALIGN, longest)
        if MIN_KV_CHUNK <= kc < call.kv_len and kc not in opts:
            opts.append(kc)
    return opts


def _repack_options(r: int, caller_layout: str):
    """(tensors to copy, kernel layout): no copy keeps the caller's layout; a copy may go to either."""
    for repack in itertools.combinations(("q", "k", "v"), r):
        for layout in ((caller_layout,) if not repack else ("HND", "NHD")):
            yield repack, layout


def _copy_factor(src: TensorDesc, layout: str) -> float:
    """Relative cost of copying ``src`` into ``layout``: a copy that keeps the source's memory
    order (token-major source -> NHD, head-major -> HND) streams rows; one that does not
    transposes them."""
    token_major = src.stride[2] > src.stride[1]
    return 1.0 if token_major == (layout == "NHD") else TRANSPOSE_COPY_FACTOR


def _priced(call: AttnCall, env: Envelope, repack: tuple[str, ...], layout: str, g: int, qc: int,
            elt: int, reasons: tuple[str, ...], kc: int = 0) -> Plan:
    """The plan launching ``g`` heads x ``qc`` query tokens x ``kc`` keys at a time, priced."""
    kc = kc or call.kv_len
    n_groups = -(-call.heads // g)
    n_chunks = -(-call.q_len // qc)
    n_kv = -(-call.kv_len // kc)
    launches = n_groups * n_chunks * n_kv
    split = n_groups * n_chunks > 1 or n_kv > 1
    # Repacked slices live one launch at a time (group x chunk for q, group (x key chunk)
    # for k/v); a split plan writes each block's result into one preallocated output,
    # which takes the place of the kernel's output in a direct call.
    sub = sub_call(call, g, qc, repack, layout, kc)
    extra = sum(_nbytes(getattr(sub, n), elt) for n in repack)
    if split:
        extra += _nbytes(sub.q, elt)
    copy_bytes = 0
    for n in repack:                                       # each element copied once
        copy_bytes += 2 * _nbytes(getattr(call, n), elt) * _copy_factor(getattr(call, n), layout)
    if n_kv > 1:
        # key chunks are re-made (centred copies) for every query chunk
        copy_bytes += (n_chunks - 1) * 2 * _nbytes(call.k, elt) * ("k" in repack)
        # running fp32 accumulator of one (group x query chunk) block, its LSE and the
        # chunk's LSE / merge weights
        extra += 4 * sub.q.numel + 4 * 4 * sub.q.shape[0] * sub.q.shape[1] * sub.q.shape[2]
        # q re-quantised per key chunk; merge reads each chunk's output and reads+writes
        # the accumulator, then writes the result once
        copy_bytes += (n_kv - 1) * 2 * _nbytes(call.q, elt)
        copy_bytes += call.q.numel * (n_kv * (elt + 8) + 4 + elt)
    elif split:
        copy_bytes += 2 * _nbytes(call.q, elt)             # launch outputs into the result
    copy_bytes += (n_chunks - 1) * 2 * _nbytes(call.k, elt)  # k re-quantised per query chunk
    cost = copy_bytes / COPY_BYTES_PER_US + (launches - 1) * LAUNCH_US
    kind = ("kv_chunks" if n_kv > 1 else "head_groups" if n_groups > 1 else
            "query_chunks" if n_chunks > 1 else "repack" if repack else "direct")
    return Plan(kind, env.family, layout, tuple(repack), g if n_groups > 1 else 0,
                qc if n_chunks > 1 else 0, launches, extra, cost, reasons, _temp(env, sub),
                kc if n_kv > 1 else 0, env.lse_time_factor if n_kv > 1 else 1.0)


def _temp(env: Envelope, call: AttnCall) -> int:
    return env.temp_bytes(call) if env.temp_bytes is not None else 0


def sdpa_plan(call: AttnCall, reasons: tuple[str, ...] = ()) -> Plan:
    return Plan("sdpa", "sdpa", "HND", reasons=reasons)


def estimated_us(call: AttnCall, plan: Plan, tflops: float) -> float:
    """Device time of ``plan`` for ``call`` on a kernel measured at ``tflops`` in-limit:
    the attention's FLOPs at that rate, times the plan's kernel-variant factor, plus its
    copies and launches (``cost_us``)."""
    b, h, sq, d = call.q.shape
    flops = 4.0 * b * h * sq * call.kv_len * d
    return flops / (tflops * 1e6) * plan.time_factor + plan.cost_us


def choose(call: AttnCall, envelopes: list[Envelope], budget_bytes: int | None = None,
           tflops: dict[str, float] | None = None) -> Plan:
    """First kernel (in preference order) that has a plan; SDPA when none does.

    ``tflops`` (measured in-limit TFLOP/s per family, SDPA included: ``auto`` on a measured
    GPU): among the leading families that have a number, the plan with the smallest
    :func:`estimated_us` wins, so a sage family measured faster than SDPA in-limit still
    loses to SDPA where its plan (e.g. kv_chunks with its LSE kernel) costs more than the lead.

    An SDPA plan reached because a sage kernel ahead of it was ruled out carries the
    reasons (a fallback); one chosen on purpose (SDPA first in the order, or priced
    faster than every sage plan) has none.
    """
    reasons: list[str] = []
    best: tuple[float, Plan] | None = None
    for env in envelopes:
        priced = tflops is not None and env.family in tflops
        if best is not None and not priced:
            break                          # the measured families lead the order (auto_order)
        if env.family == "sdpa":
            if not priced:
                break
            # a family measured faster that could not run this call makes SDPA a fallback
            plan = sdpa_plan(call, tuple(reasons))
            t = estimated_us(call, plan, tflops["sdpa"])
            if best is None:
                best = (t, plan)
            elif t < best[0]:
                lost = best[1]
                best = (t, replace(plan, note=f"priced: SDPA ~{t / 1e3:,.1f} ms vs {lost.kind} on {lost.kernel} "
                                              f"~{best[0] / 1e3:,.1f} ms"))
            break                          # families after SDPA are measured slower in-limit
        plan = plan_for(call, env, budget_bytes)
        if plan is not None:
            if not priced:
                return plan
            t = estimated_us(call, plan, tflops[env.family])
            if best is None or t < best[0]:
                best = (t, plan)
            continue
        viol = check(call, env)
        soft = SOFT_RULES_LSE if env.returns_lse else SOFT_RULES
        hard = [str(v) for v in viol if v.rule not in soft]
        budget = "no" if budget_bytes is None else f"the {budget_bytes / 2**20:,.0f} MiB"
        why = "; ".join(hard) or (f"no plan within {budget} memory budget (copies + kernel temporaries): "
                                  + "; ".join(map(str, viol)))
        reasons.append(f"{env.family}: {why}")
    if best is not None:
        return best[1]
    return sdpa_plan(call, tuple(reasons))
