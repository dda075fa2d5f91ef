"""The measured kernel table: TFLOP/s per (GPU arch, kernel family), ``kernel_table.json`` beside this file.

Written by the GPU benches (``bench/tables.py --update-table``, ``bench/gpu_kvchunks.py --update-table``;
only families whose output matched SDPA); read by ``auto`` (attention.kernel_choice) and by the
registry's choice of the other sage-2 families to offer, through families.registry.measured_tflops
(which knows the families measured under another family's entry).
"""
from __future__ import annotations

import functools
import json
import os


_TABLE_PATH = os.path.join(os.path.dirname(__file__), "kernel_table.json")


@functools.lru_cache(maxsize=1)
def kernel_table() -> dict:
    """Measured throughput per (arch, kernel family); see docs/BENCHMARKS.md."""
    try:
        with open(_TABLE_PATH) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def arch_tflops(arch_name: str, aliases: dict[str, str]) -> dict:
    """Measured TFLOP/s per family on ``arch_name``, ``aliases`` (family -> the entry it is measured
    under) filled in both ways; {} when unmeasured."""
    tflops = dict(kernel_table().get("archs", {}).get(arch_name, {}).get("tflops", {}))
    for alias, name in aliases.items():
        if alias in tflops or name in tflops:
            tflops.setdefault(name, tflops.get(alias))
            tflops.setdefault(alias, tflops[name])
    return tflops


