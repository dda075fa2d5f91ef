"""report.py is SafeSage's one store of run statistics: every component's counters (the MLP's as a
Section), locked against the server thread's snapshot(), and every per-shape cache bounded."""
import inspect
import logging
import threading

import pytest
import torch

from safe_ops.models.h3 import mlp
from safe_ops.ui import run_stats as report
from safe_ops.attention.override import SafeAttention
from safe_ops.policy import Policy
from safe_ops.attention.verification import Verdict, Verifier
from safe_ops.facts.devices import Runtime

from safe_ops.families.family import Kernel

from lockcheck import CountingLock, Ledger, guard
from test_attention import EnvelopeAssertingKernel, toy_envelope

CPU_RT = Runtime("test", None, None, None, None, None, "test", None, None, None)


@pytest.fixture(autouse=True)
def _clean_store():
    report.reset()
    yield
    report.reset()


def test_the_mlp_counts_into_the_one_store():
    mlp.MLP_STATS.bump("chunks", 5)
    mlp.MLP_STATS.bump("chunked_calls")
    mlp.MLP_STATS.fallback("autograd enabled")
    mlp.MLP_STATS.fallback("autograd enabled")
    snap = report.snapshot()
    assert snap["mlp"]["chunks"] == 5 and snap["mlp"]["chunked_calls"] == 1 and snap["mlp"]["casts"] == 0
    assert snap["mlp"]["fallbacks"] == {"autograd enabled": 2}
    assert set(snap["mlp"]) == set(mlp.MLP_COUNTERS) | {"fallbacks"}
    assert not [k for k in snap if "." in k], "a section's counters appear only under its name"
    assert snap["fallbacks"] == 0, "an MLP fallback is not an attention fallback"
    assert mlp.MLP_STATS.chunks == 5 and mlp.MLP_STATS.fallbacks == {"autograd enabled": 2}
    report.reset()
    assert report.snapshot()["mlp"]["chunks"] == 0 and report.snapshot()["mlp"]["fallbacks"] == {}


def test_a_section_logs_each_fallback_reason_once(caplog):
    with caplog.at_level(logging.WARNING, logger="SafeSage"):
        for _ in range(3):
            mlp.MLP_STATS.fallback("comfy in_training")
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["SafeSage MLP: running ComfyUI's unchunked MLP (comfy in_training)"]


def test_a_section_refuses_an_undeclared_counter():
    with pytest.raises(KeyError):
        mlp.MLP_STATS.bump("chunk")          # a typo must not become a silent new counter


#: the store's containers: every change to one must hold report._lock
CONTAINERS = ("STATS", "FALLBACKS", "PLANS", "DISABLED", "FAILED_CHECKS", "_SECTION_FALLBACKS", "_logged",
              "_extra", "_SECTIONS")
#: public functions / Section methods that only read (or, trim, bound a cache the caller locks)
READERS = {"snapshot", "disabled_families", "disabled_at", "trim"}
SECTION_READERS = {"get", "as_dict", "key"}


def test_every_mutation_of_the_store_holds_its_lock(monkeypatch):
    """The server thread's snapshot() iterates the store while the sampler writes it: every
    writer must hold report._lock. A counting stand-in for the lock and containers that record
    whether it was held at each change: a writer without the lock fails here whatever the GIL
    does. Every public function of the store is either called here or declared a reader."""
    lock = CountingLock()
    ledger = Ledger()
    monkeypatch.setattr(report, "_lock", lock)
    for name in CONTAINERS:
        monkeypatch.setattr(report, name, guard(getattr(report, name), lock, ledger, name))
    sec = report.Section("locktest", ("a",))
    report.count("warm")                   # this thread's own counts exist (made once, under the lock)
    writers = {
        "value": lambda: report.count("attention_calls") or report.value("attention_calls"),
        "disabled": lambda: report.disabled("fam", "why"),
        "failed_check": lambda: report.failed_check("fam shape", "why"),
        "fallback": lambda: report.fallback("a reason", "key"),
        "once": lambda: report.once(("k",), logging.DEBUG, "m"),
        "remember_plan": lambda: report.remember_plan("shape", "plan"),
        "set_info": lambda: report.set_info("info", 1),
        "info_max": lambda: report.info_max("peak", 2),
        "reset": report.reset,
    }
    section_writers = {
        "bump": lambda: sec.bump("a") or sec.as_dict(),     # a thread's own count, summed by the read
        "fallback": lambda: sec.fallback("why"),
        "once_warning": lambda: sec.once_warning("msg"),
        "reset": sec.reset,
    }
    acquired = {}
    for name, fn in [*writers.items(), *(("Section." + n, f) for n, f in section_writers.items()),
                     ("Section()", lambda: report.Section("locktest2", ("b",)))]:
        before, changes = lock.acquisitions, len(ledger.events)
        if name == "reset":
            report.count("x")
        fn()
        acquired[name] = lock.acquisitions - before
        assert len(ledger.events) > changes, f"{name} changed none of the store's containers"
    assert ledger.unlocked == [], f"changed without report._lock: {ledger.unlocked}"
    assert all(acquired.values()), acquired
    public = {n for n, f in vars(report).items() if inspect.isfunction(f) and not n.startswith("_")
              and f.__module__ == report.__name__}
    assert public - READERS == set(writers) | {"count", "counts", "record_call"}, "a new public function of the store: add it here"
    methods = {n for n, f in vars(report.Section).items() if inspect.isfunction(f) and not n.startswith("_")}
    assert methods - SECTION_READERS == set(section_writers), "a new Section method: add it here"


def test_a_count_writes_only_the_calling_threads_own_counts_and_a_read_sums_them(monkeypatch):
    """count() takes no lock and changes none of the store's shared containers: it writes a dict
    that only the calling thread ever writes (the attention override counts on every call). A read
    sums every thread's counts into the store under the lock -- exactly, however often it reads:
    what a read has summed is kept apart, never counted twice, never lost -- and a thread that
    ended is summed a last time and dropped."""
    lock = CountingLock()
    ledger = Ledger()
    monkeypatch.setattr(report, "_lock", lock)
    for name in CONTAINERS:
        monkeypatch.setattr(report, name, guard(getattr(report, name), lock, ledger, name))
    writers = []
    real_new = report._new_thread_counts

    def watched_new():
        c = real_new()
        owner = threading.get_ident()

        class Owned(dict):
            def __setitem__(self, k, v):
                writers.append(threading.get_ident() == owner)
                dict.__setitem__(self, k, v)
        watched = Owned(c)
        report._own.counts = watched
        report._THREADS[-1][1] = watched
        return watched
    monkeypatch.setattr(report, "_new_thread_counts", watched_new)
    report.count("x")                                   # this thread's first count
    before, changes = lock.acquisitions, len(ledger.events)
    report.count("x", 2)
    assert lock.acquisitions == before and len(ledger.events) == changes, "no lock, no shared container"

    def worker():
        for _ in range(1000):
            report.count("x")
    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    reads = [report.value("x") for _ in range(50)]      # reads while they count
    for t in threads:
        t.join()
    assert reads == sorted(reads), "a read never loses what an earlier one summed"
    assert report.value("x") == 4003 and report.value("x") == 4003, "exact, and not summed twice"
    assert writers and all(writers), "every thread's counts written by that thread only"
    assert ledger.unlocked == [] and any(e[0] == "STATS" for e in ledger.events)
    assert len(report._THREADS) == 1, "the ended threads were summed and dropped"
    report.reset()
    assert report.value("x") == 0
    report.count("x")
    assert report.value("x") == 1, "what was counted before the reset stays behind it"


def test_log_once_keys_are_bounded(monkeypatch):
    monkeypatch.setattr(report, "MAX_LOG_KEYS", 3)
    assert all(report.once(("k", i), logging.DEBUG, "m") for i in range(4))
    assert not report.once(("k", 3), logging.DEBUG, "m"), "a kept key does not log again"
    assert report.once(("k", 0), logging.DEBUG, "m"), "the oldest key was forgotten"
    assert len(report._logged) == 3


def _verdict(ok):
    return Verdict(ok, 0.0 if ok else 1.0, 0.1)


def test_verifier_verdicts_are_bounded_and_a_failed_class_is_kept(monkeypatch):
    monkeypatch.setattr(report, "MAX_KEYS", 3)
    ver = Verifier("first")
    ver.record(("bad",), _verdict(False))
    for i in range(5):
        ver.record((f"ok{i}",), _verdict(True))
    assert list(ver.verdicts()) == ["bad", "ok3", "ok4"]
    assert ver.known_bad(("bad",)) is not None
    assert ver.needs_probe(("ok0",)) and not ver.needs_probe(("ok4",))


def _q(S):
    return torch.randn(1, 2, S, 8)


def test_per_signature_caches_are_bounded(monkeypatch):
    """A pack that hands a new function per call, or an endless stream of shapes, does not grow
    SafeAttention's caches past the store's bound."""
    monkeypatch.setattr(report, "MAX_KEYS", 2)
    env = toy_envelope()
    att = SafeAttention(Policy(kernel="sdpa", verify="off"), kernels=[Kernel(env, EnvelopeAssertingKernel(env))],
                        rt=CPU_RT)
    att._may_guard = True           # a policy that plans every call (here: to ComfyUI's own)
    for S in (3, 4, 5, 6, 7):
        q = _q(S)

        def comfy(q, k, v, heads, **kw):          # a new function object per call
            return torch.zeros(1, S, heads * q.shape[-1])

        out = att(comfy, q, q, q, 2, skip_reshape=True)
        assert out.shape == (1, S, 16), "the call still ran ComfyUI's function"
    assert len(att._prepared) == 2 and len(att._comfy_fns) == 2
    assert report.snapshot()["attention_calls"] == 5


def test_the_node_status_shows_what_earlier_prompts_switched_off():
    from safe_ops.ui.status import process_lines
    assert process_lines(report.snapshot()) == []
    report.disabled("sage2_sm90", "RuntimeError: SM90 kernel is not available")
    for i in range(5):
        report.failed_check(f"sage2_sm80 shape{i}", "failed verification (rel. L2 0.4)")
    lines = process_lines(report.snapshot())
    assert len(lines) == 2
    assert "sage2_sm90 is off" in lines[0] and "SM90 kernel is not available" in lines[0]
    assert lines[1].startswith("WARNING: 5 kind(s) of call failed") and "shape2" in lines[1]
    assert "shape3" not in lines[1] and "+2 more" in lines[1]


def test_a_family_switched_off_is_off_for_a_later_safesage_too():
    """The list of switched-off families is the report's: a SafeSage node applied later in the
    process (a new SafeAttention) does not try the family again."""
    first = SafeAttention(Policy(kernel="auto", verify="off"), kernels=[], rt=CPU_RT)
    report.disabled("toy_sage", "cannot run here")
    later = SafeAttention(Policy(kernel="auto", verify="off"), kernels=[], rt=CPU_RT)
    assert first.broken == later.broken == {"toy_sage": "cannot run here"}


def test_counts_made_while_a_graph_runs_survive_counts_traced_in_it():
    """A compiled graph whose traced code counts (the H3 MLP patch under TorchCompileModel) and whose
    opaque op counts at run time (SafeSage's attention op body): before, dynamo replayed the traced
    write of the thread's dict after every run, wiping the op's counts (a headless ComfyUI showed 0
    attention calls and 0 probes under TorchCompileModel while the guard moved blocks)."""
    lib = torch.library.Library("safesage_test_counts", "FRAGMENT")
    lib.define("tick(Tensor x) -> Tensor")

    def tick(x):
        report.count("test_op_ran")
        return x.clone()

    lib.impl("tick", tick, "CompositeExplicitAutograd")
    lib._register_fake("tick", lambda x: torch.empty_like(x))

    def fn(x):
        report.count("test_traced")              # counted in traced code
        c = report.counts()
        c["test_traced_hot"] = c.get("test_traced_hot", 0) + 1
        return torch.ops.safesage_test_counts.tick(x * 2)

    report.count("test_warm")                    # this thread's dict exists (made under the lock) before the trace
    torch._dynamo.reset()
    f = torch.compile(fn, backend="eager")
    for _ in range(3):
        f(torch.ones(4))
    assert report.value("test_op_ran") == 3
    snap = report.snapshot()
    assert not snap.get("test_traced") and not snap.get("test_traced_hot"), "a traced count is a stale replay"


def test_the_mlp_reports_its_largest_intermediates():
    """``mlp_peak_intermediate_bytes``: one chunk's intermediates (mlp_plan.per_token_bytes x its tokens),
    the largest since the last reset; a call that runs unchunked counts its whole input."""
    from safe_ops.models.h3.mlp_plan import per_token_bytes

    class TinyMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(16, 64, bias=False)
            self.fc2 = torch.nn.Linear(32, 16, bias=False)

        def forward(self, x):
            a, b = self.fc1(x).chunk(2, dim=-1)
            return self.fc2(torch.nn.functional.silu(a) * b)

    m = TinyMLP().requires_grad_(False)
    x = torch.randn(200, 16, generator=torch.Generator().manual_seed(0))
    tok = per_token_bytes(16, 32, 4)
    report.reset()
    assert mlp.PEAK_INFO not in report.snapshot()
    mlp.h3_mlp_forward(m, x, 50)
    assert report.snapshot()[mlp.PEAK_INFO] == 50 * tok
    mlp.h3_mlp_forward(m, x, 100)
    mlp.h3_mlp_forward(m, x, 40)                        # smaller: the peak stays
    assert report.snapshot()[mlp.PEAK_INFO] == 100 * tok
    mlp.h3_mlp_forward(m, x, 1000)                      # one chunk would hold it all: ComfyUI's own, unchunked
    assert report.snapshot()[mlp.PEAK_INFO] == 200 * tok
    report.reset()
    assert mlp.PEAK_INFO not in report.snapshot()


def test_info_max_takes_no_lock_once_the_largest_is_known(monkeypatch):
    """The MLP reports its peak on every call: a value not above the known largest returns without the
    store's lock; a larger one still goes through it."""
    entered = []

    class Counting:
        def __init__(self, lock):
            self.lock = lock

        def __enter__(self):
            entered.append(1)
            return self.lock.__enter__()

        def __exit__(self, *exc):
            return self.lock.__exit__(*exc)
    report.reset()
    monkeypatch.setattr(report, "_lock", Counting(report._lock))
    report.info_max("peak_test", 10)
    n = len(entered)
    for v in (3, 10, 7):
        report.info_max("peak_test", v)
    assert len(entered) == n, "no lock for values not above the largest"
    report.info_max("peak_test", 11)
    assert len(entered) == n + 1 and report.snapshot()["peak_test"] == 11
    report.reset()


def test_record_call_counts_a_call_once_in_the_threads_own_counts_and_asks_torch_nothing(monkeypatch):
    """The override's record stage: ``attention_calls``, the plan's counter, a section's counter and a
    fallback's reason, in the calling thread's own dict -- no lock, and no second question whether
    torch.compile traces the caller (the override asked once, first)."""
    report.reset()
    sec = report.Section("recordtest", ("moved",))
    report.count("warm")                       # this thread's own counts exist
    lock = CountingLock()
    monkeypatch.setattr(report, "_lock", lock)
    asked = []
    monkeypatch.setattr(report, "_tracing", lambda: asked.append(1) or False)
    report.record_call("plan:direct", sec.key("moved"))
    report.record_call(None)
    assert lock.acquisitions == 0 and asked == [], "no lock, torch not asked"
    report.record_call("plan:sdpa", None, "no kernel takes it", "shape")
    monkeypatch.undo()
    snap = report.snapshot()
    assert snap["attention_calls"] == 3 and snap["plan:direct"] == 1 and snap["plan:sdpa"] == 1, snap
    assert snap["recordtest"]["moved"] == 1 and snap["fallbacks"] == 1
    assert snap["fallback_reasons"] == {"no kernel takes it": 1}
    with pytest.raises(KeyError):
        sec.key("undeclared")
    report.reset()
