import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def bench_tables():
    """bench/tables.py (python -m bench.tables)."""
    from bench import tables
    return tables


@pytest.fixture(autouse=True)
def _fresh_mlp_budget_reader():
    """budget.MLP_READER keeps a free-memory reading for BUDGET_POLL_S seconds, process-wide: a
    test's stand-in reading must not reach the next test."""
    from safe_ops.facts import budget
    budget.MLP_READER.clear()
    yield
    budget.MLP_READER.clear()


@pytest.fixture(autouse=True)
def _a_forward_per_test():
    """ComfyUI's allocation compiler is asked once per forward per thread (compiler.enabled_now):
    each test begins as a new forward, so a stand-in comfy.model_prefetch of one test is asked."""
    from safe_ops.facts import compiler
    compiler.forward_started()
    yield
    compiler.forward_started()
