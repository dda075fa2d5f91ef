"""Verdicts and kill switches hold for one GPU arch and one kernel build (Runtime.kernel_site).

Two GPUs of different arch in one process share a SafeSage node's verdict store (its guard for the
other GPU, SafeAttention._guard_for) and the process-wide list of switched-off families: a pass on
one must not skip the check on the other, a failure on one must not leave the other returning
unchecked output, and a build that cannot run on one must not switch the family off on the other.
The same for two builds of the kernel on one arch. CPU: stand-in runtimes (as in
test_attention_devices.py) and a stand-in kernel per GPU; calls run on CPU tensors, which each
guard runs itself.
"""
import dataclasses

import pytest
import torch

from safe_ops.attention import override as attention
from safe_ops.ui import run_stats
from safe_ops.attention.override import SafeAttention
from safe_ops.families.family import Kernel
from safe_ops.policy import Policy
from safe_ops.attention.verification import Verifier
from safe_ops.facts.devices import Runtime
from safe_ops.ui.status import process_lines

from test_attention import ComfyFunc, EnvelopeAssertingKernel, corrupt_tail, reference, toy_envelope

FAM = "toy_sage"
RT_A = Runtime("test", "13.0", "GPU A", (8, 9), "2.2.0", FAM, None, "native", None, None,
               sage_file="/site-a/sageattention/_qattn_sm89.so")
OTHER = {"arch": dataclasses.replace(RT_A, device_name="GPU B", arch=(9, 0)),        # same build, other arch
         "build": dataclasses.replace(RT_A, sage_file="/site-b/sageattention/_qattn_sm89.so")}  # same arch


class GpuKernel(EnvelopeAssertingKernel):
    """The family's kernel as it behaves on one GPU / build: "ok", "wrong" (its tail rows zeroed:
    only the first-call check sees it) or "refuse" (a build with no kernel for this GPU)."""

    def __init__(self, behaviour):
        super().__init__(toy_envelope(FAM, small_ints=False), corrupt_tail if behaviour == "wrong" else None)
        self.behaviour = behaviour

    def __call__(self, q, k, v, layout, scale):
        if self.behaviour == "refuse":
            raise RuntimeError("CUDA error: no kernel image is available for execution on the device")
        return super().__call__(q, k, v, layout, scale)


@pytest.fixture(autouse=True)
def _fresh():
    run_stats.reset()
    yield
    run_stats.reset()


def two_sites(monkeypatch, kind, a, b, verify="first"):
    """(guard of site A, guard of site B, {site: its GpuKernel}). ``kind`` "arch": one SafeSage node
    and its guard for a second GPU of another arch (runtime / installed_kernels stood in); "build":
    two SafeSage nodes on one arch with two builds of the kernel, sharing one verdict store."""
    rt_b = OTHER[kind]
    kerns = {"A": GpuKernel(a), "B": GpuKernel(b)}
    if kind == "arch":
        monkeypatch.setattr(attention, "runtime", lambda device=None: rt_b if device is not None else RT_A)
        monkeypatch.setattr(attention, "installed_kernels", lambda rt: [
            Kernel(kerns["A" if rt is RT_A else "B"].env, kerns["A" if rt is RT_A else "B"], 0.05)])
        ga = SafeAttention(Policy(kernel="sage", verify=verify))
        gb = ga._guard_for(torch.device("cuda", 1))
        assert gb is not ga and gb.rt is rt_b and gb.verifier is ga.verifier
    else:
        ver = Verifier(verify)
        ga, gb = (SafeAttention(Policy(kernel="sage", verify=verify), kernels=[Kernel(kerns[s].env, kerns[s], 0.05)],
                                verifier=ver, rt=rt) for s, rt in (("A", RT_A), ("B", rt_b)))
    return ga, gb, kerns


def qkv(S=128, seed=0, nan=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 4, S, 16, generator=g) for _ in range(3))
    return (q.fill_(float("nan")) if nan else q), k, v


def call(guard, q, k, v):
    return guard(ComfyFunc(), q, k, v, 4, skip_reshape=True, skip_output_reshape=True)


def assert_correct(out, q, k, v):
    torch.testing.assert_close(out.double(), reference(q, k, v), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["arch", "build"])
def test_verdicts_per_arch_a_pass_on_one_does_not_skip_the_check_on_the_other(monkeypatch, kind):
    """The kernel is right on A and wrong on B: B's first call of the class is checked (not covered
    by A's pass), caught, and recomputed."""
    ga, gb, kerns = two_sites(monkeypatch, kind, "ok", "wrong")
    q, k, v = qkv()
    assert_correct(call(ga, q, k, v), q, k, v)
    assert run_stats.value("probes") == 1 and run_stats.value("probe_failures") == 0
    out = call(gb, q, k, v)
    assert len(kerns["B"].launches) == 1, "B ran the family"
    assert run_stats.value("probes") == 2 and run_stats.value("probe_failures") == 1, "B's call was checked on its own"
    assert_correct(out, q, k, v)


@pytest.mark.parametrize("kind", ["arch", "build"])
def test_verdicts_per_arch_a_failure_on_one_does_not_switch_the_family_off_on_the_other(monkeypatch, kind):
    """The kernel is wrong on A and right on B: B still runs the family, after its own check."""
    ga, gb, kerns = two_sites(monkeypatch, kind, "wrong", "ok")
    q, k, v = qkv()
    assert_correct(call(ga, q, k, v), q, k, v)
    assert run_stats.value("probe_failures") == 1
    assert_correct(call(gb, q, k, v), q, k, v)
    assert len(kerns["B"].launches) == 1 and run_stats.value("probes") == 2 and run_stats.value("probe_failures") == 1


@pytest.mark.parametrize("kind", ["arch", "build"])
def test_verdicts_per_arch_a_failure_on_one_never_lets_the_other_return_unchecked_output(monkeypatch, kind):
    """B planned the family for a class whose first call could not be checked (NaN inputs:
    inconclusive, checked again next time); then A's check of the same class fails. B's next call
    must still be checked -- not read A's failed verdict as "already checked" and return B's
    output unchecked (A's fallback clears only A's cached plans)."""
    ga, gb, kerns = two_sites(monkeypatch, kind, "wrong", "wrong")
    call(gb, *qkv(nan=True))
    assert run_stats.value("probes") == 1 and not gb.verifier.verdicts(), "inconclusive: nothing recorded"
    q, k, v = qkv()
    assert_correct(call(ga, q, k, v), q, k, v)
    assert run_stats.value("probe_failures") == 1
    out = call(gb, q, k, v)
    assert_correct(out, q, k, v)
    assert run_stats.value("probe_failures") == 2, "B's output was checked and failed on its own"


@pytest.mark.parametrize("kind", ["arch", "build"])
def test_verdicts_per_arch_a_build_error_on_one_does_not_disable_the_other(monkeypatch, kind):
    """A's build has no kernel for A's GPU: the family is off on A for the process (every later
    call there goes to ComfyUI's own attention without trying it), on B it runs. What the node shows
    says where it is off."""
    ga, gb, kerns = two_sites(monkeypatch, kind, "refuse", "ok", verify="off")
    q, k, v = qkv()
    assert_correct(call(ga, q, k, v), q, k, v)
    assert run_stats.value("kernel_errors") == 1 and FAM in ga.broken
    assert_correct(call(gb, q, k, v), q, k, v)
    assert len(kerns["B"].launches) == 1 and not gb.broken, "the family still runs on B"
    call(ga, *qkv(S=64))
    assert run_stats.value("kernel_errors") == 1 and run_stats.value("plan:sdpa") == 1, "not tried again on A"
    site_a = RT_A.kernel_site(FAM)
    assert list(run_stats.snapshot()["disabled_families"]) == [f"{FAM} on {site_a}"]
    line, = process_lines(run_stats.snapshot())
    assert line.startswith(f"WARNING: {FAM} on sm_89 (sageattention 2.2.0, /site-a/sageattention/_qattn_sm89.so) "
                           "is off for this ComfyUI process") and "no kernel image" in line
    # a SafeSage node applied later in the process knows it too, for A only
    later_a = SafeAttention(Policy(kernel="sage"), kernels=[Kernel(kerns["A"].env, kerns["A"], 0.05)], rt=RT_A)
    later_b = SafeAttention(Policy(kernel="sage"), kernels=[Kernel(kerns["B"].env, kerns["B"], 0.05)], rt=OTHER[kind])
    assert FAM in later_a.broken and not later_b.broken


def test_verdicts_per_layout_an_hnd_pass_does_not_cover_an_nhd_call(monkeypatch):
    """The caller's layout is part of a call's class: a kernel right when handed HND tensors and
    wrong when handed NHD ones passes the check of an HND call; the first NHD call of the same
    shape is checked on its own, caught and recomputed."""
    real = GpuKernel("ok")

    def wrong_in_nhd(q, k, v, layout, scale):
        out = real(q, k, v, layout, scale)
        return corrupt_tail(out.transpose(1, 2)).transpose(1, 2) if layout == "NHD" else out

    att = SafeAttention(Policy(kernel="sage", verify="first"), kernels=[Kernel(real.env, wrong_in_nhd, 0.05)],
                        rt=RT_A)
    q, k, v = qkv()
    assert_correct(call(att, q, k, v), q, k, v)                           # HND caller
    assert run_stats.value("probes") == 1 and run_stats.value("probe_failures") == 0
    qn, kn, vn = (t.transpose(1, 2).flatten(2) for t in (q, k, v))          # the same call, NHD caller
    out = att(ComfyFunc(), qn, kn, vn, 4)
    assert [lay for _, lay in real.launches] == ["HND", "NHD"], "the NHD call ran the family in NHD"
    assert run_stats.value("probes") == 2 and run_stats.value("probe_failures") == 1
    torch.testing.assert_close(out.double(), reference(q, k, v).transpose(1, 2).flatten(2), rtol=1e-4, atol=1e-4)


def test_the_kernel_build_is_the_file_of_its_loaded_extension(monkeypatch):
    """Runtime's sage_file / ck_file: the loaded package's compiled extension (the build that
    runs), else the package's own file (sage 1.x is Triton only); None when it is not imported."""
    import sys
    import types

    from safe_ops.facts.devices import loaded_build_file
    pkg = types.ModuleType("toy_kernels")
    pkg.__file__ = "/site/toy_kernels/__init__.py"
    monkeypatch.setitem(sys.modules, "toy_kernels", pkg)
    assert loaded_build_file("toy_kernels") == "/site/toy_kernels/__init__.py"
    ext = types.ModuleType("toy_kernels._qattn")
    ext.__file__ = "/site/toy_kernels/_qattn.cpython-312-x86_64-linux-gnu.so"
    monkeypatch.setitem(sys.modules, "toy_kernels._qattn", ext)
    assert loaded_build_file("toy_kernels") == ext.__file__
    assert loaded_build_file("toy_kernels_not_imported") is None
    rt = dataclasses.replace(RT_A, ck_version="0.2.40", ck_file=ext.__file__)
    assert rt.kernel_site("ck_int8") == f"sm_89 (comfy-kitchen 0.2.40, {ext.__file__})"
    assert rt.kernel_site(FAM) == "sm_89 (sageattention 2.2.0, /site-a/sageattention/_qattn_sm89.so)"
