"""Free device memory -> the bytes a plan may use. One reader for attention, MLP and Preflight.

Host queries only (no stream or device synchronisation). ComfyUI's own ``get_free_memory`` is
used when ComfyUI is loaded (it adds what PyTorch's caching allocator holds unused and sees what
dynamic VRAM frees or takes); without ComfyUI the same sum comes from torch.
"""
from __future__ import annotations

import math
import sys
import threading
import time

import torch

# Fraction of currently free device memory an attention plan's peak may use: its own copies and
# merge state *and* the kernel's temporaries of one launch (Plan.peak_bytes) -- everything the
# call allocates beyond its inputs and result, so most of what is free, with a margin.
FREE_MEMORY_FRACTION = 0.8
BUDGET_STEP = 2 ** 0.25      # budget buckets (~19% apart): a plan is re-chosen when free memory moves
BUDGET_POLL_S = 0.05         # free memory is re-read at most this often
#: the attention plan ladder's hysteresis (:func:`plan_on_ladder`): a degraded plan is chosen again
#: for more memory only once the budget is this many times the largest budget any plan of the
#: signature was chosen under (one octave: 4 BUDGET_STEP buckets)
REPLAN_GROWTH = 2.0

#: the MLP never plans a chunk's intermediates below this, even with little free memory
MLP_BUDGET_FLOOR_BYTES = 256 * 1024 ** 2
#: the MLP never uses more than this fraction of the free device memory for a chunk
MLP_FREE_FRACTION = 0.25


def free_device_bytes(device) -> int | None:
    """Free memory on ``device`` as ComfyUI accounts it (``model_management.get_free_memory``:
    the device's free memory plus what PyTorch's caching allocator holds unused) when ComfyUI is
    loaded, else the same sum from torch; None off CUDA or when unreadable. Host queries only:
    no stream or device synchronisation."""
    if getattr(device, "type", "cpu") != "cuda":
        return None
    mm = sys.modules.get("comfy.model_management")
    fn = getattr(mm, "get_free_memory", None) if mm is not None else None
    try:
        if fn is not None:
            return int(fn(device))
        idle = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(torch.cuda.mem_get_info(device)[0]) + max(idle, 0)
    except Exception:
        return None


def budget_bucket(nbytes: int) -> int:
    """``nbytes`` rounded down to a power of BUDGET_STEP (0 for nothing free)."""
    if nbytes <= 0:
        return 0
    quarters = math.floor(4 * math.log2(nbytes) + 1e-9)        # BUDGET_STEP = 2 ** (1/4)
    while True:
        b = int(2 ** (quarters // 4) * 2 ** ((quarters % 4) / 4))
        if b <= nbytes:
            return b
        quarters -= 1


def plan_budget_bytes(free: int | None) -> int | None:
    """What an attention plan may use out of ``free`` bytes: FREE_MEMORY_FRACTION of it, bucketed."""
    return None if free is None else budget_bucket(int(free * FREE_MEMORY_FRACTION))


def degraded(plan) -> bool:
    """A plan more memory could make better: SDPA reached because the memory budget ruled the
    guarded kernel out (planner.choose's reason names the "memory budget"), or a plan of more
    than one launch (head groups, query or key chunks). One launch of the kernel needs nothing
    more; an SDPA plan for other reasons (a rule that no plan can fix) neither."""
    if plan.kind == "sdpa":
        return any("memory budget" in r for r in plan.reasons)
    return plan.launches > 1


def plan_on_ladder(ladder: dict, budget: int):
    """The plan a call signature runs under ``budget`` without planning again, or None when
    ``planner.choose`` must run (a re-plan: 16-140 ms).

    ``ladder``: budget -> the plan ``choose`` made under it, for every ``choose`` of the
    signature (its first plan included). The rule:

    1. a budget some plan was chosen under: that plan;
    2. else the plan chosen under the largest budget whose plan fits now (``peak_bytes <=
       budget``). Where that budget is at least the budget now, it is what ``choose`` would make
       now (``choose`` takes the best plan that fits; a smaller budget only removes plans), so
       nothing is lost. Where it is below -- memory grew past every budget planned under -- it
       is kept (hysteresis: free memory moving across buckets costs nothing), unless it is
       :func:`degraded` and the budget is at least REPLAN_GROWTH times the largest budget on
       the ladder: then None (planned again once for that much memory);
    3. no plan on the ladder fits (memory really shrank): None.

    Moving between plans already on the ladder costs nothing; only ``choose`` is a re-plan."""
    plan = ladder.get(budget)
    if plan is not None:
        return plan
    best_b, best, top = -1, None, -1
    for b, q in list(ladder.items()):       # a snapshot: another thread may add a rung
        if b > top:
            top = b
        if b > best_b and q.peak_bytes <= budget:
            best_b, best = b, q
    if best is None:
        return None
    if best_b < budget and degraded(best) and budget >= REPLAN_GROWTH * top:
        return None
    return best


class BudgetReader:
    """An attention plan's budget on a device *now*, re-read at most every BUDGET_POLL_S seconds.

    Free device memory (:func:`free_device_bytes`) times FREE_MEMORY_FRACTION, rounded down to a
    BUDGET_STEP bucket so that plans are re-chosen only when it really moves. None off CUDA
    (no limit). :meth:`free` is the same throttled reading, unbucketed (the MLP's chunk budget)."""

    def __init__(self):
        self._cache: dict = {}        # device -> (time read, free bytes, budget)
        self._lock = threading.Lock()  # held while _cache changes

    def _read(self, device) -> tuple:
        now = time.monotonic()
        hit = self._cache.get(device)
        if hit is not None and now - hit[0] < BUDGET_POLL_S:
            return hit
        free = free_device_bytes(device)
        entry = (now, free, plan_budget_bytes(free))
        with self._lock:
            self._cache[device] = entry
        return entry

    def __call__(self, device: torch.device) -> int | None:
        hit = self._cache.get(device)       # only CUDA devices are ever read: a hit is one
        if hit is not None and time.monotonic() - hit[0] < BUDGET_POLL_S:
            return hit[2]
        if device.type != "cuda":
            return None
        return self._read(device)[2]

    def free(self, device) -> int | None:
        """:func:`free_device_bytes` of ``device``, re-read at most every BUDGET_POLL_S seconds."""
        return self._read(device)[1]

    def clear(self) -> None:
        """Forget every reading (the next call reads again)."""
        with self._lock:
            self._cache.clear()


#: the MLP's reader, shared by every patched MLP of the process: ComfyUI's ``get_free_memory``
#: (``torch.cuda.memory_stats``, >= 100 us on a GPU) runs at most every BUDGET_POLL_S seconds,
#: not once per MLP call
MLP_READER = BudgetReader()


def mlp_budget_bytes(device, cap_bytes: int, read_free=None) -> int:
    """Bytes one MLP chunk's intermediates may use: ``cap_bytes``, less when free memory is short
    (MLP_FREE_FRACTION of it), never below MLP_BUDGET_FLOOR_BYTES. Free memory comes from
    ``read_free(device)``: by default :data:`MLP_READER` (throttled); :func:`free_device_bytes`
    itself where nothing cached may be touched (a traced call)."""
    budget = cap_bytes
    free = (MLP_READER.free if read_free is None else read_free)(device)
    if free is not None:
        budget = min(budget, int(free * MLP_FREE_FRACTION))
    return max(budget, MLP_BUDGET_FLOOR_BYTES)
