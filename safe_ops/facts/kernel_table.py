"""The measured kernel table: TFLOP/s per (GPU arch, kernel family), ``kernel_table.json`` beside this file.

Written by the GPU benches (``bench/tables.py --update-table``, ``bench/gpu_kvchunks.py --update-table``;
only families whose output matched SDPA); read by ``auto`` (attention.kernel_choice) and by the
registry's choice of the other sage-2 families to offer (families.registry.installed_kernels).
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


def measured_tflops(arch_name: str) -> dict:
    """Measured TFLOP/s per family on ``arch_name`` (aliases filled in); {} when unmeasured."""
    # Families that run the same kernel and differ only in their (version-dependent) envelope share
    # one measured number (each family's KernelFamily.table_name: comfy-kitchen 0.2.29-0.2.35 and
    # 0.2.36-0.2.40 time the same int8_attention)
    from ..families.registry import table_aliases
    tflops = dict(kernel_table().get("archs", {}).get(arch_name, {}).get("tflops", {}))
    for alias, name in table_aliases().items():
        if alias in tflops or name in tflops:
            tflops.setdefault(name, tflops.get(alias))
            tflops.setdefault(alias, tflops[name])
    return tflops


def measured_order(arch_name: str, families: list[str]) -> list[str] | None:
    """Families sorted fastest first by the measured table, or None if this arch is unmeasured."""
    tflops = measured_tflops(arch_name)
    if not tflops:
        return None
    known = [f for f in families if f in tflops]
    if not known:
        return None
    known.sort(key=lambda f: -tflops[f])
    return known + [f for f in families if f not in tflops]
