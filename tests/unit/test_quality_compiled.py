"""The quality guard on a model compiled the way ComfyUI's TorchCompileModel compiles it (CPU).

TorchCompileModel (comfy_api/torch_helpers/torch_compile.py, every tree) swaps a ``torch.compile``d
``diffusion_model`` in from an APPLY_MODEL wrapper, and the diffusion model runs its DIFFUSION_MODEL
wrappers inside its own (compiled) forward. Here: a stack of NB attention "blocks" (the fake
families of fake_quality_families.py, blocks OUTLIERS with outlier q/k channels, as in
test_quality_guard.py) is compiled with ``torch.compile`` and called through SafeSage's own
APPLY_MODEL wrapper (patch._forward_wrapper), as ComfyUI's BaseModel.apply_model calls it, with
ComfyUI's ``transformer_options`` (the override, ``sigmas``, ``sample_sigmas``). The guard must
measure at step 1 and run its choices from step 2, and the compiled graph must have 0 graph breaks
(each guarded call one opaque op). Before the step reading moved into the APPLY_MODEL wrapper it ran
in a DIFFUSION_MODEL wrapper -- traced under TorchCompileModel, where it returned early: 0 probes,
and the outlier blocks ran the drifting kernel all run.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from test_quality_guard import (BENIGN, H, NB, OUTLIERS, SDPA, blocks, comfy_fn, end_run, fake_sage_out,  # noqa: F401
                                make, rel, schedule, stats, choices)


def _wrapped(kind, fn):
    """``fn`` inside SafeSage's wrapper of ComfyUI's wrapper type ``kind`` (patch.WRAPPERS), if it has one
    there: as ComfyUI runs it -- APPLY_MODEL around the compiled model (eager), DIFFUSION_MODEL inside
    the model's own forward (traced under TorchCompileModel)."""
    from safe_ops import patch
    w = patch.WRAPPERS.get(kind)
    return (lambda *a, **k: w(fn, *a, **k)) if w is not None else fn


class Stack(torch.nn.Module):
    """NB blocks, each one attention call the way an H3 block makes it (4-d views, block_index); the
    forward runs the DIFFUSION_MODEL wrappers first, as ComfyUI's diffusion models do."""

    def __init__(self, att):
        super().__init__()
        self.att = att

    def forward(self, qkv, transformer_options):
        return _wrapped("DIFFUSION_MODEL", self._forward)(qkv, transformer_options=transformer_options)

    def _forward(self, qkv, transformer_options):
        outs = []
        for b in range(NB):
            q, k, v = qkv[b]
            outs.append(self.att(comfy_fn, q, k, v, H, skip_reshape=True, skip_output_reshape=True,
                                 transformer_options={"block_index": b}))
        return torch.stack(outs)


def _apply_model(att, compiled, qkv, sched, step):
    """ComfyUI's BaseModel.apply_model: its APPLY_MODEL wrappers around the (compiled) diffusion model,
    called with (x, t, c_concat, c_crossattn, control, transformer_options) positionally."""
    from safe_ops import patch
    to = {patch.OVERRIDE_KEY: att, "sigmas": sched[step - 1:step].clone(), "sample_sigmas": sched}

    def executor(x, t, c_concat, c_crossattn, control, transformer_options, **kw):
        return compiled(qkv, transformer_options)

    return _wrapped("APPLY_MODEL", executor)(qkv, sched[step - 1:step], None, None, None, to)


def _sample(backend, steps=3):
    data = blocks()
    qkv = torch.stack([torch.stack(t) for t in data])          # [NB, 3, B, H, S, D]
    att = make(quality="balanced")
    torch._dynamo.reset()
    model = Stack(att)
    explained = torch._dynamo.explain(model)(qkv, {"sigmas": schedule(steps)[:1], "sample_sigmas": schedule(steps)})
    compiled = torch.compile(model, backend=backend)
    sched = schedule(steps)
    outs = [_apply_model(att, compiled, qkv, sched, s) for s in range(1, steps + 1)]
    end_run()
    return data, outs, explained


def _check_guard(fq, data, outs, steps=3):
    q = stats()["quality"]
    assert q["probes"] == NB and q["plan_changes"] == 1 and q["blocks_moved"] == len(OUTLIERS), q
    assert q["moved_calls"] == len(OUTLIERS) * (steps - 1), q
    assert stats()["forwards"] == steps                 # counted eagerly, once per model evaluation
    ch = choices()
    for b in OUTLIERS:
        assert ch[b]["family"] == fq.KITCHEN and ch[b]["moved"], ch[b]
    for b in BENIGN:
        assert ch[b]["family"] == fq.SAGE and not ch[b]["moved"], ch[b]
    for b, (qq, k, v) in enumerate(data):
        assert rel(outs[0][b], fake_sage_out(fq, qq, k, v)) < 1e-4, b      # step 1: as planned
        for step in range(1, steps):
            if b in OUTLIERS:
                assert abs(rel(outs[step][b], SDPA(qq, k, v)) - fq.KITCHEN_ERROR) < 1e-3, (b, step)
            else:
                assert rel(outs[step][b], fake_sage_out(fq, qq, k, v)) < 1e-4, (b, step)


def test_quality_compiled_eager_backend_measures_at_step_1_and_moves_from_step_2(fresh):
    data, outs, explained = _sample("eager")
    assert explained.graph_break_count == 0, explained.break_reasons
    _check_guard(fresh, data, outs)


def test_quality_compiled_inductor_measures_at_step_1_and_moves_from_step_2(fresh):
    data, outs, explained = _sample("inductor")
    assert explained.graph_break_count == 0, explained.break_reasons
    _check_guard(fresh, data, outs)
