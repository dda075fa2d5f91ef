"""contain.py: which exceptions are SafeSage's (contained) and which are ComfyUI's (passed through)."""
from __future__ import annotations

import pytest

from safe_ops import contain


class ComfyInterrupt(Exception):
    """Stands in for comfy.model_management.InterruptProcessingException."""


def comfy_function(*args, **kwargs):
    # defined in tests/, i.e. in the same checkout as the pack but not in its safe_ops/ or nodes/:
    # as ComfyUI's own code (or a bench's stand-in of it) it is not SafeSage's
    raise ComfyInterrupt("interrupted")


def test_an_error_raised_by_comfys_function_is_not_ours():
    with pytest.raises(ComfyInterrupt) as info:
        contain.run_comfy(comfy_function, 1, 2)
    assert contain.not_ours(info.value)


def test_an_error_raised_in_safesages_own_code_called_by_comfy_is_ours():
    from safe_ops.models.h3 import mlp_plan

    def comfy_calls_safesage():
        return mlp_plan.parse_chunk_setting(True)       # raises ValueError inside safe_ops/

    with pytest.raises(ValueError) as info:
        contain.run_comfy(comfy_calls_safesage)
    assert not contain.not_ours(info.value)


def test_a_sticky_cuda_error_is_never_contained():
    assert contain.not_ours(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not contain.not_ours(RuntimeError("a bug in SafeSage"))
