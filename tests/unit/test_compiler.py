"""Under ComfyUI's allocation compiler (0.34+): the same plans and chunk sizes for a whole run, the
first-call check outside the graph, and nothing changed where ComfyUI has no compiler (CPU).

A stand-in ``comfy.model_prefetch`` provides the two functions SafeSage asks ComfyUI
(``malloc_graph_enabled(device)``, ``pause_malloc_graph()``) and records when the graph is
paused; the GPU proof with the real comfy-aimdo is bench/length/compiler_probe.py.
"""
import contextlib
import sys
import types

import pytest
import torch

from safe_ops.facts import compiler
from safe_ops.models.h3 import mlp
from safe_ops.ui import run_stats
from safe_ops.policy import Policy

from test_attention import h3_like, make_attn, raw, reference


@pytest.fixture
def prefetch(monkeypatch):
    mod = types.ModuleType("comfy.model_prefetch")
    mod.enabled = True
    mod.paused = 0
    mod.log = []

    def malloc_graph_enabled(device):
        return mod.enabled

    @contextlib.contextmanager
    def pause_malloc_graph(sync=False):
        mod.paused += 1
        mod.log.append("pause")
        try:
            yield
        finally:
            mod.paused -= 1
            mod.log.append("resume")

    mod.malloc_graph_enabled = malloc_graph_enabled
    mod.pause_malloc_graph = pause_malloc_graph
    monkeypatch.setitem(sys.modules, "comfy.model_prefetch", mod)
    run_stats.reset()
    return mod


def test_plan_kept_for_the_run_and_chosen_again_in_the_next(prefetch):
    att, kern = make_attn()
    q, k, v = h3_like(700)
    budget = {"now": 10**12}
    att._budget = lambda dev: budget["now"]
    run = compiler.run_id()
    launches = []
    for _ in range(3):
        kern.launches.clear()
        budget["now"] = 10**12 if not launches else 1      # free memory collapses after step 1
        att(raw, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
        launches.append(len(kern.launches))
    assert launches[0] == launches[1] == launches[2], "the same plan every step of the run"
    assert run_stats.value("replans") == 0
    compiler.new_run()                       # OUTER_SAMPLE ended: the next run reads the budget
    assert compiler.run_id() > run        # a new id (other threads of earlier tests may have taken ids too)
    kern.launches.clear()
    comfy_calls = []
    out = att(lambda *a, **kw: comfy_calls.append(1) or reference(*a[:3]).to(q.dtype), q, k, v, 4,
              skip_reshape=True, skip_output_reshape=True)
    assert comfy_calls == [1] and not kern.launches, "budget 1 byte in the new run: no guarded plan fits"
    torch.testing.assert_close(out.double(), reference(q, k, v), rtol=1e-5, atol=1e-5)


def test_without_the_compiler_the_plan_follows_the_budget(prefetch):
    prefetch.enabled = False
    att, kern = make_attn()
    q, k, v = h3_like(700)
    budget = {"now": 10**12}
    att._budget = lambda dev: budget["now"]
    launches = []
    for now in ("loose", "tight", "loose"):
        budget["now"] = 10**12 if now == "loose" else next(iter(att._prepared.values())).plan.peak_bytes - 1
        kern.launches.clear()
        att(raw, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
        launches.append(len(kern.launches))
    assert launches[0] < launches[1] and launches[2] == launches[0] and run_stats.value("replans") == 1


def test_each_run_takes_its_plan_from_the_ladder_without_replanning(prefetch, monkeypatch):
    """The per-run rule with the plan ladder (budget.plan_on_ladder): a new run whose budget sits in
    another bucket but still fits the signature's plan takes it without planner.choose; a run whose
    budget no longer fits plans once and keeps that plan for the run; the next run with memory back
    takes the first plan again, still without planning."""
    import safe_ops.attention.plans as plans
    from safe_ops.facts.budget import budget_bucket
    chooses = []
    real = plans.choose
    monkeypatch.setattr(plans, "choose", lambda call, envs, b=None, t=None: chooses.append(b) or real(call, envs, b, t))
    att, kern = make_attn()
    q, k, v = h3_like(700)
    budget = {"now": 10**12}
    att._budget = lambda dev: budget["now"]

    def step(b):
        budget["now"] = b
        kern.launches.clear()
        att(raw, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
        return len(kern.launches)
    first = step(10**12)
    peak = next(iter(att._prepared.values())).plan.peak_bytes
    chooses.clear()
    for f in (30, 2, 5, 1.3):
        compiler.new_run()
        assert [step(budget_bucket(int(peak * f))), step(1)] == [first, first], "kept for the run"
    assert chooses == [] and run_stats.value("replans") == 0
    compiler.new_run()
    tight = step(peak - 1)
    assert tight > first and chooses == [peak - 1] and run_stats.value("replans") == 1
    assert step(10**12) == tight, "memory back within the run: the run's plan is kept"
    compiler.new_run()
    assert step(10**12) == first and len(chooses) == 1


def test_first_call_check_runs_with_the_graph_paused(prefetch, monkeypatch):
    import safe_ops.attention.fallbacks as A     # the first-call check (override.py's verify stage)
    seen = []
    real = A.compare

    def compare(*a, **k):
        seen.append(prefetch.paused)
        return real(*a, **k)
    monkeypatch.setattr(A, "compare", compare)
    att, _ = make_attn(policy=Policy(kernel="sage", verify="first"))
    q, k, v = h3_like(100)
    for _ in range(2):
        att(raw, q, k, v, 4, skip_reshape=True)
    assert seen == [1] and prefetch.log == ["pause", "resume"], "one check, inside the pause"


def test_no_model_prefetch_means_no_compiler_and_no_pause(monkeypatch):
    monkeypatch.setitem(sys.modules, "comfy.model_prefetch", types.ModuleType("comfy.model_prefetch"))
    assert not compiler.enabled(torch.device("cpu"))
    with compiler.paused():
        pass
    monkeypatch.delitem(sys.modules, "comfy.model_prefetch")
    assert not compiler.enabled(torch.device("cpu"))


def test_mlp_auto_chunk_kept_for_the_run(prefetch, monkeypatch):
    from safe_ops.facts import budget
    free = {"b": 100 * 2**30}
    clock = {"t": 1000.0}
    monkeypatch.setattr(budget, "free_device_bytes", lambda d: free["b"])
    monkeypatch.setattr(budget.time, "monotonic", lambda: clock["t"])

    def later():               # past the MLP's free-memory throttle (budget.MLP_READER)
        clock["t"] += 2 * budget.BUDGET_POLL_S
    dev = torch.device("cpu")
    a = mlp.chunk_for_call("auto", 50_000, 5376, 14336, torch.bfloat16, dev)
    free["b"] = 2 * 2**30                                    # a quarter of it: a smaller auto chunk
    later()
    assert mlp.chunk_for_call("auto", 50_000, 5376, 14336, torch.bfloat16, dev) == a
    compiler.new_run()
    b = mlp.chunk_for_call("auto", 50_000, 5376, 14336, torch.bfloat16, dev)
    assert b < a
    prefetch.enabled = False
    compiler.forward_started()               # asked once per forward: the next forward asks again
    free["b"] = 100 * 2**30
    later()
    assert mlp.chunk_for_call("auto", 50_000, 5376, 14336, torch.bfloat16, dev) == a, "no compiler: follows memory"


def test_comfys_compiler_is_asked_once_per_forward_not_per_call(prefetch, monkeypatch):
    """ComfyUI's malloc_graph_enabled is asked once per device in a forward (the APPLY_MODEL
    wrapper starts one), whatever the number of attention calls; the next forward asks again."""
    asked = []
    real = prefetch.malloc_graph_enabled
    monkeypatch.setattr(prefetch, "malloc_graph_enabled", lambda device: asked.append(device) or real(device))
    att, kern = make_attn()
    att._budget = lambda dev: 10**12
    q, k, v = h3_like(300)
    for _ in range(5):
        att(raw, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    assert len(asked) == 1 and len(kern.launches) >= 5
    compiler.forward_started()
    att(raw, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    assert len(asked) == 2


def test_the_apply_model_wrapper_starts_a_forward(prefetch, monkeypatch):
    from safe_ops import patch
    asked = []
    monkeypatch.setattr(prefetch, "malloc_graph_enabled", lambda device: asked.append(device) or True)
    dev = torch.device("cpu")
    assert compiler.enabled_now(dev) and compiler.enabled_now(dev) and len(asked) == 1
    patch._forward_wrapper(lambda *a, **k: "out", transformer_options={})
    assert compiler.enabled_now(dev) and len(asked) == 2, "asked again in the new forward"
