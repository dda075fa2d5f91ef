"""SafeSage's comfy-kitchen envelopes against the GPU: for every committed ``ck*_probe`` result
(bench/kernels/gpu_kvchunks.py ck_probe on the H200), the first length the envelope of that
comfy-kitchen version marks as refused is the first length the real ``int8_attention`` refused,
per side and layout -- and where the wheel refused nothing, the envelope refuses nothing."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROBES = sorted((REPO / "bench" / "results").glob("ck*_probe_h200.json"))


def test_probes_cover_both_sides_of_the_236_change():
    """0.2.35 before the 64-bit bases of 0.2.36, 0.2.39 and 0.2.40 after: one probe file each."""
    versions = [json.loads(p.read_text())["env"]["comfy-kitchen"] for p in PROBES]
    assert sorted(versions) == ["0.2.35", "0.2.39", "0.2.40"], versions


@pytest.mark.parametrize("path", PROBES, ids=[p.name for p in PROBES])
def test_envelope_predicts_the_measured_boundary(path, bench_tables):
    t = bench_tables
    d = json.loads(path.read_text())
    ver = d["env"]["comfy-kitchen"]
    probes = d["sections"]["ck_probe"]["probes"]
    assert len(probes) == 6
    for r in probes:
        hi = r.get("first_failing") or r["passes_up_to"]
        pred = t.ck_predicted_first_refusing(ver, r["side"], r["layout"], hi)
        assert pred == r.get("first_failing"), (ver, r["side"], r["layout"], pred, r.get("first_failing"))
