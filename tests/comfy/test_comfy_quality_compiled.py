"""The quality guard under ComfyUI's own TorchCompileModel, in a real headless ComfyUI (H3 trees).

Graph: UNETLoader (the tiny H3 with drifting blocks) -> SafeSageAttention (kernel sage: the fake
guarded families; quality balanced) -> TorchCompileModel's own function with torch's ``eager``
backend (the test node SafeSageTestTorchCompile: ComfyUI's set_torch_compile_wrapper, as the node
calls it; inductor's code generation takes minutes per step for this model on a 2-core CPU -- the
inductor backend is covered by tests/unit/test_quality_compiled.py and on the GPU by
bench/results/quality_compiled_*.json) -> KSampler (3 steps). TorchCompileModel compiles the
diffusion model inside an APPLY_MODEL wrapper of its own; the guard's step reading is SafeSage's APPLY_MODEL wrapper, eager there, so the guard
measures every block at step 1 and runs its choices from step 2: the drifting blocks move to
fake_kitchen. (Before, the step reading was a DIFFUSION_MODEL wrapper, traced under the compile:
0 probes and the drifting blocks ran fake_sage all run.) The CPU test of the same with graph breaks
counted is tests/unit/test_quality_compiled.py.
"""
from __future__ import annotations

from tools.harness.comfy_graphs import h3_graph, stats_delta
from tools.harness.comfy_server import QUALITY_BLOCKS, QUALITY_OUTLIERS

STEPS = 3


def _compiled(graph: dict, backend: str = "eager") -> dict:
    """``graph`` with TorchCompileModel's function between SafeSage (node "10") and the sampler (node "5")."""
    g = dict(graph)
    g["40"] = {"class_type": "SafeSageTestTorchCompile", "inputs": {"model": ["10", 0], "backend": backend}}
    g["5"] = {**g["5"], "inputs": {**g["5"]["inputs"], "model": ["40", 0]}}
    return g


def test_quality_compiled_torchcompilemodel_measures_at_step_1_and_moves_from_step_2(quality_server, seed_counter):
    server, unet = quality_server
    before = server.safesage_stats()
    server.run(_compiled(h3_graph(unet, seed_counter(), "quality_compiled", steps=STEPS,
                                  safesage={"kernel": "sage", "quality": "balanced"})))
    after = server.safesage_stats()
    q = (after["quality"], (after.get("quality_last_run") or {}).get("choices", {}).get("lines"))
    assert stats_delta(before, after, "quality.probes") == QUALITY_BLOCKS, q
    assert stats_delta(before, after, "quality.plan_changes") == 1, q
    assert stats_delta(before, after, "quality.blocks_moved") == len(QUALITY_OUTLIERS), q
    assert stats_delta(before, after, "quality.moved_calls") == len(QUALITY_OUTLIERS) * (STEPS - 1), q
    assert stats_delta(before, after, "forwards") == STEPS          # counted eagerly, once per step
    ch = {c["block"]: c for c in after["quality_last_run"]["choices"]["blocks"]}
    for b in QUALITY_OUTLIERS:
        assert (ch[b]["planned"], ch[b]["family"]) == ("fake_sage", "fake_kitchen"), ch[b]
    for b in set(range(QUALITY_BLOCKS)) - set(QUALITY_OUTLIERS):
        assert ch[b]["family"] == "fake_sage" and not ch[b]["moved"], ch[b]
    # the guarded calls went through SafeSage's opaque op (the compiled path), not ComfyUI's function
    assert any("fake_sage" in v for v in after["plans"].values()), after["plans"]
