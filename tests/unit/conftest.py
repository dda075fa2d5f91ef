import importlib
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def bench_tables():
    """bench/common/tables.py (python -m bench.common.tables)."""
    from bench.common import tables
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


# ---------------------------------------------------------------- the quality guard's fake families
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def fq():
    """The fake families registered as a server started with SAFESAGE_EXTRA_FAMILIES has them
    (the registry reads the variable when first imported: reloaded here, and back after)."""
    from safe_ops.families import envelope, registry
    sys.path.insert(0, HERE)
    old = os.environ.get(registry.EXTRA_FAMILIES_VARIABLE)
    os.environ[registry.EXTRA_FAMILIES_VARIABLE] = "fake_quality_families"
    importlib.reload(registry)
    import fake_quality_families
    assert fake_quality_families.SAGE in registry.families()
    yield fake_quality_families
    if old is None:
        os.environ.pop(registry.EXTRA_FAMILIES_VARIABLE, None)
    else:
        os.environ[registry.EXTRA_FAMILIES_VARIABLE] = old
    importlib.reload(registry)
    for name in (fake_quality_families.SAGE, fake_quality_families.KITCHEN):
        envelope.FAMILIES.pop(name, None)
    sys.path.remove(HERE)


@pytest.fixture
def fresh(fq):
    from safe_ops.facts import compiler
    from safe_ops.ui import run_stats
    run_stats.reset()
    compiler.new_run()
    for k in fq.LAUNCHES:
        fq.LAUNCHES[k] = 0
    yield fq
    compiler.new_run()
