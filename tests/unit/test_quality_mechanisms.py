"""One test per quality-guard mechanism that a review removed without any test failing (issue 36,
point 4). Each test here fails when its mechanism is taken out (docs/DEVELOPING.md's table says
which removal each one was seen to catch):

1. medians per (class of call, planned family) -- targets.py ``decide``;
2. no host read per block: a measured step's errors stay on the device until the next forward's
   start or the run's end, one read per device there (guard.py);
3. the probe (reference, candidates) run inside ``compiler.paused()`` (guard.py ``measure``);
4. the probe's rows spread over the sequence, not the first PROBE_ROWS (probe.py ``sample_rows``);
5. the class of call carries its GPU arch (plans.py ``_prepare``);
6. the H3 block index installed by ``apply_safesage`` (patch.py -> quality/blocks.py), with a model
   whose call order is not its block index;
7. ``QualityGuard._runs`` changed only under its lock (lockcheck.py's counting lock stand-in).

The fake CPU families of fake_quality_families.py (registered through SAFESAGE_EXTRA_FAMILIES, as
tests/unit/test_quality_guard.py does): fake_sage quantises q/k per token, so its error grows with a
few scaled-up q/k channels; fake_kitchen adds a fixed relative error whatever the data. No test
here compares a float with a threshold that one CPU's rounding could cross: the outlier blocks
measure several times the balanced target, the benign ones a fraction of it.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import sys
from types import ModuleType, SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from safe_ops.quality.targets import BALANCED_FACTOR, BlockErrors, decide  # noqa: E402
from test_quality_guard import choices, end_run, fake_sage_out, rel, stats  # noqa: E402

SDPA = torch.nn.functional.scaled_dot_product_attention
B, H, D = 1, 4, 32


# ------------------------------------------------------------------------------------------------ fixtures
# ------------------------------------------------------------------------------------------------ helpers
def make_blocks(n, seq, outliers, factor=64, seed=0):
    """``n`` blocks of (q, k, v) [B,H,seq,D]; in each outlier block 4 of D q/k channels x ``factor``
    (fake_sage ~0.06-0.15 rel. L2 there, seeded; ~0.008 on the benign blocks, whose target is ~0.036)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in range(n):
        q, k, v = (torch.randn(B, H, seq, D, generator=g) for _ in range(3))
        if b in outliers:
            q[..., :4] *= factor
            k[..., :4] *= factor
        out.append((q, k, v))
    return out


CALLS: list = []          # (q rows, pause depth) of every call of ComfyUI's own attention


def comfy_fn(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False, **kw):
    """ComfyUI's own attention (what SafeSage falls back to and measures against)."""
    CALLS.append((q.shape[2], PAUSE["depth"]))
    return SDPA(q, k, v, scale=kw.get("scale"))


def make(rt=None, shared=None, **policy):
    from safe_ops.attention.override import SafeAttention
    from safe_ops.facts.devices import Runtime
    from safe_ops.policy import Policy
    rt = rt or Runtime("test", None, None, None, None, None, "test", None, None, None)    # a machine without CUDA
    return SafeAttention(Policy(kernel="sage", **policy), rt=rt, quality=shared)


def schedule(steps):
    return torch.linspace(1.0, 0.0, steps + 1)


def start(att, sched, step):
    """The DIFFUSION_MODEL wrapper's part: the guard's forward start at ``step`` (1-based)."""
    att.quality.forward_start({"sigmas": sched[step - 1:step].clone(), "sample_sigmas": sched})


def call_blocks(att, data):
    return [att(comfy_fn, q, k, v, H, skip_reshape=True, skip_output_reshape=True,
                transformer_options={"block_index": b}) for b, (q, k, v) in enumerate(data)]


def sample(att, data, steps):
    sched = schedule(steps)
    outs = []
    for s in range(1, steps + 1):
        start(att, sched, s)
        outs.append(call_blocks(att, data))
    end_run()
    return outs


# ------------------------------------------------------------------------------------------------ 1. medians
ORDER = ["sage_x", "ck_y"]
NO_CEILING = {"sage_x": float("inf"), "ck_y": float("inf")}   # the relative rule alone (the ceiling: test_quality_targets)


def test_medians_are_per_class_of_call_not_pooled_across_classes():
    """Class A: 4 blocks at 0.010 and one at 0.060 (6x its median: over A's target 0.044); class B:
    10 blocks at 0.040, its own benign level. Pooled, the median is B's 0.040 (target 0.176): A's
    outlier would stay. And B alone among many A blocks: pooled, A's low median would move all of B."""
    a = [BlockErrors(i, "A", "sage_x", 0.010, {"ck_y": 0.001}) for i in range(4)]
    a.append(BlockErrors(4, "A", "sage_x", 0.060, {"ck_y": 0.001}))
    b = [BlockErrors(i, "B", "sage_x", 0.040, {"ck_y": 0.001}) for i in range(10)]
    ch = decide(a + b, "balanced", ORDER, NO_CEILING)
    assert [(c.klass, c.block) for c in ch if c.moved] == [("A", 4)]
    for c in ch:
        assert c.target == pytest.approx(BALANCED_FACTOR * (0.010 if c.klass == "A" else 0.040)), c
    # the other way round: 3 blocks of B at 0.040 among 9 of A at 0.010 -- none of B moves
    a9 = [BlockErrors(i, "A", "sage_x", 0.010, {"ck_y": 0.001}) for i in range(9)]
    ch = decide(a9 + b[:3], "balanced", ORDER, NO_CEILING)
    assert not [c for c in ch if c.moved], [(c.klass, c.block, c.target) for c in ch]


def test_medians_are_per_planned_family_not_pooled_across_families():
    """One class of call, two planned families (blocks planned on different kernels, e.g. by their
    budget): sage_x's 4 benign blocks at 0.010 and an outlier at 0.060; ck_y's 10 blocks at 0.040.
    Pooled over families the median is 0.040 and sage_x's outlier would stay."""
    ms = [BlockErrors(i, "A", "sage_x", 0.010, {"ck_y": 0.001}) for i in range(4)]
    ms.append(BlockErrors(4, "A", "sage_x", 0.060, {"ck_y": 0.001}))
    ms += [BlockErrors(10 + i, "A", "ck_y", 0.040, {"sage_x": 0.001}) for i in range(10)]
    ch = decide(ms, "balanced", ORDER, NO_CEILING)
    assert [(c.planned, c.block, c.family) for c in ch if c.moved] == [("sage_x", 4, "ck_y")]
    for c in ch:
        assert c.target == pytest.approx(BALANCED_FACTOR * (0.010 if c.planned == "sage_x" else 0.040)), c


# ------------------------------------------------------------------------------------------------ 2. host reads
class HostReads(contextlib.AbstractContextManager):
    """Counts every read of a tensor's value by the host while active, tagged with ``phase``:
    a scalar read (``item()``, ``float()``, ``int()``, ``bool()``, a format: ATen's
    ``_local_scalar_dense``, seen by a dispatch mode) and ``tolist()`` / ``numpy()`` (patched).
    On a GPU each is a synchronisation; on the CPU it is the same call, counted the same way."""

    def __init__(self, monkeypatch):
        from torch.utils._python_dispatch import TorchDispatchMode
        self.phase = None
        self.reads: list = []
        reads = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._local_scalar_dense.default:
                    reads.reads.append((reads.phase, "scalar"))
                return func(*args, **(kwargs or {}))

        self._mode = Mode()
        for name in ("tolist", "numpy"):
            real = getattr(torch.Tensor, name)

            def counted(t, *a, _real=real, _name=name, **k):
                reads.reads.append((reads.phase, _name))
                return _real(t, *a, **k)
            monkeypatch.setattr(torch.Tensor, name, counted)

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)

    def count(self, phase):
        return sum(1 for p, _ in self.reads if p == phase)


def test_a_measured_step_reads_the_host_once_per_forward_start_and_run_end_never_per_block(fresh, monkeypatch):
    """The errors of a measured step stay on the device: no block reads one; the next forward's
    start reads them with its sigma in one read (one device here), the run's end reads the last
    measured step's. A run first (the first-call checks read their verdicts), then the run counted:
    step 1 measured with candidates, step 2 the report step (its errors read at the run's end)."""
    nb, outliers = 4, (3,)
    data = make_blocks(nb, 256, outliers)
    att = make(quality="balanced", probe_step=2)
    sample(att, data, 2)                                  # warm: verdicts, plans
    from safe_ops.ui import run_stats
    run_stats.reset()
    sched = schedule(2)
    with HostReads(monkeypatch) as hr:
        for s in (1, 2):
            hr.phase = f"start {s}"
            start(att, sched, s)
            hr.phase = f"blocks {s}"
            call_blocks(att, data)
        hr.phase = "end"
        end_run()
        hr.phase = None
    q = stats()["quality"]
    assert q["probes"] == nb and q["report_probes"] == nb and q["blocks_moved"] == len(outliers), q
    assert hr.count("blocks 1") == 0 and hr.count("blocks 2") == 0, hr.reads     # never per block
    assert hr.count("start 1") == 1, hr.reads           # sigma + schedule
    assert hr.count("start 2") == 1, hr.reads           # sigma + step 1's 4 errors and 4 candidates' errors
    assert hr.count("end") == 1, hr.reads               # the report step's 4 errors
    later = stats()["quality_last_run"]["later"]
    assert later["step"] == 2 and len(later["blocks"]) == nb      # what the run's end read was concluded


# ------------------------------------------------------------------------------------------------ 3. paused
PAUSE = {"depth": 0}


@contextlib.contextmanager
def _pause():
    PAUSE["depth"] += 1
    try:
        yield
    finally:
        PAUSE["depth"] -= 1


def test_the_probe_runs_inside_the_allocation_compilers_pause(fresh, monkeypatch):
    """Under ComfyUI's allocation compiler (a stand-in ``comfy.model_prefetch``: on, its
    ``pause_malloc_graph`` counted) the measurement allocates only on step 1, so it must run
    paused: the rows, ComfyUI's function on them (the reference) and every candidate launch inside
    the pause; the block's own kernel outside it (its allocations are the step's)."""
    fq = fresh
    nb, outliers = 4, (3,)
    data = make_blocks(nb, 256, outliers)
    prefetch = ModuleType("comfy.model_prefetch")
    prefetch.malloc_graph_enabled = lambda device: True
    prefetch.pause_malloc_graph = _pause
    monkeypatch.setitem(sys.modules, "comfy.model_prefetch", prefetch)
    from safe_ops.quality import guard
    real_rows, rows_at = guard.sample_rows, []

    def rows_spy(*a, **k):
        rows_at.append(PAUSE["depth"])
        return real_rows(*a, **k)
    monkeypatch.setattr(guard, "sample_rows", rows_spy)
    att = make(quality="balanced", verify="off")           # no first-call check: every call is the step's
    launches, real_run = [], att.executor.run

    def run(plan, n, *a, **k):
        launches.append((plan.kernel, PAUSE["depth"]))
        return real_run(plan, n, *a, **k)
    monkeypatch.setattr(att.executor, "run", run)
    PAUSE["depth"] = 0
    CALLS.clear()
    sched = schedule(2)
    start(att, sched, 1)
    call_blocks(att, data)
    assert stats()["quality"]["probes"] == nb
    assert rows_at == [1] * nb, rows_at
    assert CALLS and all(r == 256 and depth == 1 for r, depth in CALLS), CALLS      # the references
    assert [d for f, d in launches if f == fq.KITCHEN] == [1] * nb, launches            # the candidates
    assert [d for f, d in launches if f == fq.SAGE] == [0] * nb, launches               # the blocks themselves
    assert PAUSE["depth"] == 0                           # every pause was left
    end_run()


# ------------------------------------------------------------------------------------------------ 4. spread rows
def test_sample_rows_cover_the_whole_sequence_one_per_stride():
    from safe_ops.quality.probe import sample_rows
    for salt in (0, 1, 5, 49):
        rows = sample_rows(10_000, torch.device("cpu"), salt=salt, n=100)
        assert torch.equal(rows // 100, torch.arange(100)), (salt, rows[:5], rows[-5:])   # one row per 100
    offsets = {int(sample_rows(10_000, torch.device("cpu"), salt=s, n=100)[0]) for s in range(8)}
    assert len(offsets) > 1, offsets                     # shifted per block


def test_an_outlier_only_late_in_the_sequence_is_seen(fresh):
    """A block whose q rows are outliers only in the last quarter of its 4,096 tokens (2 channels
    x128 there): measured on rows spread over the sequence, a quarter of them see it and the block
    moves; the first 1,024 rows alone would see a benign block."""
    fq = fresh
    nb, seq = 5, 4096
    data = make_blocks(nb, seq, ())
    q, k, v = data[4]
    q[..., 3 * seq // 4:, :2] *= 128
    att = make(quality="balanced")
    outs = sample(att, data, 2)
    ch = choices()
    assert [b for b, c in ch.items() if c["moved"]] == [4], ch
    assert abs(rel(outs[1][4], SDPA(q, k, v)) - fq.KITCHEN_ERROR) < 1e-3


# ------------------------------------------------------------------------------------------------ 5. arch
def test_choices_for_one_gpu_arch_do_not_apply_to_a_call_class_of_another(fresh):
    """Two SafeAttentions sharing one node's guard (as the per-GPU ones do), for two GPU arches,
    same call shapes. Arch A's calls measured at step 1 move A's outlier block; at step 2 arch B's
    calls of the same blocks and shapes are another class of call: they run as planned."""
    fq = fresh
    from safe_ops.facts.devices import Runtime

    class OtherArch(Runtime):                  # the fake families detect on a runtime without CUDA
        @property
        def arch_name(self):
            return "sm_89"

    nb, outliers = 4, (3,)
    data = make_blocks(nb, 256, outliers)
    att_a = make(quality="balanced")
    other = OtherArch("test", None, None, None, None, None, "test", None, None, None)
    att_b = make(rt=other, quality="balanced", shared=att_a.quality)
    assert att_b.rt.arch_name != att_a.rt.arch_name and att_b.quality is att_a.quality
    call_blocks(att_b, data)                   # B's first-call checks, outside the run
    sched = schedule(2)
    start(att_a, sched, 1)
    call_blocks(att_a, data)
    start(att_a, sched, 2)
    launches = dict(fq.LAUNCHES)
    outs_b = call_blocks(att_b, data)
    assert stats()["quality"]["moved_calls"] == 0, stats()["quality"]
    assert fq.LAUNCHES[fq.KITCHEN] == launches[fq.KITCHEN], fq.LAUNCHES
    for b in outliers:
        q, k, v = data[b]
        assert rel(outs_b[b], fake_sage_out(fq, q, k, v)) < 1e-4, b
    outs_a = call_blocks(att_a, data)            # A's own: moved
    assert stats()["quality"]["moved_calls"] == len(outliers)
    for b in outliers:
        q, k, v = data[b]
        assert abs(rel(outs_a[b], SDPA(q, k, v)) - fq.KITCHEN_ERROR) < 1e-3, b
    end_run()


# ------------------------------------------------------------------------------------------------ 6. H3 block index
def _fake_h3(att_calls_per_block, data):
    """A diffusion model ComfyUI's way (comfy/ldm/minimax/model.py's block loop): each block offered
    to ``patches_replace["dit"][("double_block", i)]``, its attention calls through the override in
    ``transformer_options``. Named as MiniMax H3 so that SafeSage installs its block index."""
    from safe_ops.models.h3.dims import H3_MODEL_CLASS, H3_MODEL_MODULE

    class Block(torch.nn.Module):
        def __init__(self, i):
            super().__init__()
            self.i = i

        def forward(self, x, transformer_options):
            att = transformer_options["optimized_attention_override"]
            q, k, v = data[self.i]
            for _ in range(att_calls_per_block[self.i]):
                x.append(att(comfy_fn, q, k, v, H, skip_reshape=True, skip_output_reshape=True,
                             transformer_options=transformer_options))
            return x

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block(i) for i in range(len(data)))

        def forward(self, x, transformer_options={}):
            blocks_replace = transformer_options.get("patches_replace", {}).get("dit", {})
            h = x
            for i, block in enumerate(self.blocks):
                if ("double_block", i) in blocks_replace:
                    def block_wrap(args, block=block):
                        return {"img": block(args["img"], transformer_options=args["transformer_options"])}
                    h = blocks_replace[("double_block", i)]({"img": h, "transformer_options": transformer_options},
                                                            {"original_block": block_wrap})["img"]
                else:
                    h = block(h, transformer_options=transformer_options)
            return h

    Model.__name__ = Model.__qualname__ = H3_MODEL_CLASS
    Model.__module__ = H3_MODEL_MODULE
    return Model()


class _WrappersMP:
    """comfy.patcher_extension.WrappersMP's names (ComfyUI 0.3.75 and later)."""
    OUTER_SAMPLE, APPLY_MODEL, DIFFUSION_MODEL = "outer_sample", "apply_model", "diffusion_model"


class _Patcher:
    """What apply_safesage uses of ComfyUI's ModelPatcher: clone, model_options, the per-block hook
    (``set_model_patch_replace``) and the wrappers, which :meth:`sample` runs where ComfyUI does
    (OUTER_SAMPLE around the run; APPLY_MODEL around each model evaluation, called with
    ``apply_model``'s positional arguments; DIFFUSION_MODEL around the diffusion model's forward)."""

    def __init__(self, dm, model_options=None, wrappers=None):
        self.model = SimpleNamespace(diffusion_model=dm)
        self.model_options = model_options if model_options is not None else {"transformer_options": {}}
        self.wrappers = wrappers if wrappers is not None else {}

    def clone(self):
        return _Patcher(self.model.diffusion_model, copy.deepcopy(self.model_options),
                        {t: {k: list(v) for k, v in ws.items()} for t, ws in self.wrappers.items()})

    def set_model_patch_replace(self, patch, name, block_name, number, transformer_index=None):
        to = self.model_options.setdefault("transformer_options", {})
        to.setdefault("patches_replace", {}).setdefault(name, {})[(block_name, number)] = patch

    def add_wrapper_with_key(self, wtype, key, fn):
        self.wrappers.setdefault(wtype, {}).setdefault(key, []).append(fn)

    def remove_wrappers_with_key(self, wtype, key):
        self.wrappers.get(wtype, {}).pop(key, None)

    def _wrapped(self, wtype, inner):
        for fn in reversed([f for fs in self.wrappers.get(wtype, {}).values() for f in fs]):
            inner = functools.partial(fn, inner)
        return inner

    def sample(self, x, sched):
        """One sampling run, one model evaluation per step (euler, cfg 1), each on a per-forward copy of
        the model's transformer_options carrying the step's sigma (ComfyUI's calc_cond_batch)."""
        dm = self.model.diffusion_model

        def apply_model(x, t, c_concat, c_crossattn, control, transformer_options):
            return self._wrapped(_WrappersMP.DIFFUSION_MODEL, dm.forward)(x, transformer_options=transformer_options)

        def run():
            outs = []
            for s in range(1, len(sched)):
                to = dict(self.model_options["transformer_options"])
                to["sigmas"], to["sample_sigmas"] = sched[s - 1:s].clone(), sched
                outs.append(self._wrapped(_WrappersMP.APPLY_MODEL, apply_model)(list(x), sched[s - 1:s], None, None,
                                                                                  None, to))
            return outs
        return self._wrapped(_WrappersMP.OUTER_SAMPLE, run)()


def test_h3_blocks_are_told_apart_by_their_index_where_call_order_differs(fresh, monkeypatch):
    """An H3-named model whose block 0 makes two attention calls (call order is not the block
    index), patched by apply_safesage: the quality guard's choices are per DiT block -- blocks
    0..5, outliers 4 and 5 moved -- and the moved blocks' calls run the move from step 2. Counted by
    call order instead, the choices would name blocks 0..6 and move 5 and 6."""
    fq = fresh
    from safe_ops import patch
    from safe_ops.policy import Policy
    monkeypatch.setitem(sys.modules, "comfy.patcher_extension", SimpleNamespace(WrappersMP=_WrappersMP))
    nb, outliers, steps = 6, (4, 5), 3
    data = make_blocks(nb, 256, outliers)
    per_block = [2] + [1] * (nb - 1)
    first_call = [sum(per_block[:b]) for b in range(nb)]          # where each block's first output lands
    m, summary = patch.apply_safesage(_Patcher(_fake_h3(per_block, data)),
                                      Policy(kernel="sage", quality="balanced", mlp_chunking="off"))
    outs = m.sample([], schedule(steps))
    ch = choices()
    assert sorted(ch) == list(range(nb)), sorted(ch)
    assert sorted(b for b, c in ch.items() if c["moved"]) == list(outliers), [
        (b, c["planned_error"], c["target"], c["moved"]) for b, c in ch.items()]
    q = stats()["quality"]
    assert q["probes"] == nb and q["moved_calls"] == len(outliers) * (steps - 1), q
    assert stats()["forwards"] == steps
    for step in (1, 2):
        for b in outliers:
            qq, k, v = data[b]
            assert abs(rel(outs[step][first_call[b]], SDPA(qq, k, v)) - fq.KITCHEN_ERROR) < 1e-3, (step, b)
    for b in range(nb):
        if b not in outliers:
            qq, k, v = data[b]
            assert rel(outs[2][first_call[b]], fake_sage_out(fq, qq, k, v)) < 1e-4, b
    assert "blocks told apart by the H3 block index" in summary["text"] and not summary["warnings"], summary


# ------------------------------------------------------------------------------------------------ 7. _runs lock
def test_every_change_of_the_guards_runs_holds_its_lock(fresh):
    """QualityGuard._runs (run id -> its state) is written by every sampling thread's first forward
    and run end, and trimmed: each change must hold the guard's lock -- checked with a counting lock
    stand-in and a container that records, per change, whether that lock was held (lockcheck.py),
    not by a race the GIL may pass."""
    from lockcheck import CountingLock, Ledger, guard as guarded
    from safe_ops.facts import compiler
    from safe_ops.quality import guard
    att = make(quality="balanced")
    g = att.quality
    lock, ledger = CountingLock(), Ledger()
    g._lock = lock
    g._runs = guarded(g._runs, lock, ledger, "_runs")
    data = make_blocks(2, 64, ())
    sample(att, data, 2)                          # a run: added, then popped at its end
    sched = schedule(2)
    for _ in range(guard.RUNS_KEPT + 2):          # runs that never end here: added, the oldest trimmed
        start(att, sched, 1)
        compiler.new_run()
    ops = [op for _, op, _ in ledger.events]
    assert ops.count("__setitem__") == guard.RUNS_KEPT + 3, ledger.events
    assert "pop" in ops and "__delitem__" in ops, ledger.events
    assert len(g._runs) == guard.RUNS_KEPT
    assert ledger.unlocked == [], ledger.unlocked
