"""Memory evidence of one row, from the two sides of the server.

NvmlPeak runs in the worker (outside the ComfyUI server): device-wide used memory, polled from
before the server starts until it ends, so ``nvml_peak_process_gib`` is what the server added
(weights included, which aimdo allocates itself). memory_at_oom runs inside the server (the
probe pack's sampling wrapper, bench/repro/probe_pack) at the moment an allocation fails, before
ComfyUI's own OOM handling unloads the models. No torch import here: both get what they read.
"""
from __future__ import annotations

import os
import threading
import time

GIB = 2 ** 30


class NvmlPeak:
    """Device-wide used memory, polled every 20 ms until stop()."""

    def __init__(self):
        self.ok = False
        try:
            import pynvml
            pynvml.nvmlInit()
            idx = int((os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0])
            self.h = pynvml.nvmlDeviceGetHandleByIndex(idx)
            self.nv = pynvml
            self.start_used = self.peak = pynvml.nvmlDeviceGetMemoryInfo(self.h).used
            self.total = pynvml.nvmlDeviceGetMemoryInfo(self.h).total
            self.ok = True
        except Exception as e:  # noqa: BLE001 - no NVML (CPU smoke run)
            self.err = repr(e)
            return
        self._stop = False
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        while not self._stop:
            try:
                self.peak = max(self.peak, self.nv.nvmlDeviceGetMemoryInfo(self.h).used)
            except Exception:  # noqa: BLE001
                pass
            time.sleep(0.02)

    def stop(self):
        if self.ok:
            self._stop = True
            self.t.join(1)

    def info(self) -> dict:
        if not self.ok:
            return {"nvml": self.err}
        return {"nvml_used_at_start_gib": round(self.start_used / GIB, 2),
                "nvml_peak_used_gib": round(self.peak / GIB, 2),
                "nvml_peak_process_gib": round((self.peak - self.start_used) / GIB, 2),
                "nvml_total_gib": round(self.total / GIB, 2)}


def torch_peaks(torch) -> dict:
    """Peak allocated / reserved since the last reset_peak_memory_stats (PyTorch's allocator)."""
    st = torch.cuda.memory_stats()
    return {"torch_peak_allocated_gib": round(st.get("allocated_bytes.all.peak", 0) / GIB, 2),
            "torch_peak_reserved_gib": round(st.get("reserved_bytes.all.peak", 0) / GIB, 2)}


def memory_at_oom(torch, model, nv=None) -> dict:
    """Who holds the device when an allocation fails: PyTorch's live tensors, the blocks its allocator
    keeps cached (reserved - allocated; with cudaMallocAsync, the pool's reserved memory), aimdo's
    resident weights (``model.loaded_size()``), and what CUDA itself says is free. ``nv``: an
    NvmlPeak whose info() is added (the worker adds its own when this runs in the server)."""
    ev = {}
    try:
        st = torch.cuda.memory_stats()
        free, total = torch.cuda.mem_get_info()
        ev.update(torch_allocated_gib=round(st.get("allocated_bytes.all.current", 0) / GIB, 2),
                  torch_reserved_gib=round(st.get("reserved_bytes.all.current", 0) / GIB, 2),
                  torch_peak_allocated_gib=round(st.get("allocated_bytes.all.peak", 0) / GIB, 2),
                  torch_peak_reserved_gib=round(st.get("reserved_bytes.all.peak", 0) / GIB, 2),
                  cuda_free_mib=free >> 20, cuda_total_gib=round(total / GIB, 2))
    except Exception as e:  # noqa: BLE001 - evidence only, the OOM is re-raised
        ev["torch_error"] = repr(e)
    try:
        ev["weights_resident_mib"] = int(model.loaded_size()) >> 20
    except Exception as e:  # noqa: BLE001
        ev["weights_error"] = repr(e)
    if nv is not None:
        ev.update(nv.info())
    return ev
