"""What is here: GPU arch, torch/CUDA, sageattention and the kernel family it dispatches to.

Detected once per process (``runtime()`` is cached) and cheap to read on the hot
path. Nothing here imports ComfyUI at module import time; ComfyUI facts are
read lazily and only if ComfyUI is already loaded.
"""
from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import sys
from dataclasses import dataclass, field

import torch

_TABLE_PATH = os.path.join(os.path.dirname(__file__), "kernel_table.json")


@dataclass(frozen=True)
class Runtime:
    torch_version: str
    cuda_version: str | None
    device_name: str | None
    arch: tuple[int, int] | None           # compute capability, None without CUDA
    sage_version: str | None                # installed sageattention distribution
    sage_family: str | None                 # envelope family sageattn dispatches to here
    sage_error: str | None                  # why sage is unusable, if it is
    allocator_backend: str | None           # "native" | "cudaMallocAsync"
    dynamic_vram: bool | None               # ComfyUI dynamic VRAM (comfy-aimdo) active
    comfy_version: str | None
    hook_points: dict = field(default_factory=dict)

    @property
    def arch_name(self) -> str:
        return f"sm_{self.arch[0]}{self.arch[1]}" if self.arch else "cpu"

    def summary(self) -> str:
        sage = (f"sageattention {self.sage_version} -> {self.sage_family}" if self.sage_family
                else f"sageattention unavailable ({self.sage_error})")
        dev = f"{self.device_name} ({self.arch_name})" if self.arch else "no CUDA device"
        dyn = {True: "on", False: "off", None: "unknown"}[self.dynamic_vram]
        return (f"{dev}; torch {self.torch_version} CUDA {self.cuda_version}; {sage}; "
                f"allocator {self.allocator_backend}; dynamic VRAM {dyn}; ComfyUI {self.comfy_version}")


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def sage_family_for(version: str | None, arch: tuple[int, int] | None) -> str | None:
    """Which envelope family ``sageattn`` of ``version`` runs on ``arch``."""
    if version is None or arch is None:
        return None
    major = version.split(".")[0]
    if major == "1":
        return "sage1_triton" if arch >= (8, 0) else None   # int8 tl.dot needs sm80+
    try:
        from .envelope_sage2 import family_for
    except ImportError:
        return None
    return family_for(version, arch)


def _comfy_facts() -> tuple[bool | None, str | None, dict]:
    """Read ComfyUI facts only if ComfyUI is already imported (never import it here)."""
    dyn = None
    version = None
    hooks: dict = {}
    memm = sys.modules.get("comfy.memory_management")   # 0dd9b154+: aimdo_enabled flag
    if memm is not None and hasattr(memm, "aimdo_enabled"):
        dyn = bool(memm.aimdo_enabled)
    elif "comfy.model_management" in sys.modules:
        dyn = False                                       # ComfyUI without dynamic VRAM
    ver = sys.modules.get("comfyui_version")
    if ver is not None:
        version = getattr(ver, "__version__", None)
    ops = sys.modules.get("comfy.ops")
    hooks["linear_input_act"] = bool(ops is not None and hasattr(ops, "linear_input_act"))
    hooks["model_prefetch"] = "comfy.model_prefetch" in sys.modules
    att = sys.modules.get("comfy.ldm.modules.attention")
    hooks["optimized_attention_override"] = bool(att is not None and hasattr(att, "wrap_attn"))
    return dyn, version, hooks


@functools.lru_cache(maxsize=1)
def runtime() -> Runtime:
    arch = name = None
    backend = None
    if torch.cuda.is_available():
        idx = torch.cuda.current_device()
        arch = tuple(torch.cuda.get_device_capability(idx))
        name = torch.cuda.get_device_name(idx)
        try:
            backend = torch.cuda.memory.get_allocator_backend()
        except Exception:
            backend = None
    sage_version = _dist_version("sageattention")
    sage_error = None
    family = None
    if sage_version is None:
        sage_error = "package not installed"
    elif arch is None:
        sage_error = "no CUDA device"
    else:
        try:
            import sageattention  # noqa: F401
            family = sage_family_for(sage_version, arch)
            if family is None:
                sage_error = f"no known kernel family for sageattention {sage_version} on sm_{arch[0]}{arch[1]}"
        except Exception as e:  # broken wheel, CUDA mismatch
            sage_error = f"import failed: {type(e).__name__}: {e}"
    dyn, cver, hooks = _comfy_facts()
    return Runtime(torch.__version__, torch.version.cuda, name, arch, sage_version, family,
                   sage_error, backend, dyn, cver, hooks)


@functools.lru_cache(maxsize=1)
def kernel_table() -> dict:
    """Measured throughput per (arch, kernel family); see docs/BENCHMARKS.md."""
    try:
        with open(_TABLE_PATH) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def measured_order(arch_name: str, families: list[str]) -> list[str] | None:
    """Families sorted fastest first by the measured table, or None if this arch is unmeasured."""
    entry = kernel_table().get("archs", {}).get(arch_name)
    if not entry:
        return None
    tflops = entry.get("tflops", {})
    known = [f for f in families if f in tflops]
    if not known:
        return None
    known.sort(key=lambda f: -tflops[f])
    return known + [f for f in families if f not in tflops]
