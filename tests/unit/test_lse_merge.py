"""The key-chunk merge (safe_ops/attention/lse_merge.py): which implementation a block gets, the fused
path's bookkeeping (what it keeps, what each launch writes), its fallback, and -- in a child process
under the Triton interpreter -- the Triton kernel itself against the torch reference merge.

The kernel test needs triton: importable here, or installed where SAFESAGE_TRITON_PATH points
(.ci/run puts triton 3.6.0 there with .ci/setup_triton.sh, outside the pass's venv, so the rest of
the suite and ComfyUI run without it as on a CPU-only user's machine). Without either it skips,
saying so. On the GPU: tests/gpu/test_gpu_lse_merge.py.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from safe_ops.attention import lse_merge as L
from safe_ops.ui import run_stats

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    run_stats.reset()
    monkeypatch.setattr(L, "_fused", L._fused)          # restored after each test
    monkeypatch.setattr(L, "_enabled", True)


def chunks(n, B=2, H=3, S=7, D=16, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    os_ = [torch.randn(B, S, H, D, generator=g).to(dtype).transpose(1, 2) for _ in range(n)]
    ls = [torch.randn(B, H, S, generator=g) * 3 for _ in range(n)]
    return os_, ls


def reference(os_, ls, dtype):
    acc = run = None
    for o, lse in zip(os_, ls):
        acc, run = L.lse_merge(acc, run, o.clone(), lse.clone())
    return acc.to(dtype)


class StandIn:
    """The fused module's contract (``merge(a, la, b, lb, out, lse_out)``) in float64 torch ops,
    recording each launch: what it read and wrote."""

    def __init__(self, fail: Exception | None = None):
        self.calls = []
        self.fail = fail

    def merge(self, a, la, b, lb, out, lse_out):
        if self.fail is not None:
            raise self.fail
        self.calls.append(dict(a_dtype=a.dtype, out_is_a=out.data_ptr() == a.data_ptr(),
                               out_dtype=out.dtype, writes_lse=lse_out is not None))
        new = torch.logaddexp(la.double(), lb.double())
        r = a.double() * (la.double() - new).exp().unsqueeze(-1) + b.double() * (lb.double() - new).exp().unsqueeze(-1)
        out.copy_(r)
        if lse_out is not None:
            lse_out.copy_(new)


def test_cpu_blocks_use_the_torch_merge_and_never_ask_for_triton(monkeypatch):
    """On the CPU (no interpreter) the fused module is not even imported: a CPU-only ComfyUI never
    loads triton through SafeSage."""
    def no(*a):
        raise AssertionError("the fused merge was imported for a CPU block")
    monkeypatch.setattr(L, "_import_fused", no)
    monkeypatch.setattr(L, "_fused", None)
    for n in (1, 2, 3):
        os_, ls = chunks(n, seed=n)
        dst = torch.empty(2, 3, 7, 16, dtype=torch.bfloat16)
        m = L.KeyChunkMerge(dst, n)
        for o, lse in zip(os_, ls):
            m.add(o.clone(), lse)
        assert m.fused is None
        assert torch.equal(dst, reference(os_, ls, torch.bfloat16))     # the same ops, bit for bit
    assert run_stats.value("kv_merge_torch") == 3 and run_stats.value("kv_merge_fused") == 0


def test_without_triton_the_import_is_tried_once_per_process(monkeypatch):
    tries = []

    def missing():
        tries.append(1)
        raise ImportError("No module named 'triton'")
    monkeypatch.setattr(L, "_import_fused", missing)
    monkeypatch.setattr(L, "_fused", None)
    assert L.fused_module() is None and L.fused_module() is None
    assert tries == [1]


def test_cpu_blocks_take_only_an_interpreted_kernel_and_odd_dtypes_none(monkeypatch):
    fake = StandIn()
    fake.INTERPRETED = False
    monkeypatch.setattr(L, "_fused", fake)
    o, lse = torch.zeros(1, 2, 3, 8, dtype=torch.bfloat16), torch.zeros(1, 2, 3)
    dst = torch.empty(1, 2, 3, 8, dtype=torch.bfloat16)
    assert L.fused_for(o, lse, dst) is None                               # CPU, a kernel for the GPU
    fake.INTERPRETED = True                                               # built for the Triton interpreter
    assert L.fused_for(o, lse, dst) is fake
    assert L.fused_for(o.double(), lse, dst) is None                      # a dtype the kernel does not read
    assert L.fused_for(o, lse, dst.to(torch.int32)) is None
    assert L.fused_for(o, lse[:, :1], dst) is None                        # shapes that do not match
    L.set_fused(False)
    assert L.fused_for(o, lse, dst) is None                               # switched off
    L.set_fused(True)
    assert L.fused_for(o, lse, dst) is fake


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fused_bookkeeping(n, out_dtype):
    """2 chunks: the first output is kept as it is (no float32 accumulator) and one launch writes
    the result; more: the accumulator is updated in place by each middle chunk, the last launch
    writes the result; 1: a copy."""
    fake = StandIn()
    os_, ls = chunks(n, seed=10 + n)
    dst = torch.empty(2, 3, 7, 16, dtype=out_dtype)
    m = L.KeyChunkMerge(dst, n, fused=fake)
    m.add(os_[0].clone(), ls[0].clone())
    if n == 2:
        assert m.acc is None and m.first is not None
    for o, lse in zip(os_[1:], ls[1:]):
        m.add(o.clone(), lse.clone())
    assert m.acc is None and m.run is None and m.first is None            # nothing kept
    torch.testing.assert_close(dst.float(), reference(os_, ls, torch.float32).to(out_dtype).float(),
                               rtol=1e-5, atol=1e-5 if out_dtype == torch.float32 else 2 ** -6)
    want = ([] if n == 1 else
            [dict(a_dtype=torch.bfloat16, out_is_a=False, out_dtype=out_dtype, writes_lse=False)] if n == 2 else
            [dict(a_dtype=torch.float32, out_is_a=True, out_dtype=torch.float32, writes_lse=True)] * (n - 2)
            + [dict(a_dtype=torch.float32, out_is_a=False, out_dtype=out_dtype, writes_lse=False)])
    assert fake.calls == want


@pytest.mark.parametrize("n", [2, 3])
def test_a_failing_fused_launch_falls_back_for_the_process(n):
    """A launch that raises (no C compiler for Triton, a build that cannot target this GPU) leaves
    the block as it was: the torch merge finishes it, and every later block, counted and logged."""
    fake = StandIn(fail=RuntimeError("failed to compile the Triton kernel"))
    L._fused = fake
    os_, ls = chunks(n, seed=20 + n)
    dst = torch.empty(2, 3, 7, 16, dtype=torch.bfloat16)
    m = L.KeyChunkMerge(dst, n, fused=fake)
    for o, lse in zip(os_, ls):
        m.add(o.clone(), lse.clone())
    assert torch.equal(dst, reference(os_, ls, torch.bfloat16))
    assert run_stats.value("kv_merge_fused_failed") == 1
    assert L.fused_module() is None                                       # off for the process


def test_a_sticky_cuda_error_in_the_fused_launch_propagates():
    fake = StandIn(fail=RuntimeError("CUDA error: an illegal memory access was encountered"))
    os_, ls = chunks(2)
    m = L.KeyChunkMerge(torch.empty(2, 3, 7, 16, dtype=torch.bfloat16), 2, fused=fake)
    m.add(os_[0], ls[0])
    with pytest.raises(RuntimeError, match="illegal memory access"):
        m.add(os_[1], ls[1])
    assert run_stats.value("kv_merge_fused_failed") == 0


def _triton_path() -> tuple[str | None, str]:
    """(PYTHONPATH entry for the child, or "" when triton imports here; None: not available) and why."""
    if importlib.util.find_spec("triton") is not None:
        return "", "triton importable in this venv"
    p = os.environ.get("SAFESAGE_TRITON_PATH", "")
    if p and os.path.isdir(os.path.join(p, "triton")):
        return p, f"triton from SAFESAGE_TRITON_PATH={p}"
    return None, ("triton is not importable here and SAFESAGE_TRITON_PATH is unset or has no triton "
                  "(.ci/run sets it up with .ci/setup_triton.sh)")


def test_fused_kernel_under_the_triton_interpreter():
    """tests/unit/lse_merge_interp.py in a child process: the pack loads without its Triton module;
    the kernel equals the torch merge to float32 rounding on random chunks (shapes, strides, 1-4
    chunks, -inf and large LSEs); test_attention.py's kv_chunks tests pass with it doing the merges;
    it compiles for sm_90 and sm_120."""
    path, why = _triton_path()
    if path is None:
        pytest.skip(why)
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = os.pathsep.join(x for x in (path, env.get("PYTHONPATH", "")) if x)
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "unit", "lse_merge_interp.py")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"{why}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"\n[test_lse_merge] {why}: {summary}")
    assert summary["fused_module_imported_at_load"] is False
    assert summary["fused_cases"] >= 100 and summary["kv_chunks_test_fused_launches"] > 0
    compiled = summary.get("compiled")
    if not compiled:
        print(f"[test_lse_merge] GPU compile not checked: {summary.get('compile')}")
    else:
        assert len(compiled) == 4


def test_bench_merge_section_fields(tmp_path):
    """bench/kernels/kvchunks_merge.py (python -m bench.kernels.gpu_kvchunks --only merge): the ratio names the issue
    asks for, and the earlier numbers read from the committed results under ``*_before`` names."""
    from bench.kernels.kvchunks_merge import before_numbers, ratios
    r = ratios({"plain": 100.0, "lse": 104.0, "kv_fused": 104.4, "kv_old": 105.2})
    assert r["kv_chunks_over_lse"] == pytest.approx(104.4 / 104) and r["kv_chunks_over_plain"] == pytest.approx(1.044)
    assert r["kv_chunks_over_lse_old_merge"] == pytest.approx(105.2 / 104)
    b = before_numbers(169000)
    assert b["kv_chunks_over_lse_before"] == pytest.approx(1.0104, abs=1e-4)     # 2240.2 / 2217.1 ms
    assert b["kv_chunks_over_plain_before"] == pytest.approx(1.0592, abs=1e-4)
    assert before_numbers(314437)["kv_chunks_over_plain_before"] == pytest.approx(1.0567, abs=1e-4)
    missing = before_numbers(169000, results_dir=str(tmp_path))
    assert missing["kv_chunks_over_lse_before"] is None
    assert "not read: FileNotFoundError" in missing["before_sources"]["kv_chunks_over_lse_before"]
