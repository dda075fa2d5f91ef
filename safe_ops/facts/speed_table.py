"""How fast each kernel family runs attention on a GPU arch, with where the number comes from.

The quality guard's speed budget (``quality`` on the node) prices each family's plan for a call with
these numbers (attention/speed_budget.py): within the budget the least-error family runs. One table,
two sources, every row saying which:

* ``measured``: kernel_table.json (this repository's benches; today the H200's sm_90 row). Its
  quantised kernels' numbers speak for every GPU of the arch (on the H100 ``sage1_triton`` ran 456
  TFLOP/s where the H200 measured 455: bench/results/attention_comfy_sdpa_h100.json); its SDPA number
  only for the GPU model it was measured on (the H100's SDPA ran 347-366 where the H200's ran 550).
* ``published``: upstream figures for GPUs the device cannot time (RTX cards), in speed_table.json beside
  this file, each with its card, package version and source.

A family with no row has no known cost on that arch: it is never counted as within a speed budget.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass

from .kernel_table import arch_tflops, kernel_table

_PATH = os.path.join(os.path.dirname(__file__), "speed_table.json")

#: ``quality`` -> the most predicted attention time a block may spend for less error, as a multiple of
#: the time of the family the kernel policy plans (the fastest it knows). ``balanced``: 5 %, the margin
#: within which the published sm_120 numbers put comfy-kitchen's int8_attention (536 TFLOP/s) beside
#: sage's fp8 PV (560): about 4.5 % of attention time, under 1 % of an H3 step at 38k tokens by the
#: study the issue cites ("sage saving about one percent of the sampler"). ``strict``: 50 %, accuracy
#: first short of giving up the quantised kernels' speed (SDPA runs at 1/2.7 of sage there).
#: ``faults only``: no budget: the planned family runs.
SPEED_BUDGETS = {"faults only": 1.0, "balanced": 1.05, "strict": 1.5}


@dataclass(frozen=True)
class Speed:
    family: str
    tflops: float
    kind: str                   # "measured" (kernel_table.json) or "published" (speed_table.json)
    gpu: str                    # the card the number comes from
    version: str
    source: str

    def provenance(self) -> str:
        return f"{self.family} {self.tflops:g} TFLOP/s, {self.kind} on {self.gpu} ({self.version}; {self.source})"


@functools.lru_cache(maxsize=1)
def _published() -> tuple:
    try:
        with open(_PATH) as f:
            return tuple(json.load(f).get("published", []))
    except (OSError, ValueError):
        return ()


def speeds(arch_name: str, gpu_name: str | None, aliases: dict | None = None) -> dict[str, Speed]:
    """Every family with a known speed on ``arch_name`` (``gpu_name``: the GPU here, which decides
    whether a measured SDPA number applies; ``aliases``: families measured under another's entry,
    registry.table_aliases). Measured rows win over published ones."""
    out: dict[str, Speed] = {}
    for row in _published():
        if row.get("arch") == arch_name:
            out[row["family"]] = Speed(row["family"], float(row["tflops"]), "published", row.get("gpu", "?"),
                                       row.get("version", "?"), row.get("source", "?"))
    entry = kernel_table().get("archs", {}).get(arch_name) or {}
    gpu = entry.get("gpu") or "?"
    for fam, tf in arch_tflops(arch_name, aliases or {}).items():
        if tf is None or (fam == "sdpa" and gpu not in ("?", gpu_name)):
            continue                   # SDPA's speed does not carry to another GPU model of the arch
        out[fam] = Speed(fam, float(tf), "measured", gpu, "kernel_table.json",
                         "safe_ops/facts/kernel_table.json (" + str(entry.get("source", "")).split(":")[0] + ")")
    return out


def speed_budget(quality: str) -> float:
    """The quality setting's speed budget (:data:`SPEED_BUDGETS`); 1.0 for an unknown setting."""
    return SPEED_BUDGETS.get(quality, 1.0)
