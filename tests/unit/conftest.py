import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


import importlib.util  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def bench_tables():
    """bench/tables.py as a module (bench/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("bench_tables", os.path.join(ROOT, "bench", "tables.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
