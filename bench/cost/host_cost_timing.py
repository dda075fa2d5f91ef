"""The host-time measurement that bench/cost/host_cost.py's sections share: the clock and its budget, host
blocks of calls with arms alternated, and the ratios (the e2e runs use its clock, ``interleave`` and
``stats``).

Host time (``guarded``, ``passthrough``, ``legacy_hop``): CPU wall time per call (``time.perf_counter_ns``)
over a block of ``--calls`` calls with no synchronize inside the block, the device synchronized before each
block (outside the timing), so the calls only queue their launches (a block's few hundred launches stay
under the launch queue's depth: the host never waits on the device inside a block). The arms alternate
block by block (A B A B ...); per arm the median over the blocks; the ratio is the ratio of the medians and
its spread the range of the per-round ratios. Beside each arm the device time of one block with the launches
queued behind ``torch.cuda._sleep`` (``gpu_us_per_call``): where it is below the host time the GPU was not
the bottleneck. Each host measurement runs rounds for ``--host-s`` seconds (at least ``--min-reps``; less
time, down to ``--host-min-s``, where the run is behind: ``HostBudget``).
"""
from __future__ import annotations

import statistics
import time

import torch

#: seconds kept for what follows the e2e rounds, besides --host-s per host measurement (the kernels'
#: GPU times at --gpu-tokens, imports, the JSON)
RESERVE_S = 6.0
#: the JSON's ``method.host_time``
HOST_TIME_METHOD = ("CPU wall time per call over blocks of calls with no synchronize inside "
                    "a block, the device synchronized between blocks (outside the timing); "
                    "arms alternate block by block; medians; ratio of medians, spread = range "
                    "of the per-round ratios; gpu_us_per_call: the device's time per call "
                    "with the launches queued behind torch.cuda._sleep")


class Timeline:
    """Seconds since the process's start, printed and kept."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.marks: list = []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def mark(self, what: str) -> None:
        t = round(self.now(), 1)
        self.marks.append([t, what])
        print(f"[host_cost +{t:6.1f}s] {what}", flush=True)


class HostBudget:
    """Seconds of rounds for each host measurement left: ``--host-s``, less where the run is behind
    (a fresh machine's JIT in the e2e warm-up) so the measurements left still end within ``--budget-s``,
    never under ``--host-min-s``; at least ``--min-reps`` rounds whatever the clock says."""

    def __init__(self, a, tl: Timeline, measurements: int):
        self.a, self.tl, self.left = a, tl, max(measurements, 1)

    def deadline(self, part: float = 1.0) -> float:
        """The ``time.perf_counter()`` this measurement's rounds stop at (``part`` of its share)."""
        a = self.a
        fair = (a.budget_s - RESERVE_S - self.tl.now()) / self.left
        secs = max(min(a.host_s, fair), a.host_min_s) if a.host_s > 0 else 0.0
        self.left = max(self.left - 1, 1) if part >= 1.0 else self.left
        return time.perf_counter() + secs * part


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def host_block_us(fn, calls: int, dev: torch.device) -> float:
    """Host microseconds per call over ``calls`` calls, no synchronize inside (see the module docstring)."""
    sync(dev)
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - t0) / calls / 1e3


def gpu_us_per_call(fn, calls: int, host_us: float, dev: torch.device) -> float | None:
    """Device microseconds per call: the block's launches queued behind a ``torch.cuda._sleep`` long
    enough to cover their host time, so the events between them time the device's work alone."""
    if dev.type != "cuda":
        return None
    sync(dev)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(3e3 * calls * max(host_us, 1.0)))       # ~2 GHz cycles: about 1.5x the host time
    a.record()
    for _ in range(calls):
        fn()
    b.record()
    torch.cuda.synchronize(dev)
    return round(a.elapsed_time(b) * 1e3 / calls, 2)


def interleave(arms: dict, min_reps: int, max_reps: int, deadline: float, clock=time.perf_counter) -> dict:
    """A B A B ...: each round calls every arm once, in order; each returns one measurement. Stops after
    ``max_reps`` rounds, or once ``min_reps`` are done and ``clock()`` has passed ``deadline``."""
    out: dict = {k: [] for k in arms}
    for rep in range(max_reps):
        for name, fn in arms.items():
            out[name].append(fn())
        if rep + 1 >= min_reps and clock() > deadline:
            break
    return out


def stats(xs: list) -> dict:
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3),
            "n": len(xs)}


def ratio_of(num: list, den: list) -> dict:
    """The ratio of the medians, and the range of the per-round ratios (rounds paired by index)."""
    per = [n / d for n, d in zip(num, den) if d]
    return {"ratio": round(statistics.median(num) / statistics.median(den), 4),
            "per_round": [round(min(per), 4), round(max(per), 4)] if per else None, "rounds": len(per)}


def host_arms(arms: dict, calls: int, dev, min_reps: int, max_reps: int, deadline: float,
              device_time: bool = True) -> dict:
    """``interleave`` over host blocks of each arm (each arm warmed first) until ``deadline``
    (``time.perf_counter()``); per arm its per-call us stats, the rounds, and (``device_time``) its
    device us per call."""
    for fn in arms.values():
        for _ in range(min(calls, 20)):
            fn()
    sync(dev)
    rounds = interleave({k: (lambda f=f: host_block_us(f, calls, dev)) for k, f in arms.items()},
                        min_reps, max_reps, deadline)
    sync(dev)
    out = {}
    for k, f in arms.items():
        med = statistics.median(rounds[k])
        out[k] = {"host_us": stats(rounds[k]), "rounds_us": [round(x, 2) for x in rounds[k]],
                  "gpu_us_per_call": gpu_us_per_call(f, calls, med, dev) if device_time else None}
    return out

