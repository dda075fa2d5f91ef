"""Timing and profiling helpers shared by the GPU benches (bench/gpu_*.py), what a bench JSON records
about its run (env_info), and the sm_120 dispatch emulation used by bench/length/compiler_probe.py and
bench/repro (its probe pack imports it inside a ComfyUI server, the repository on PYTHONPATH)."""
from __future__ import annotations

import platform
import time

import torch

from bench.common.cmdline import command


def time_ms(fns: dict, reps: int, warm: bool = True, queued_cycles: int = 0) -> dict:
    """Median milliseconds of each fn over ``reps`` rounds, the fns interleaved within a round;
    each called once first unless ``warm`` is False. CUDA events on a GPU (perf_counter without
    one). ``queued_cycles``: before each timed call the GPU is given that many cycles of work
    (``torch.cuda._sleep``), so the host-side setup of the call overlaps it as inside a model."""
    cuda = torch.cuda.is_available()
    if warm:
        for fn in fns.values():
            fn()
        if cuda:
            torch.cuda.synchronize()
    times: dict = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            if not cuda:
                t0 = time.perf_counter()
                o = fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
                del o
                continue
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if queued_cycles:
                torch.cuda._sleep(queued_cycles)
            a.record()
            o = fn()
            b.record()
            torch.cuda.synchronize()
            del o
            times[name].append(a.elapsed_time(b))
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def profile_table(fn, top: int = 14) -> tuple[float, list[dict]]:
    """(total CUDA kernel ms, the ``top`` kernels by time as {name, count, ms}) over one call of
    ``fn`` (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        o = fn()
        torch.cuda.synchronize()
    del o
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        if t:
            rows.append({"name": e.key[:120], "count": e.count, "ms": round(t / 1000.0, 3)})
    rows.sort(key=lambda r: -r["ms"])
    return round(sum(r["ms"] for r in rows), 3), rows[:top]


def emulate_sage_arch(arch: str) -> list:
    """sage 2.2.0's ``sageattn`` picks its kernels from ``core.get_cuda_arch_versions()``
    (core.py:143): answer ``arch`` (e.g. "sm120") there, so a sage call runs exactly what it runs
    on that GPU (for sm120: per_warp CUDA quantisers + sm89 FP8-PV kernels, fp32+fp16). Returns
    the real answer."""
    import sageattention.core as core
    n = torch.cuda.device_count()
    real = core.get_cuda_arch_versions()
    core.get_cuda_arch_versions = lambda: [arch] * n
    return real


def emulate_dispatch(arch: str):
    """:func:`emulate_sage_arch` where sage 2.x is installed; with sage 1.x (one Triton kernel on every arch)
    or none, the words saying why nothing was emulated. Returns what the JSON records as ``real_arch``."""
    try:
        return emulate_sage_arch(arch)                    # sage 2.2 dispatches as on that arch
    except (ImportError, AttributeError) as e:            # sage 1.x: one Triton kernel on every arch
        return f"not emulated ({type(e).__name__}: {e})"


def arch_capability(arch: str) -> tuple[int, int]:
    """The compute capability an arch name of the benches' ``--emulate-arch`` stands for: "sm120" -> (12, 0)."""
    return int(arch[2:-1]), int(arch[-1])


def emulated_runtime(arch: str, rtm=None, real=None):
    """SafeSage's runtime as it would read on ``arch`` (the compute capability and the sage family
    it dispatches to change; nothing else). ``rtm``: the safe_ops.facts.devices module to ask (default:
    ``import safe_ops.facts.devices``; inside a ComfyUI server, the one loaded with the pack); ``real``:
    its real runtime() if already read."""
    import dataclasses

    if rtm is None:
        import safe_ops.facts.devices as rtm
    cap = arch_capability(arch)
    real = real if real is not None else rtm.runtime()
    return dataclasses.replace(real, arch=cap, sage_family=rtm.sage_family_for(real.sage_version, cap),
                               sage_error=None if real.sage_version else real.sage_error)



def env_info(module: str) -> dict:
    """What a bench JSON records about its run: the command (``python3 -m bench.<module> ...``), torch,
    CUDA, Python, the GPU and its arch, the time, and the kernel packages' versions."""
    import importlib.metadata as md
    info = {"command": command(module),
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "arch": ("sm_%d%d" % torch.cuda.get_device_capability()) if torch.cuda.is_available() else None,
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for pkg in ("sageattention", "comfy-kitchen", "triton"):
        try:
            info[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            info[pkg] = None
    return info
