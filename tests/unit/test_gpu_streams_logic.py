"""bench/kernels/gpu_streams.py's logic on the CPU: each negative-control arm removes exactly its ordering
from the executor's hop (fake CUDA, as in test_streams.py) and restores it; the verdicts; the
profiler-trace classification. And the committed GPU results, when present, agree with the
envelopes' ``launches_on_legacy_stream`` and show every control failing."""
import glob
import json
import os

import pytest
import torch

from safe_ops.attention import executor, streams
from safe_ops.ui import run_stats
from safe_ops.families.envelope import FAMILIES

from test_streams import HOPPED, FakeCuda, fake_executor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "bench", "results")


@pytest.fixture(scope="module")
def gs():
    from bench.kernels import gpu_streams
    return gpu_streams


@pytest.fixture(autouse=True)
def _fresh():
    run_stats.reset()
    yield
    run_stats.reset()


@pytest.mark.parametrize("arm,trace", [
    ("pack", HOPPED + [("record_stream", "caller")]),
    ("never_hop", [("launch", "caller")]),
    ("no_hop_exit", HOPPED[:5]),
])
def test_each_arm_removes_its_ordering_from_the_hop(gs, monkeypatch, arm, trace):
    fake = FakeCuda().install(monkeypatch)
    ex, plan, n = fake_executor(fake)
    with gs.arm(arm):
        out = ex.run(plan, n)
    if arm == "no_hop_exit":
        trace = trace + [("record_stream", "caller")]
    assert fake.trace == trace
    assert out is not None


def test_the_no_record_stream_arm_stubs_tensor_record_stream_and_every_arm_restores(gs):
    before = (streams.StreamHop.__dict__["exit"], executor.legacy_hop, torch.Tensor.record_stream,
              "record_stream" in torch.Tensor.__dict__)
    with gs.arm("no_record_stream"):
        assert torch.zeros(2).record_stream(object()) is None, "a real tensor's record_stream is the stand-in"
    for a in gs.ARMS:
        with gs.arm(a):
            pass
    with pytest.raises(RuntimeError):
        with gs.arm("no_hop_exit"):
            assert streams.StreamHop.exit is not before[0]
            raise RuntimeError("restored on the way out too")
    assert (streams.StreamHop.__dict__["exit"], executor.legacy_hop, torch.Tensor.record_stream,
            "record_stream" in torch.Tensor.__dict__) == before


def test_negative_verdict(gs):
    def arms(**corrupted):
        return {a: {"trials": 3, "corrupted": corrupted.get(a, 3 if a != "pack" else 0)} for a in gs.ARMS}
    assert gs.negative_verdict(arms())["ok"]
    assert not gs.negative_verdict(arms(pack=1))["ok"], "the pack corrupting is a failure"
    v = gs.negative_verdict(arms(no_record_stream=0))
    assert not v["ok"] and v["each_removed_corrupts"]["no_record_stream"] is False, "a control that shows nothing"
    partial = arms()
    del partial["never_hop"]
    assert not gs.negative_verdict(partial)["ok"], "an arm not run is not a pass"


def kernel(name, ts, stream):
    return {"cat": "kernel", "name": name, "ts": ts, "args": {"stream": stream}}


def test_classify_streams_from_a_profiler_trace(gs):
    events = [kernel("spin_kernel(long)", 10, 7), {"cat": "cpu_op", "name": "aten::empty", "ts": 11},
              kernel("spin_kernel(long)", 20, 13),
              kernel("quant_per_warp_int8_kernel", 30, 13), kernel("qk_int8_sv_f8_attn_kernel", 31, 7)]
    got = gs.classify_streams(events)
    assert (got["legacy_stream_id"], got["caller_stream_id"]) == (7, 13)
    assert [(k["name"], k["stream"]) for k in got["kernels"]] == [
        ("quant_per_warp_int8_kernel", "caller"), ("qk_int8_sv_f8_attn_kernel", "legacy")]
    assert got["on_legacy"] and not got["only_legacy"]
    assert gs.stream_verdict(got, True)["agrees"] is True
    assert gs.stream_verdict(got, False)["agrees"] is False, "a Triton-only envelope with a legacy launch"
    triton = gs.classify_streams(events[:3] + [kernel("_attn_fwd", 30, 13)])
    assert gs.stream_verdict(triton, False)["agrees"] is True and not triton["on_legacy"]
    assert "error" in gs.classify_streams(events[:1])
    assert gs.stream_verdict(gs.classify_streams(events[:1]), True)["agrees"] is None


def test_dry_run_writes_its_command_and_arms(gs, tmp_path):
    out = tmp_path / "neg.json"
    gs.main(["negative", "--dry-run", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["dry_run"] and res["env"]["command"].endswith(f"-m bench.kernels.gpu_streams negative --dry-run --out {out}")
    assert set(res["arm_patches"]) == set(gs.ARMS) and res["arm_patches"]["pack"] == []


# ------------------------------------------------------------- the committed GPU results
def _results(pattern):
    return sorted(glob.glob(os.path.join(RESULTS, pattern)))


@pytest.mark.parametrize("path", _results("kernel_streams_*.json") or [None])
def test_measured_kernel_streams_agree_with_the_envelopes(path):
    if path is None:
        pytest.skip("no bench/results/kernel_streams_*.json yet (bench/kernels/gpu_streams.py kernels, on the GPU)")
    res = json.load(open(path))
    ran = {f: r for f, r in res["families"].items() if r.get("agrees") is not None}
    assert ran, f"{path}: no family ran"
    for fam, r in ran.items():
        assert r["table_says_legacy"] == FAMILIES[fam].launches_on_legacy_stream, (
            f"{path}: {fam}'s envelope changed since the measurement; run it again")
        assert r["agrees"], f"{path}: {fam} ran on the legacy stream: {r['observed_on_legacy']}"


@pytest.mark.parametrize("path", _results("streams_negative_controls_*.json") or [None])
def test_measured_negative_controls_each_fail_and_the_pack_never(path):
    if path is None:
        pytest.skip("no bench/results/streams_negative_controls_*.json yet (bench/kernels/gpu_streams.py negative, on the GPU)")
    res = json.load(open(path))
    assert res["verdict"]["pack_clean"] and all(res["verdict"]["each_removed_corrupts"].values()) and res["ok"]
