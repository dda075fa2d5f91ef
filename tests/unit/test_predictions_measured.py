"""The planner's predicted attention memory, held to what an H200 measured (bench/results/), not to
the envelope's own formula typed again. Pure data: the plans are made here from the envelopes, the
numbers they must meet are the committed measurements.

* bench/results/attention_h200.json (``python3 bench/kernels/gpu_attention.py bench --sizes
  38000,99866,169000``; sageattention 1.0.6 on an H200), per S:
  ``extra_peak_bytes_inlimit_kernel``: sageattn on contiguous HND q/k/v, i.e. the kernel's own
  temporaries (quantised copies, scales, output) -- the envelope's ``temp_bytes``;
  ``extra_peak_bytes_guarded``: the guarded call on H3's strided views -- the plan's
  ``peak_bytes`` (its copies plus the kernel's temporaries).
* bench/results/kvchunks_h200.json (``python3 bench/kernels/gpu_kvchunks.py --only kvchunks,...``;
  sageattention 2.2.0's per_warp kernel on an H200, sm_120's 150,000-key rule added so the
  planner chunks the keys): ``peak_extra_kv`` for the kv_chunks plan, ``peak_extra_ref`` for the
  same kernel's unchunked plan, each the first call through SafeAttention.

Every prediction must cover its measurement and not be far above it:
``measured - ALLOCATOR_SLACK <= predicted <= OVER * measured``.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from safe_ops.families import registry  # noqa: F401  (registers every family)
from safe_ops.families.envelope import FAMILIES, AttnCall, TensorDesc
from safe_ops.families.sage1 import SAGE1_TRITON
from safe_ops.families.rules import KvLenRule
from safe_ops.attention.planner import plan_for

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
HEADS, D = 56, 128

#: PyTorch's caching allocator rounds a large request up to a 2 MiB segment and counts the whole
#: block as allocated when splitting off the rest would leave 1 MiB or less, so each large tensor
#: can read up to 1 MiB above its size; a call allocates a handful (int8 q/k, a V copy, the output,
#: the plan's copies). The predictions count requested bytes: they may sit this far below the
#: measurement (at most 2.6 MiB in these files: attention_h200.json, 99,866 tokens).
ALLOCATOR_SLACK = 4 * 2**20
#: ... and at most this factor above it (the kv_chunks predictions are +0.7 % to +0.9 %)
OVER = 1.05


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def h3_view(S: int) -> TensorDesc:
    """What the benches pass: H3's q/k/v as HND views into one [S, 3*56*128] buffer."""
    return TensorDesc((1, HEADS, S, D), (S * 3 * HEADS * D, D, 3 * HEADS * D, 1))


def hnd(S: int) -> TensorDesc:
    return TensorDesc.contiguous((1, HEADS, S, D), "HND")


def call_of(desc: TensorDesc) -> AttnCall:
    return AttnCall(desc, desc, desc, "bfloat16", "HND")


def assert_covers(predicted: int, measured: int, what: str) -> None:
    assert measured - ALLOCATOR_SLACK <= predicted <= OVER * measured, (
        f"{what}: predicted {predicted:,} B vs measured {measured:,} B ({predicted / measured:.4f}x)")


def assert_same_plan(plan, recorded: str, what: str) -> None:
    """The plan made here is the one the GPU ran (else the measurement says nothing about it:
    re-run the bench)."""
    assert plan is not None, what
    assert recorded.startswith(f"{plan.kind} on {plan.kernel} ({plan.layout})"), (what, plan.describe(False), recorded)
    assert f" {plan.launches} launch(es)" in recorded, (what, plan.describe(False), recorded)


ATTENTION = _load("attention_h200.json")
KVCHUNKS = _load("kvchunks_h200.json")
KV_SECTION = KVCHUNKS["sections"]["kvchunks"]


def test_the_measurements_are_the_ones_described():
    assert ATTENTION["env"]["gpu"] == KVCHUNKS["env"]["gpu"] == "NVIDIA H200"
    assert ATTENTION["env"]["sageattention"] == "1.0.6" and KVCHUNKS["env"]["sageattention"] == "2.2.0"
    assert [r["S"] for r in ATTENTION["rows"]] == [38_000, 99_866, 169_000]
    assert [(r["family"], r["S"]) for r in KV_SECTION["rows"]] == [
        ("sage2_fp8pv_perwarp", 169_000), ("sage2_fp8pv_perwarp", 230_000), ("sage2_fp8pv_perwarp", 314_437)]


@pytest.mark.parametrize("row", ATTENTION["rows"], ids=lambda r: f"S{r['S']}")
def test_sage1_kernel_temporaries_cover_the_measured_kernel(row):
    """sageattn 1.0.6 on contiguous HND inputs: what the kernel allocated itself."""
    S = row["S"]
    assert_covers(SAGE1_TRITON.temp_bytes(call_of(hnd(S))), row["extra_peak_bytes_inlimit_kernel"],
                  f"sage1_triton kernel at {S:,}")


@pytest.mark.parametrize("row", ATTENTION["rows"], ids=lambda r: f"S{r['S']}")
def test_sage1_plan_peak_covers_the_measured_guarded_call(row):
    """The guarded call on H3's strided views (direct at 38,000; q/k repacked past 99,865)."""
    S = row["S"]
    plan = plan_for(call_of(h3_view(S)), SAGE1_TRITON)
    assert_same_plan(plan, row["plan"], f"sage1_triton at {S:,}")
    assert plan.kind == ("direct" if S <= 99_865 else "repack")
    assert_covers(plan.peak_bytes, row["extra_peak_bytes_guarded"], f"sage1_triton {plan.kind} at {S:,}")


@pytest.mark.parametrize("row", KV_SECTION["rows"], ids=lambda r: f"S{r['S']}")
def test_sage2_perwarp_kv_chunks_and_unchunked_peaks_cover_the_measurement(row):
    S, env = row["S"], FAMILIES[row["family"]]
    rule = KvLenRule(env.family, KV_SECTION["kv_rule"], "kvchunks_h200.json", "sm_120's rule on the H200")
    chunked_env = dataclasses.replace(env, extra_rules=env.extra_rules + (rule,))
    kv = plan_for(call_of(h3_view(S)), chunked_env)
    assert_same_plan(kv, row["plan_kv"], f"kv_chunks at {S:,}")
    assert (kv.kind, kv.kv_chunk) == ("kv_chunks", row["kv_chunk"]), kv.describe(False)
    assert_covers(kv.peak_bytes, row["peak_extra_kv"], f"{env.family} kv_chunks at {S:,}")
    ref = plan_for(call_of(h3_view(S)), env)
    assert_same_plan(ref, row["plan_ref"], f"unchunked at {S:,}")
    assert_covers(ref.peak_bytes, row["peak_extra_ref"], f"{env.family} {ref.kind} at {S:,}")
