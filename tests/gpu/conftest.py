import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    try:
        import sageattention  # noqa: F401
        has_sage = True
    except Exception:
        has_sage = False
    reason = None
    if not has_cuda:
        reason = "GPU test: no CUDA device here (CI has none); results are committed under bench/results/"
    elif not has_sage:
        reason = "GPU test: sageattention is not installed"
    if reason:
        # This hook sees every collected test of the session: mark only the ones in this folder.
        here = os.path.dirname(os.path.abspath(__file__)) + os.sep
        for item in items:
            if str(item.fspath).startswith(here):
                item.add_marker(pytest.mark.skip(reason=reason))
