"""H3's V layout as this ComfyUI hands it to attention, read by running ComfyUI's own Attention.

Needs a ComfyUI tree with MiniMax H3 (COMFYUI_PATH; `bash .ci/run` runs this in its 0dd9b154 and
783545f6 passes, where every H3 test must run). The expectation is read independently from the
tree's source: 783545f6's peak-memory fix copies V (``v = v.clone()``), 0dd9b154 hands a view.
"""
import os
import sys

import pytest

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
MODEL = os.path.join(COMFYUI_PATH or "", "comfy", "ldm", "minimax", "model.py")
if not COMFYUI_PATH or not os.path.isfile(MODEL):
    _reason = "COMFYUI_PATH has no MiniMax H3 (comfy/ldm/minimax/model.py): needs 0dd9b154 or later"
    print(f"\n[test_h3_comfy] skipped: {_reason}")
    pytest.skip(_reason, allow_module_level=True)
if COMFYUI_PATH not in sys.path:
    sys.path.insert(0, COMFYUI_PATH)
import comfy.cli_args  # noqa: E402

comfy.cli_args.args.cpu = True
import comfy.ldm.minimax.model  # noqa: E402,F401

from safe_ops.models.h3.dims import (H3_HEAD_DIM, H3_HEADS, attention_call_here, comfy_v_layout, h3_attention_call,
                                     v_layout_here)
from safe_ops.ui.preflight_text import call_line  # noqa: E402


def _source_copies_v() -> bool:
    src = open(MODEL).read()
    cls = src[src.index("class Attention"):src.index("class MLP")]
    return "v = v.clone()" in cls


def test_v_layout_is_this_trees():
    want = "contiguous" if _source_copies_v() else "strided"
    assert comfy_v_layout() == want
    layout, where = v_layout_here()
    assert layout == want and "this ComfyUI" in where
    line = call_line(169_000)
    assert ("own token-major copy" in line) == (want == "contiguous"), line
    v = attention_call_here(1000).v
    assert v.stride[2] == (H3_HEADS * H3_HEAD_DIM if want == "contiguous" else 3 * H3_HEADS * H3_HEAD_DIM)
    assert h3_attention_call(1000, v_layout=want).v == v
