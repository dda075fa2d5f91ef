"""What is here: GPU arch, torch/CUDA, sageattention and the kernel family it dispatches to
(``sage_dispatch.sage_family_for``), comfy-kitchen and its family.

Detected once per device (``runtime(device)`` is cached) and cheap to read on the hot
path. Nothing here imports ComfyUI at module import time; ComfyUI facts are
read lazily and only if ComfyUI is already loaded.
"""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import sys
from dataclasses import dataclass

import torch

from ..families.sage_dispatch import sage_family_for


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
    ck_version: str | None = None           # installed comfy-kitchen distribution
    ck_family: str | None = None            # envelope family of its int8_attention here
    ck_error: str | None = None             # why comfy-kitchen attention is unusable, if it is
    sage_file: str | None = None            # the loaded sageattention build (its extension's file)
    ck_file: str | None = None              # the loaded comfy-kitchen build (its extension's file)

    @property
    def arch_name(self) -> str:
        return f"sm_{self.arch[0]}{self.arch[1]}" if self.arch else "cpu"

    def kernel_build(self, family: str) -> str:
        """The build that runs ``family`` here: package version and the file it was loaded from."""
        from ..families.registry import family_kind    # the families know their kind (no import circle)
        kind = family_kind(family)
        if kind == "sdpa":
            return f"torch {self.torch_version}"
        if kind not in ("sage", "ck"):
            return f"{family} (a family of its own module)"
        name, version, path = (("sageattention", self.sage_version, self.sage_file) if kind == "sage"
                               else ("comfy-kitchen", self.ck_version, self.ck_file))
        return f"{name} {version or 'unknown'}" + (f", {path}" if path else "")

    def kernel_site(self, family: str) -> str:
        """Where a verdict or a kill switch about ``family`` holds: this GPU arch with this build of
        the kernel (another arch, or another build, is checked and switched off on its own)."""
        return f"{self.arch_name} ({self.kernel_build(family)})"

    def summary(self) -> str:
        sage = (f"sageattention {self.sage_version} -> {self.sage_family}" if self.sage_family
                else f"sageattention unavailable ({self.sage_error})")
        dev = f"{self.device_name} ({self.arch_name})" if self.arch else "no CUDA device"
        dyn = {True: "on", False: "off", None: "unknown"}[self.dynamic_vram]
        ck = (f"comfy-kitchen {self.ck_version} -> {self.ck_family}" if self.ck_family
              else f"comfy-kitchen attention unavailable ({self.ck_error})")
        return (f"{dev}; torch {self.torch_version} CUDA {self.cuda_version}; {sage}; {ck}; "
                f"allocator {self.allocator_backend}; dynamic VRAM {dyn}; ComfyUI {self.comfy_version}")


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _comfy_facts() -> tuple[bool | None, str | None]:
    """Read ComfyUI facts only if ComfyUI is already imported (never import it here)."""
    dyn = None
    version = None
    memm = sys.modules.get("comfy.memory_management")   # 0dd9b154+: aimdo_enabled flag
    if memm is not None and hasattr(memm, "aimdo_enabled"):
        dyn = bool(memm.aimdo_enabled)
    elif "comfy.model_management" in sys.modules:
        dyn = False                                       # ComfyUI without dynamic VRAM
    ver = sys.modules.get("comfyui_version")
    if ver is not None:
        version = getattr(ver, "__version__", None)
    return dyn, version


def runtime(device: torch.device | int | None = None) -> Runtime:
    """The facts of one CUDA device (default: the current one), read once per device: a
    process with two different GPUs has two runtimes, each with the kernels of its own arch."""
    if not torch.cuda.is_available():
        return _runtime(None)
    if isinstance(device, int):
        return _runtime(device)
    if device is not None and device.type == "cuda" and device.index is not None:
        return _runtime(device.index)
    return _runtime(torch.cuda.current_device())


@functools.lru_cache(maxsize=16)
def _runtime(idx: int | None) -> Runtime:
    arch = name = None
    backend = None
    if idx is not None:
        arch = tuple(torch.cuda.get_device_capability(idx))
        name = torch.cuda.get_device_name(idx)
        try:
            backend = torch.cuda.memory.get_allocator_backend()
        except Exception:
            backend = None
    sage_version = _dist_version("sageattention")
    sage_error = None
    family = sage_file = None
    if sage_version is None:
        sage_error = "package not installed"
    elif arch is None:
        sage_error = "no CUDA device"
    else:
        try:
            import sageattention  # noqa: F401
            sage_file = loaded_build_file("sageattention")
            family = sage_family_for(sage_version, arch)
            if family is None:
                sage_error = f"no known kernel family for sageattention {sage_version} on sm_{arch[0]}{arch[1]}"
        except Exception as e:  # broken wheel, CUDA mismatch
            sage_error = f"import failed: {type(e).__name__}: {e}"
    dyn, cver = _comfy_facts()
    ck_version, ck_family, ck_error = _ck_facts(arch)
    ck_file = loaded_build_file("comfy_kitchen") if ck_family else None
    return Runtime(torch.__version__, torch.version.cuda, name, arch, sage_version, family,
                   sage_error, backend, dyn, cver, ck_version, ck_family, ck_error, sage_file, ck_file)


def loaded_build_file(package: str) -> str | None:
    """The file of an already imported ``package``'s compiled extension (the build that runs; e.g.
    sage 2.2's ``_fused`` / ``_qattn_sm*`` .so), else the package's own file (sage 1.x is Triton);
    None when it is not imported. Imports nothing; read once per runtime."""
    mod = sys.modules.get(package)
    if mod is None:
        return None
    prefix = package + "."
    for name, sub in list(sys.modules.items()):
        f = getattr(sub, "__file__", None) if name.startswith(prefix) else None
        if f and f.endswith((".so", ".pyd")):
            return f
    return getattr(mod, "__file__", None)


def _ck_facts(arch: tuple[int, int] | None) -> tuple[str | None, str | None, str | None]:
    """comfy-kitchen's version, the envelope family of its int8_attention, or why not usable."""
    version = _dist_version("comfy-kitchen")
    from ..families.ck_int8 import ck_family_for
    if version is None:
        # importable without package metadata (a bare PYTHONPATH copy): version unknown,
        # so the conservative (0.2.29-0.2.35) envelope
        if "comfy_kitchen" not in sys.modules and importlib.util.find_spec("comfy_kitchen") is None:
            return None, None, "package not installed"
        family = "ck_int8_pre236"
        version = "unknown"
    else:
        family = ck_family_for(version)
    if family is None:
        return version, None, f"comfy-kitchen {version} has no int8_attention (needs >= 0.2.29)"
    if arch is None:
        return version, None, "no CUDA device"
    try:
        import comfy_kitchen
        if not hasattr(comfy_kitchen, "int8_attention"):
            return version, None, "comfy_kitchen.int8_attention missing"
        ok = getattr(comfy_kitchen, "int8_attention_is_available", lambda *a: True)()
        if not ok:
            return version, None, "int8_attention not available on this GPU/build"
    except Exception as e:  # broken wheel, CUDA mismatch
        return version, None, f"import failed: {type(e).__name__}: {e}"
    return version, family, None


