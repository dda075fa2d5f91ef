"""SafeSage's attention override under torch.compile (CPU): graph breaks counted with
``torch._dynamo.explain`` on a toy 2-block module whose forward calls ComfyUI's own
attention_pytorch (its wrap_attn hands each call to the override; a stand-in without
COMFYUI_PATH, see tools/harness/comfy_attention_fn.py).

* ``kernel="sdpa"``: SafeSage hands every call to ComfyUI's function -- the same graph-break
  count as ComfyUI's attention alone (+0; it was one "Unsupported context manager" per call:
  the stats lock in report.count);
* a guarded family (a fake kernel whose envelope takes CPU tensors): each call is ONE opaque op
  (``torch.ops.safesage.attention``), 0 graph breaks; the op's body runs the guarded kernel at
  run time (counted, verified there) and the compiled output equals eager;
* on a torch without ``torch.library.custom_op`` the calls run ComfyUI's function (said once);
* the op is registered once per process, also when the module is loaded twice.
"""
import importlib.util
import logging
import os

import pytest
import torch

from safe_ops.attention import opaque_op
from safe_ops.ui import run_stats
from safe_ops.attention.override import SafeAttention
from safe_ops.families.family import Kernel
from safe_ops.policy import Policy

from tools.harness.comfy_attention_fn import attention
from test_attention import CPU_RT, EnvelopeAssertingKernel, toy_envelope

ATTN, WHICH = attention()
print(f"\n[test_attention_compile] attention function: {WHICH}")
HEADS, D, S = 4, 16, 64


class Toy(torch.nn.Module):
    """Two blocks: a projection, then attention the way ComfyUI's layers call it."""

    def __init__(self, transformer_options):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.proj = torch.nn.ModuleList([torch.nn.Linear(HEADS * D, 3 * HEADS * D) for _ in range(2)])
        for p in self.proj.parameters():
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.05)
        self.requires_grad_(False)                # inference, as ComfyUI samples
        self.to = transformer_options

    def forward(self, x):
        for i, proj in enumerate(self.proj):
            q, k, v = proj(x).chunk(3, dim=-1)
            x = x + ATTN(q, k, v, HEADS, transformer_options={**self.to, "block_index": i})
        return x


def _explain(model, x):
    torch._dynamo.reset()
    return torch._dynamo.explain(model)(x)


def _ops(explained) -> int:
    op = getattr(getattr(torch.ops, "safesage", None), "attention", None)
    return sum(1 for g in explained.graphs for n in g.graph.nodes
               if op is not None and n.target in (op, getattr(op, "default", None)))


def _x():
    return torch.randn(1, S, HEADS * D, generator=torch.Generator().manual_seed(1))


def _guarded(verify="first"):
    env = toy_envelope(small_ints=False)
    kern = EnvelopeAssertingKernel(env)
    att = SafeAttention(Policy(kernel="sage", verify=verify), kernels=[Kernel(env, kern, 0.05)], rt=CPU_RT)
    return att, kern


@pytest.fixture(autouse=True)
def _reset():
    run_stats.reset()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_graph_breaks_sdpa_adds_none():
    x = _x()
    alone = _explain(Toy({}), x)
    att = SafeAttention(Policy(kernel="sdpa", verify="off"), kernels=[], rt=CPU_RT)
    through = _explain(Toy({"optimized_attention_override": att}), x)
    assert through.graph_break_count == alone.graph_break_count, [str(b.reason)[:200] for b in through.break_reasons]
    assert _ops(through) == 0                       # ComfyUI's function is traced, not hidden in an op
    m = Toy({"optimized_attention_override": att})
    torch.testing.assert_close(torch.compile(m, backend="aot_eager")(x), m(x), rtol=0, atol=0)


def test_graph_breaks_guarded_call_is_one_opaque_op():
    x = _x()
    att, kern = _guarded()
    m = Toy({"optimized_attention_override": att})
    eager = m(x)                                   # plans and verifies (eagerly)
    assert len(kern.launches) == 2 and run_stats.value("probes") == 1
    explained = _explain(m, x)
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]
    assert _ops(explained) == 2                    # one opaque op per guarded call
    run_stats.reset()
    before = len(kern.launches)
    compiled = torch.compile(m, backend="aot_eager")(x)
    # the op's body ran SafeSage's path at run time: the guarded kernel, counted there
    assert len(kern.launches) == before + 2
    assert run_stats.value("attention_calls") == 2 and run_stats.value("plan:direct") == 2
    assert torch.equal(compiled, eager)


def test_graph_breaks_guarded_call_falls_back_inside_the_op():
    """A call the guarded family cannot run (head_dim outside its envelope) goes to ComfyUI's
    function inside the op's body: same output as eager, counted, no graph break."""
    global HEADS, D
    env = toy_envelope(small_ints=False)
    env = env.__class__(**{**env.__dict__, "head_dims": (32,)})
    kern = EnvelopeAssertingKernel(env)
    att = SafeAttention(Policy(kernel="sage", verify="off"), kernels=[Kernel(env, kern, 0.05)], rt=CPU_RT)
    m = Toy({"optimized_attention_override": att})
    x = _x()
    explained = _explain(m, x)
    assert explained.graph_break_count == 0 and _ops(explained) == 2
    run_stats.reset()
    compiled = torch.compile(m, backend="aot_eager")(x)
    assert not kern.launches and run_stats.value("fallbacks") == 2
    torch.testing.assert_close(compiled, Toy({})(x), rtol=1e-6, atol=1e-6)


def test_graph_breaks_without_custom_op_run_comfys_function(monkeypatch, caplog):
    monkeypatch.setattr(opaque_op, "OP", None)
    with caplog.at_level(logging.WARNING, logger="SafeSage"):
        att, kern = _guarded(verify="off")
        _guarded(verify="off")
    assert sum("no torch.library.custom_op" in r.getMessage() for r in caplog.records) == 1
    m = Toy({"optimized_attention_override": att})
    x = _x()
    explained = _explain(m, x)
    assert explained.graph_break_count == 0 and _ops(explained) == 0
    assert not kern.launches                      # under compile: ComfyUI's function
    torch.testing.assert_close(torch.compile(m, backend="aot_eager")(x), Toy({})(x), rtol=0, atol=0)


def test_opaque_op_registers_once_per_process():
    path = os.path.join(os.path.dirname(opaque_op.__file__), "opaque_op.py")
    spec = importlib.util.spec_from_file_location("safe_ops.attention.second_copy_of_opaque_op", path)  # in its package
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)                 # would raise if it registered safesage::attention again
    assert copy.OP is opaque_op.OP
    if opaque_op.OP is not None:
        assert opaque_op.OP is torch.ops.safesage.attention
        class Att:
            pass
        a, b = Att(), Att()
        assert copy.register(a) != opaque_op.register(b)                # one key space
