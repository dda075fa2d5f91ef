"""SafeSage's sequence-parallel hook (safe_ops/multigpu) on two CPU ranks, and its pieces alone.

The two-rank test runs tests/unit/multigpu_rank.py as two processes over torch.distributed gloo:
yunchang's ``LongContextAttention`` -- the per-key-chunk ``select_flash_attn_impl(..., "fwd-only")``
and LSE merge xFuser's ring repeats (xFuser itself refuses a CPU: its long-context classes need
CUDA at import) -- with a fake sage kernel of 16-bit index arithmetic (fake_family.py), at Ulysses
(2,1) and ring (1,2), inside and outside the fake family's limits (planned inside them, or refused
where no plan fits), against full attention, and with a forced fault on rank 1. It needs yunchang: importable here, or installed where
SAFESAGE_YUNCHANG_PATH points (.ci/run sets it up with .ci/setup_yunchang.sh); else it skips, saying so.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import socket
import subprocess
import sys
import types

import pytest
import torch

from safe_ops.multigpu import rank_kernel, xfuser_hook
from safe_ops.multigpu.lse_reference import lse_error, sdpa_with_lse

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.join(ROOT, "tests", "unit")


def _yunchang_path() -> tuple[str | None, str]:
    if importlib.util.find_spec("yunchang") is not None:
        return "", "yunchang importable in this venv"
    p = os.environ.get("SAFESAGE_YUNCHANG_PATH", "")
    if p and os.path.isdir(os.path.join(p, "yunchang")):
        return p, f"yunchang from SAFESAGE_YUNCHANG_PATH={p}"
    return None, ("yunchang is not importable here and SAFESAGE_YUNCHANG_PATH is unset or has no yunchang "
                  "(.ci/run sets it up with .ci/setup_yunchang.sh)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    path, why = _yunchang_path()
    if path is None:
        print(f"\n[test_multigpu_ranks] skipped: {why}")
        pytest.skip(why)
    out = tmp_path_factory.mktemp("ranks")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (ROOT, HERE, path, env.get("PYTHONPATH", "")) if x)
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "multigpu_rank.py"), str(r), "2", port,
                               str(out / f"rank{r}.json")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:               # a hang is a failure, never a stuck suite
            for q in procs:
                q.kill()
            pytest.fail("a rank hung (no result in 300 s): " + "".join(q.communicate()[0][-2000:] for q in procs))
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{log[-4000:]}"
    print(f"\n[test_multigpu_ranks] {why}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)], logs


GUARDED = ("ulysses_in", "ulysses_out", "ring_in", "ring_out", "ulysses_no_plan", "ulysses_fault_raise",
           "ring_fault_nan")


def test_every_guarded_case_equals_full_attention_on_both_ranks(ranks):
    res, _ = ranks
    for r in range(2):
        for case in GUARDED:
            c = res[r][case]
            assert c["raised"] is None, (r, case, c)
            assert c["rel_err"] < 1e-5, (r, case, c)


def test_inside_the_limits_the_kernel_runs_and_is_checked_once(ranks):
    res, _ = ranks
    for r in range(2):
        for case, calls in (("ulysses_in", 1), ("ring_in", 2)):       # ring: one call per key chunk
            c = res[r][case]
            assert c["launches"] == calls and c["stats"]["kernel"] == calls, (r, case, c)
            assert c["stats"]["checked"] == 1 and c["stats"]["refused"] == 0 and not c["fallbacks"]


def test_outside_the_limits_both_ranks_run_the_same_plan_inside_them(ranks):
    """The one-GPU planner's plan for the rank's own geometry: q/k copied in head groups whose strides
    fit the 16-bit products (the fake kernel asserts every launch is inside), on both ranks alike."""
    res, _ = ranks
    for case, calls, rank_heads in (("ulysses_out", 1, 4), ("ring_out", 2, 8)):
        for r in range(2):
            c = res[r][case]
            st = c["stats"]
            assert st["outside_envelope"] == st["planned"] == st["kernel"] == calls, (r, case, c)
            assert st["refused"] == 0 and not c["fallbacks"] and st["checked"] == 1, (r, case, c)
            assert c["launches"] > calls, (r, case, c)                      # split launches
            assert all(shape[2] < rank_heads for _, shape in c["launch_shapes"]), c["launch_shapes"]
        assert res[0][case]["stats"] == res[1][case]["stats"]
        assert res[0][case]["launch_shapes"] == res[1][case]["launch_shapes"]


def test_a_call_no_plan_fits_falls_back_on_both_ranks_alike(ranks):
    """float64: a dtype rule no data movement fixes. No rank launches; both count and word it alike."""
    res, _ = ranks
    for r in range(2):
        c = res[r]["ulysses_no_plan"]
        assert c["launches"] == 0 and c["stats"]["refused"] == c["stats"]["outside_envelope"] == 1, (r, c)
        (reason, n), = c["fallbacks"].items()
        assert n == 1 and "no plan of its kernel fits" in reason and "dtype" in reason
    assert res[0]["ulysses_no_plan"]["stats"] == res[1]["ulysses_no_plan"]["stats"]
    assert res[0]["ulysses_no_plan"]["fallbacks"] == res[1]["ulysses_no_plan"]["fallbacks"]


def test_the_same_shapes_unguarded_launch_outside_the_envelope(ranks):
    """The control: without the hook, the out-of-limits cases reach the fake kernel outside its
    envelope (its assertion is the CPU stand-in of sage's illegal memory access)."""
    res, _ = ranks
    for r in range(2):
        for case in ("ulysses_out_unguarded", "ring_out_unguarded"):
            assert "launched outside its envelope" in (res[r][case]["raised"] or ""), (r, case, res[r][case])


def test_a_fault_on_one_rank_is_refused_on_both(ranks):
    """Rank 1's kernel raises (Ulysses) / returns NaN (ring) at its first call; rank 0's is fine.
    Both ranks refuse the class (one agreement at the first call), count and word it alike, and
    nothing raises or hangs."""
    res, logs = ranks
    for case, calls in (("ulysses_fault_raise", 1), ("ring_fault_nan", 2)):
        for r in range(2):
            c = res[r][case]
            assert c["launches"] == 1, (r, case, c)        # the first call only; the class is refused
            assert c["stats"]["kernel"] == 0 and c["stats"]["failed_checks"] == 1, (r, case, c)
            assert c["stats"]["refused"] == calls, (r, case, c)
            (reason, _), = c["fallbacks"].items()
            assert "refused on every rank" in reason
        assert res[0][case]["stats"] == res[1][case]["stats"]
        assert res[0][case]["fallbacks"] == res[1][case]["fallbacks"]
    assert "forced kernel fault" in logs[1] and "forced kernel fault" not in logs[0]


# ----------------------------------------------------------------------- the pieces, one process
def _fake_sage(q, k, v, tensor_layout="HND", return_lse=False, **kw):
    return sdpa_with_lse(q, k, v, q.shape[-1] ** -0.5)


_fake_sage.__name__ = "sageattn_qk_int8_pv_fp16_cuda"


def test_install_wraps_every_loaded_module_that_imported_the_selection(monkeypatch):
    calls = []

    def select_flash_attn_impl(impl_type, stage="fwd-bwd", attn_processor=None):
        calls.append((impl_type, stage))
        return functools.partial(_fake_sage, tensor_layout="NHD", return_lse=True) if impl_type == "sage" else len

    kernels = types.ModuleType("yunchang.kernels")
    kernels.select_flash_attn_impl = select_flash_attn_impl
    ring = types.ModuleType("xfuser.core.long_ctx_attention.ring.ring_flash_attn")
    ring.select_flash_attn_impl = select_flash_attn_impl       # `from yunchang.kernels import ...`
    other = types.ModuleType("someone_else")
    other.select_flash_attn_impl = select_flash_attn_impl
    for m in (kernels, ring, other):
        monkeypatch.setitem(sys.modules, m.__name__, m)
    monkeypatch.setitem(sys.modules, "yunchang", types.ModuleType("yunchang"))
    try:
        assert xfuser_hook.install() and xfuser_hook.install()          # idempotent
        assert kernels.select_flash_attn_impl is ring.select_flash_attn_impl is not select_flash_attn_impl
        assert other.select_flash_attn_impl is select_flash_attn_impl   # not yunchang's or xFuser's
        g = ring.select_flash_attn_impl("sage", stage="fwd-only")
        assert isinstance(g, rank_kernel.GuardedRankKernel)
        assert ring.select_flash_attn_impl("sage", stage="fwd-only") is g   # one guard per function
        assert ring.select_flash_attn_impl("fa", stage="fwd-only") is len    # not sage: untouched
        assert ring.select_flash_attn_impl("sage", stage="fwd-bwd").func is _fake_sage
    finally:
        xfuser_hook.uninstall()
    assert kernels.select_flash_attn_impl is ring.select_flash_attn_impl is select_flash_attn_impl


def test_family_names_follow_the_selected_sage_function():
    def p(name, **kw):
        f = lambda *a, **k: None  # noqa: E731
        f.__name__ = name
        return functools.partial(f, tensor_layout="NHD", return_lse=True, **kw)
    assert xfuser_hook.family_name(p("sageattn_qk_int8_pv_fp16_cuda")) == (True, "sage2_sm80")
    assert xfuser_hook.family_name(p("sageattn_qk_int8_pv_fp8_cuda_sm90")) == (True, "sage2_sm90")
    assert xfuser_hook.family_name(p("sageattn_qk_int8_pv_fp8_cuda", qk_quant_gran="per_warp")) == \
        (True, "sage2_fp8pv_perwarp")
    assert xfuser_hook.family_name(p("sageattn")) == (True, None)
    assert xfuser_hook.family_name(p("flash_attn_forward"))[0] is False
    assert xfuser_hook.family_name(len)[0] is False


def test_an_error_of_safesages_own_is_contained_on_the_rank():
    """A family lookup that raises: counted as SafeSage's internal error, the call runs PyTorch's
    attention with its LSE, nothing raises (a rank that raised would stall the others)."""
    def broken(device):
        raise KeyError("boom")
    g = rank_kernel.GuardedRankKernel(_fake_sage, broken)
    rank_kernel.SECTION.reset()
    q, k, v = (torch.randn(1, 40, 2, 16) for _ in range(3))
    out, lse = g(q, k, v, softmax_scale=None)
    ref, ref_lse = sdpa_with_lse(q, k, v, 0.25)
    assert torch.allclose(out, ref) and torch.allclose(lse, ref_lse)
    assert rank_kernel.SECTION.get("internal_errors") == 1


def test_lse_error_sees_a_wrong_lse():
    q, k, v = (torch.randn(1, 300, 4, 16) for _ in range(3))
    _, lse = sdpa_with_lse(q, k, v, 0.25)
    assert lse_error(lse, q, k, 0.25) < 1e-4
    assert lse_error(lse + 0.5, q, k, 0.25) == pytest.approx(0.5, abs=1e-3)
    assert lse_error(torch.full_like(lse, float("nan")), q, k, 0.25) == float("inf")


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_a_rank_plan_gives_the_whole_calls_output_and_lse(layout):
    """Head groups x query chunks, q/k copied into either layout: each launch's output and LSE land
    where the whole call's would (GQA: 4 query heads on 2 key heads)."""
    from safe_ops.attention.planner import Plan
    from safe_ops.multigpu.rank_plan import run_rank_plan
    seen = []

    def fn(q, k, v, *args, tensor_layout="NHD", **kw):
        seen.append((tensor_layout, tuple(q.shape), q.is_contiguous()))
        to_nhd = (lambda t: t.transpose(1, 2)) if tensor_layout == "HND" else (lambda t: t)
        o, lse = sdpa_with_lse(to_nhd(q), to_nhd(k), to_nhd(v), 0.25)
        return (o.transpose(1, 2) if tensor_layout == "HND" else o), lse

    q = torch.randn(1, 300, 4, 16)
    k, v = (torch.randn(1, 300, 2, 16) for _ in range(2))
    plan = Plan("head_groups", "x", layout, repack=("q", "k"), head_group=2, q_chunk=128, launches=6)
    out, lse = run_rank_plan(plan, fn, q, k, v, (), {"softmax_scale": None})
    ref, ref_lse = sdpa_with_lse(q, k, v, 0.25)
    assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(lse, ref_lse, atol=1e-5)
    assert len(seen) == 6 and all(t == layout and c for t, _, c in seen)


def test_the_multigpu_modules_import_no_yunchang_xfuser_ray_or_comfyui():
    """Imported alone, safe_ops/multigpu pulls in none of the packages it guards or is sent by."""
    code = ("import sys; import safe_ops.multigpu.rank_kernel, safe_ops.multigpu.rank_plan, "
            "safe_ops.multigpu.xfuser_hook, safe_ops.multigpu.raylight, safe_ops.multigpu.worker; "
            "print([m for m in ('yunchang', 'xfuser', 'ray', 'comfy', 'comfy_api') if m in sys.modules])")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == "[]"
