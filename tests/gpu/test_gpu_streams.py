"""The legacy-stream hop's negative controls and the streams the kernels really run on, on the GPU
(bench/kernels/gpu_streams.py; its logic is unit-tested in tests/unit/test_gpu_streams_logic.py).

Needs a sage 2.2 build with a legacy-stream family for this GPU (``SAFESAGE_BENCH_FAMILY``,
default sage2_fp8pv_perwarp; on the H200 the 8.9+PTX build: ``ss_sage sm89``)."""
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.kernels import gpu_streams as gs  # noqa: E402

pytestmark = pytest.mark.gpu
FAMILY = os.environ.get("SAFESAGE_BENCH_FAMILY") or "sage2_fp8pv_perwarp"


def test_each_ordering_of_the_hop_removed_corrupts_and_the_pack_does_not():
    from safe_ops.families.registry import kernel_of as sage2_kernel
    k = sage2_kernel(FAMILY)
    if k is None or not k.envelope.launches_on_legacy_stream:
        pytest.skip(f"{FAMILY}: not a legacy-stream family of this sageattention build (needs sage 2.2)")
    res = gs.main(["negative", "--family", FAMILY, "--trials", "2"])
    assert res["verdict"]["pack_clean"], res["arms"]["pack"]
    assert all(res["verdict"]["each_removed_corrupts"].values()), res["verdict"]


def test_kernels_run_on_the_stream_their_envelope_says():
    res = gs.main(["kernels"])
    ran = {f: r for f, r in res["families"].items() if r.get("agrees") is not None}
    if not ran:
        pytest.skip(f"no family ran here: {res['families']}")
    assert all(r["agrees"] for r in ran.values()), ran
