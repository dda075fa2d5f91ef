"""The chunked H3 MLP's host work per call (issue 29 point 3), on the CPU without ComfyUI.

* free memory ("auto") is read through budget.MLP_READER: at most once per BUDGET_POLL_S seconds
  for any number of MLP calls, not once per call (ComfyUI's get_free_memory costs >= 100 us);
* what never changes for a patched module -- the parsed setting, the dims, whether chunking could
  change the numbers (row_dependent_reason) -- is worked out once per patch (mlp.MLPFacts), and
  again when the module changed (other Linears, a quantisation loaded since);
* the cast memo's key is built once per layer per call, not once per chunk; a chunk whose cast
  arguments differ still misses;
* while torch compiles none of these caches is read or written.

The stand-in MLP is an nn.Module with ``fc1`` / ``fc2`` Linears and H3's SwiGLU forward; the
patch runs it per chunk as it runs ComfyUI's (``type(module).forward``). Results are compared with
the same forward run on the same chunks: bitwise.
"""
import pytest
import torch
import torch.nn.functional as F

from safe_ops.facts import budget
from safe_ops.models.h3 import cast_memo, mlp, mlp_patch, mlp_plan
from safe_ops.ui import run_stats

HIDDEN, FFN = 8, 12


class StandInMLP(torch.nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc1 = torch.nn.Linear(HIDDEN, 2 * FFN, bias=False)
        self.fc2 = torch.nn.Linear(FFN, HIDDEN, bias=False)
        for lin in (self.fc1, self.fc2):
            lin.weight = torch.nn.Parameter(torch.randn(lin.weight.shape, generator=g), requires_grad=False)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(F.silu(h[..., :FFN]) * h[..., FFN:])


def _x(S, seed=1):
    return torch.randn(S, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def stats():
    run_stats.reset()
    mlp.MLP_STATS.reset()
    yield mlp.MLP_STATS
    run_stats.reset()


@pytest.fixture
def clock(monkeypatch):
    now = {"t": 1000.0}
    monkeypatch.setattr(budget.time, "monotonic", lambda: now["t"])
    return now


@pytest.fixture
def free_reads(monkeypatch):
    """A stand-in for ComfyUI's get_free_memory behind budget.free_device_bytes: counts its calls."""
    reads = []

    def free(device):
        reads.append(device)
        return 64 * 2**30
    monkeypatch.setattr(budget, "free_device_bytes", free)
    return reads


def test_auto_reads_free_memory_at_most_once_per_poll_interval(stats, clock, free_reads):
    m = StandInMLP()
    patch = mlp_patch.H3ChunkedMLPForward(m, "blocks.0.mlp", "auto")
    x = _x(40)
    with torch.no_grad():
        for _ in range(50):
            y = patch(x)
        assert torch.equal(y, m(x))
    assert len(free_reads) == 1, f"{len(free_reads)} free-memory reads for 50 MLP calls within one poll interval"
    clock["t"] += 2 * budget.BUDGET_POLL_S
    with torch.no_grad():
        for _ in range(50):
            patch(x)
    assert len(free_reads) == 2, "read again once the interval has passed, once"
    assert stats.calls == 100 and stats.passthrough == 100


def test_one_reading_serves_every_patched_mlp(stats, clock, free_reads):
    """50 blocks' MLPs of one model share the process's reader."""
    patches = [mlp_patch.H3ChunkedMLPForward(StandInMLP(i), f"blocks.{i}.mlp", "auto") for i in range(50)]
    x = _x(16)
    with torch.no_grad():
        for p in patches:
            p(x)
    assert len(free_reads) == 1


def test_module_facts_are_worked_out_once_per_patch(stats, monkeypatch):
    counts = {"parse": 0, "row": 0, "dims": 0}

    def counting(name, fn):
        def wrapped(*a, **k):
            counts[name] += 1
            return fn(*a, **k)
        return wrapped
    monkeypatch.setattr(mlp, "parse_chunk_setting", counting("parse", mlp.parse_chunk_setting))
    monkeypatch.setattr(mlp_plan, "parse_chunk_setting", counting("parse", mlp_plan.parse_chunk_setting))
    monkeypatch.setattr(mlp, "row_dependent_reason", counting("row", mlp.row_dependent_reason))
    monkeypatch.setattr(mlp, "_mlp_dims", counting("dims", mlp._mlp_dims))
    m = StandInMLP()
    patch = mlp_patch.H3ChunkedMLPForward(m, "blocks.0.mlp", 8)     # 8 tokens per chunk
    x = _x(30)
    fwd = type(m).forward
    with torch.no_grad():
        for _ in range(20):
            y = patch(x)
        want = torch.cat([fwd(m, x[a:a + 8]) for a in range(0, 30, 8)])
    assert torch.equal(y, want), "ComfyUI's forward on the same chunks: bitwise"
    assert counts == {"parse": 0, "row": 2, "dims": 1}, counts     # fc1 and fc2 checked once, dims once
    assert stats.chunked_calls == 20 and stats.chunks == 80


def test_a_changed_module_is_noticed(stats, monkeypatch):
    m = StandInMLP()
    patch = mlp_patch.H3ChunkedMLPForward(m, "blocks.0.mlp", 8)
    x = _x(30)
    with torch.no_grad():
        patch(x)
        # a quantisation loaded into fc1 since (ComfyUI's loader sets layout_type on the layer):
        # NVFP4 without an input scale quantises over all tokens -> unchunked from now on
        m.fc1.layout_type = "TensorCoreNVFP4Layout"
        m.fc1.quant_format = "nvfp4"
        y = patch(x)
    assert torch.equal(y, m(x)) and stats.chunked_calls == 1 and len(stats.fallbacks) == 1
    assert "TensorCoreNVFP4Layout" in next(iter(stats.fallbacks))
    with torch.no_grad():
        m.fc1.input_scale = torch.nn.Parameter(torch.ones(()), requires_grad=False)   # a fixed input scale
        patch(x)
        assert stats.chunked_calls == 2, "with a checkpoint input scale NVFP4 is row independent again"
        # other Linear objects (another width): the dims are read again
        m.fc2 = torch.nn.Linear(FFN, HIDDEN + 4, bias=False)
        del m.fc1.layout_type, m.fc1.quant_format, m.fc1.input_scale
        y = patch(x)
    assert y.shape == (30, HIDDEN + 4) and stats.chunked_calls == 3


def test_memo_key_is_built_once_per_layer_per_call(monkeypatch):
    built = []
    real_key = cast_memo._key
    monkeypatch.setattr(cast_memo, "_key", lambda *a: built.append(a[0]) or real_key(*a))

    class Stats:
        n = {}

        def bump(self, c, k=1):
            self.n[c] = self.n.get(c, 0) + k
    fc1, fc2 = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    scope = cast_memo._Scope([fc1, fc2], Stats(), uncast=lambda *a: None)
    real = [0]

    def cast(s, x, offloadable=False):          # a new copy per real cast (its own memory)
        real[0] += 1
        return (s.weight.to(x.dtype, copy=True), None, None)
    x = torch.randn(16, 4)
    first = {}
    for a in range(0, 16, 4):                       # 4 chunks, each layer cast per chunk
        for layer in (fc1, fc2):
            w = scope.cast(cast, layer, (x[a:a + 4],), {"offloadable": True})[0]
            assert first.setdefault(layer, w) is w, "later chunks get the first chunk's cast back"
    assert built == [fc1, fc2], "one key per layer per call"
    assert real[0] == 2 and Stats.n["cast_reuses"] == 6
    # a chunk cast with other arguments is not taken for the memoised cast
    scope.cast(cast, fc1, (x[:4].double(),), {"offloadable": True})
    scope.cast(cast, fc1, (x[:4],), {"offloadable": False})
    assert real[0] == 4 and len(built) == 4
    # 1 == True: the shortcut misses (other type), the key it builds is the memoised one (as before)
    scope.cast(cast, fc1, (x[:4],), {"offloadable": 1})
    assert real[0] == 4 and len(built) == 5 and not scope.dropped


def test_while_compiling_nothing_cached_is_touched(stats, clock, free_reads, monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    m = StandInMLP()
    patch = mlp_patch.H3ChunkedMLPForward(m, "blocks.0.mlp", "auto")
    x = _x(16)
    with torch.no_grad():
        for _ in range(3):
            y = patch(x)
    assert torch.equal(y, m(x))
    assert budget.MLP_READER._cache == {} and len(free_reads) == 3, "free memory read as it is, nothing kept"
    assert patch._facts is None
