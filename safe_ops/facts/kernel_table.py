"""The measured kernel table: TFLOP/s per (GPU arch, kernel family), ``kernel_table.json`` beside this file.

Written by the GPU benches (``bench/common/tables.py --update-table``, ``bench/kernels/gpu_kvchunks.py --update-table``;
only families whose output matched SDPA); read by ``auto`` (attention.kernel_choice) and by the
registry's choice of the other sage-2 families to offer, through families.registry.measured_tflops
(which knows the families measured under another family's entry).

Two readings of one entry. *Verified on this arch* (the registry: which families may be offered)
holds for every GPU of the arch. *Speed* (``auto``'s order, the plans' pricing) holds only on the
GPU model the entry was measured on (:func:`measured_on`): on an H100 ComfyUI's own attention ran
at 347-366 TFLOP/s where the H200's entry says 550 (bench/results/attention_comfy_sdpa_h100.json),
so an H100 ordered by the H200's numbers ran SDPA, 16 % slower a step than the sage it was
started with (bench/results/e2e_38k_50b_sage106_auto_sm90_h100.json).
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


def measured_on(arch_name: str, gpu_name: str | None) -> bool:
    """Whether ``arch_name``'s entry speaks for the speed of ``gpu_name``: the GPU model it was
    measured on (its ``gpu``, e.g. "NVIDIA H200"), or any GPU of the arch for an entry that names
    none. False for an unknown GPU name where the entry names one."""
    entry = kernel_table().get("archs", {}).get(arch_name)
    if not entry:
        return False
    measured = entry.get("gpu")
    return measured is None or measured == gpu_name
