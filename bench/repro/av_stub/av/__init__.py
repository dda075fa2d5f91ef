"""A stand-in for PyAV, for a ComfyUI server on a machine without it (the GPU box: PyAV's wheel is
~40 MB, too large to carry). ComfyUI's node API (comfy_api.latest) imports av and a few of its names
at start-up; the reproduction's graph never decodes or encodes video or audio. Every name, in every
av.* module, is a placeholder class: importing, annotating and subclassing work, calling raises.

bench/repro/worker.py puts this folder first on the server's PYTHONPATH only when the server's Python
cannot import the real av, and records that in the row (``av_stub``)."""
import importlib.abc
import importlib.machinery
import sys
import types

MESSAGE = "PyAV is not installed: this ComfyUI server runs with bench/repro/av_stub (no video/audio I/O)"


class _Placeholder(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing

    def __call__(cls, *a, **k):
        raise RuntimeError(MESSAGE)


class _Missing(metaclass=_Placeholder):
    pass


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.startswith("av."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
__path__ = []
sys.modules[__name__].__class__ = _StubModule
STUB = True
