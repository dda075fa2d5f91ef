"""Import-time shim for the CI/test venv only (installed by .ci/setup_env.sh as a .pth hook).

Why: PyPI has torchvision/torchaudio only as CUDA builds. Next to the CPU torch 2.13 wheel the
test venv uses, torchvision 0.28's `_C.so` and torchaudio 2.11's `_torchaudio.so` do not load.
torchvision then dies at import (`operator torchvision::nms does not exist`, raised by its
`register_fake("torchvision::nms")` / `("torchvision::qnms")`, the only two registrations not
guarded by `_has_ops()`), and ComfyUI imports torchvision in comfy/sd.py; torchaudio raises
OSError at import, and ComfyUI's audio/H3 node modules import it.

What: without editing any installed file, this hook
  * before `torchvision` is imported: tries to load torchvision's own `_C` library; only if that
    fails, defines the schemas of `torchvision::nms` and `torchvision::qnms` (no kernels: calling
    them still fails loudly; nothing ComfyUI's core sampling path uses needs them);
  * after `torchaudio._extension.utils` is executed: wraps its `_load_lib` so an OSError from the
    native library means "extension not available" (torchaudio's pure-PyTorch functions such as
    `functional.resample` keep working) instead of a failed import.
Each substitution prints one line to stderr, so a log shows that it happened.
Set SAFESAGE_NO_TORCH_SHIM=1 to disable.
"""

import importlib.abc
import os
import sys

_LIBS = []  # keep torch.library.Library objects alive (they deregister when collected)


def _note(msg):
    try:
        sys.stderr.write("[safesage ci torch shim] %s\n" % msg)
    except Exception:
        pass


def _op_exists(torch, name):
    try:
        getattr(torch.ops.torchvision, name)
        return True
    except (AttributeError, RuntimeError):
        return False


def _prepare_torchvision(search_locations):
    import glob

    import torch

    if _op_exists(torch, "nms"):
        return
    for d in search_locations or []:
        for lib in glob.glob(os.path.join(d, "_C*.so")):
            try:
                torch.ops.load_library(lib)
                return  # the real extension works; nothing to do
            except (OSError, ImportError, RuntimeError) as exc:
                reason = "%s: %s" % (type(exc).__name__, str(exc).splitlines()[0][:160])
                break
        else:
            continue
        break
    else:
        reason = "no _C library found"
    lib = torch.library.Library("torchvision", "FRAGMENT")
    defined = []
    for name in ("nms", "qnms"):
        if not _op_exists(torch, name):
            lib.define("%s(Tensor dets, Tensor scores, float iou_threshold) -> Tensor" % name)
            defined.append(name)
    _LIBS.append(lib)
    _note("torchvision C ops unavailable (%s); defined kernel-less schemas torchvision::%s"
          % (reason, ", ".join(defined)))


def _patch_torchaudio_utils(module):
    orig = module._load_lib

    def _load_lib(lib):
        try:
            return orig(lib)
        except OSError as exc:
            _note("torchaudio native library %r unavailable (%s); torchaudio continues without it"
                  % (lib, str(exc).splitlines()[0][:160]))
            return False

    module._load_lib = _load_lib


class _PostExecLoader(importlib.abc.Loader):
    def __init__(self, loader, after):
        self._loader = loader
        self._after = after

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._after(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _SafeSageShimFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in ("torchvision", "torchaudio._extension.utils"):
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None:
            return None
        try:
            if name == "torchvision":
                _prepare_torchvision(spec.submodule_search_locations)
            else:
                spec.loader = _PostExecLoader(spec.loader, _patch_torchaudio_utils)
        except Exception as exc:  # never break the import itself
            _note("shim error for %s: %r" % (name, exc))
        return spec


if os.environ.get("SAFESAGE_NO_TORCH_SHIM") != "1" and not any(
    type(f).__name__ == "_SafeSageShimFinder" for f in sys.meta_path
):
    sys.meta_path.insert(0, _SafeSageShimFinder())
