"""A GPU and its kernel packages as SafeSage reads them, on a machine without either (unit tests).

* :func:`install_packages`: stand-in ``sageattention`` (every function a shipped family calls, sage 1's
  ``sageattn`` and sage 2.2's ``sageattn_qk_int8_*``) and ``comfy_kitchen`` (``int8_attention``) in
  ``sys.modules``, so ``registry.installed_kernels`` builds the kernels a real install would; nothing runs.
* :func:`runtime`: the ``Runtime`` of a GPU (arch, name) with a sageattention and a comfy-kitchen version,
  the families their dispatchers pick there (sage_dispatch / ck_int8, the pack's own tables).
* :func:`comfy_flags`: ComfyUI started with ``--use-sage-attention`` ("sage"), ``--use-ck-attention``
  ("ck") or neither (None), as ``kernel_choice.comfy_attention_choice`` reads it.
"""
from __future__ import annotations

import sys
import types

RTX4090, RTX5090 = ((8, 9), "NVIDIA GeForce RTX 4090"), ((12, 0), "NVIDIA GeForce RTX 5090")
RTX3090, A100 = ((8, 6), "NVIDIA GeForce RTX 3090"), ((8, 0), "NVIDIA A100-SXM4-80GB")
H100, H200 = ((9, 0), "NVIDIA H100 80GB HBM3"), ((9, 0), "NVIDIA H200")     # H200: kernel_table.json's sm_90 GPU


def install_packages(monkeypatch) -> None:
    from safe_ops.families import registry
    sage = types.ModuleType("sageattention")
    for f in registry.families().values():
        if f.function.startswith("sageattention."):
            setattr(sage, f.function.split(".", 1)[1], lambda *a, **k: None)
    kitchen = types.ModuleType("comfy_kitchen")
    kitchen.int8_attention = lambda *a, **k: None
    monkeypatch.setitem(sys.modules, "sageattention", sage)
    monkeypatch.setitem(sys.modules, "comfy_kitchen", kitchen)


def runtime(gpu, sage: str | None = "2.2.0", ck: str | None = "0.2.40"):
    from safe_ops.facts.devices import Runtime
    from safe_ops.families.ck_int8 import ck_family_for
    from safe_ops.families.sage_dispatch import sage_family_for
    arch, name = gpu
    fam = sage_family_for(sage, arch) if sage else None
    ck_fam = ck_family_for(ck) if ck and arch else None
    return Runtime("2.11", "13.0" if arch else None, name, arch, sage, fam,
                   None if fam else ("package not installed" if not sage else f"no sage family for {arch}"),
                   "native", None, None, ck_version=ck, ck_family=ck_fam,
                   ck_error=None if ck_fam else "package not installed")


def comfy_flags(monkeypatch, choice: str | None) -> None:
    mm = types.ModuleType("comfy.model_management")
    mm.sage_attention_enabled = lambda: choice == "sage"
    cli = types.ModuleType("comfy.cli_args")
    cli.args = types.SimpleNamespace(use_ck_attention=choice == "ck")
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    monkeypatch.setitem(sys.modules, "comfy.cli_args", cli)
