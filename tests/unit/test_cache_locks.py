"""The caches outside the stats store change only under their lock, and the compiler's run id is
per thread (issue 26 point 8).

SafeAttention's per-signature caches (``_prepared``, ``_comfy_fns``, a signature's per-run plans
and its plan ladder), mlp.py's per-run chunk sizes and budget.BudgetReader's readings are trimmed
or written from the sampling thread while another thread may do the same: each is swapped for a container that
records whether its lock (a counting stand-in) was held at every change -- a change without it
fails here whatever the GIL does. The run id: thread A's sampling run ending must not end thread
B's run (B keeps its plans and chunk sizes), and two threads' runs never share an id.
"""
import contextlib
import sys
import threading
import types

import pytest
import torch

from safe_ops.facts import budget, compiler
from safe_ops.models.h3 import mlp
from safe_ops.ui import run_stats as report
from safe_ops.attention.override import SafeAttention
from safe_ops.families.family import Kernel
from safe_ops.policy import Policy

from lockcheck import CountingLock, Ledger, guard
from test_attention import CPU_RT, EnvelopeAssertingKernel, h3_like, make_attn, toy_envelope


@pytest.fixture(autouse=True)
def _clean():
    report.reset()
    yield
    report.reset()


@pytest.fixture
def prefetch(monkeypatch):
    """ComfyUI's allocation compiler on (a stand-in comfy.model_prefetch)."""
    mod = types.ModuleType("comfy.model_prefetch")
    mod.malloc_graph_enabled = lambda device: True
    mod.pause_malloc_graph = contextlib.nullcontext
    monkeypatch.setitem(sys.modules, "comfy.model_prefetch", mod)
    return mod


def _in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_attention_caches_change_under_their_lock(monkeypatch):
    monkeypatch.setattr(report, "MAX_KEYS", 2)
    env = toy_envelope()
    att = SafeAttention(Policy(kernel="auto", verify="off"), kernels=[Kernel(env, EnvelopeAssertingKernel(env), 0.05)],
                        rt=CPU_RT)
    lock, ledger = CountingLock(), Ledger()
    att._cache_lock = lock
    att._prepared = guard(att._prepared, lock, ledger, "_prepared")
    att._comfy_fns = guard(att._comfy_fns, lock, ledger, "_comfy_fns")
    for S in (3, 4, 5, 6, 7):
        q = torch.randn(1, 2, S, 8)

        def comfy(q, k, v, heads, **kw):          # a new function object per call
            return torch.zeros(1, S, heads * q.shape[-1])
        att(comfy, q, q, q, 2, skip_reshape=True)
    ops = {(c, "del" if op in ("pop", "__delitem__") else op) for c, op, _ in ledger.events}
    assert {("_prepared", "__setitem__"), ("_prepared", "del"), ("_comfy_fns", "__setitem__"),
            ("_comfy_fns", "del")} <= ops, "inserted and trimmed"
    assert ledger.unlocked == [], ledger.unlocked
    assert lock.acquisitions >= 10


def test_a_signatures_run_plans_change_under_the_lock_and_per_thread(prefetch, monkeypatch):
    """Under the compiler a signature keeps one plan per run. Thread B's run (another budget)
    does not replace thread A's: A's next call in its run gets A's plan back."""
    att, kern = make_attn()
    lock, ledger = CountingLock(), Ledger()
    att._cache_lock = lock
    q, k, v = h3_like(700)
    budget_now = {"b": 10**12}
    att._budget = lambda dev: budget_now["b"]

    def comfy(q, k, v, heads, **kw):
        return q.new_zeros(q.shape)

    def call():
        kern.launches.clear()
        att(comfy, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
        return len(kern.launches)
    a1 = call()                                       # thread A (this one), loose budget
    (p,) = att._prepared.values()
    p.run = guard(p.run, lock, ledger, "run")
    budget_now["b"] = 1                               # nothing guarded fits any more
    b1 = _in_thread(call)                             # thread B, its own run: ComfyUI's attention
    a2 = call()
    assert a1 > 0 and b1 == 0 and a2 == a1, "A keeps its run's plan while B runs"
    assert ("run", "__setitem__", True) in ledger.events and ledger.unlocked == []


def test_a_signatures_plan_ladder_changes_under_the_lock():
    """A re-plan adds a rung to the signature's ladder (by_budget) while another thread may be
    reading it (budget.plan_on_ladder iterates a snapshot)."""
    att, kern = make_attn()
    lock, ledger = CountingLock(), Ledger()
    att._cache_lock = lock
    q, k, v = h3_like(700)
    budget_now = {"b": 10**12}
    att._budget = lambda dev: budget_now["b"]

    def comfy(q, k, v, heads, **kw):
        return q.new_zeros(q.shape)
    att(comfy, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    (p,) = att._prepared.values()
    p.by_budget = guard(p.by_budget, lock, ledger, "by_budget")
    budget_now["b"] = p.plan.peak_bytes - 1          # no longer fits: a re-plan
    att(comfy, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    assert ("by_budget", "__setitem__", True) in ledger.events and ledger.unlocked == []


def test_mlp_run_chunks_change_under_their_lock(prefetch, monkeypatch):
    monkeypatch.setattr(report, "MAX_KEYS", 2)
    monkeypatch.setattr(budget, "free_device_bytes", lambda d: 8 * 2**30)
    lock, ledger = CountingLock(), Ledger()
    monkeypatch.setattr(mlp, "_RUN_CHUNKS_LOCK", lock)
    monkeypatch.setattr(mlp, "_RUN_CHUNKS", guard({}, lock, ledger, "_RUN_CHUNKS"))
    for S in (20_000, 30_000, 40_000, 50_000):
        mlp.chunk_for_call("auto", S, 5376, 14336, torch.bfloat16, torch.device("cpu"))
    assert len(mlp._RUN_CHUNKS) == 2 and any(op in ("pop", "__delitem__") for _, op, _ in ledger.events), "trimmed"
    assert ledger.unlocked == [], ledger.unlocked


def test_budget_reader_cache_changes_under_its_lock(monkeypatch):
    monkeypatch.setattr(budget, "free_device_bytes", lambda d: 8 * 2**30)
    now = {"t": 100.0}
    monkeypatch.setattr(budget.time, "monotonic", lambda: now["t"])
    reader = budget.BudgetReader()
    lock, ledger = CountingLock(), Ledger()
    reader._lock = lock
    reader._cache = guard(reader._cache, lock, ledger, "_cache")
    dev = torch.device("cuda", 0)           # a device object only: the reading is the stand-in's
    first = reader(dev)
    now["t"] += 1.0
    assert reader(dev) == first and len(ledger.events) == 2
    assert ledger.unlocked == [], ledger.unlocked


def test_run_id_is_per_thread(monkeypatch):
    lock = CountingLock()
    monkeypatch.setattr(compiler, "_lock", lock)
    mine = compiler.run_id()
    ready, ended, seen = threading.Event(), threading.Event(), {}

    def thread_b():
        seen["b0"] = compiler.run_id()
        ready.set()
        ended.wait(5)
        seen["b1"] = compiler.run_id()        # thread A ended its run meanwhile
    t = threading.Thread(target=thread_b)
    t.start()
    ready.wait(5)
    before = lock.acquisitions
    compiler.new_run()                         # thread A's OUTER_SAMPLE ends
    ended.set()
    t.join()
    assert compiler.run_id() != mine, "A's next run chooses again"
    assert seen["b1"] == seen["b0"], "B's run is not reset by A's"
    assert len({mine, seen["b0"], compiler.run_id()}) == 3, "run ids never shared across threads"
    assert lock.acquisitions == before + 1, "a new run id is taken under the lock"
