"""The SafeSage Attention node's run is contained (issue 45 item 1): ``patch.apply_node``, what the
node's ``execute`` runs, on ComfyUI's own ModelPatcher (a tiny MiniMaxH3Model where the tree has
H3, else a plain module).

Fault sweep, as tests/comfy/test_fault_injection.py does for the sampling path and with its
injector (tests/comfy/test_nodes/fault_injector.py, loaded here from its file): ``sys.setprofile``
records every function of safe_ops/ and nodes/ that ``apply_node`` runs (in a warmed process,
twice, the two agreeing on every call count; the boundary's own code -- contain.py, run_stats.py,
the functions ``contain.boundary`` marks -- apart), then each recorded function raises on every
call, and, where it runs more than once, on its second call only. Each case must: not raise out of
``apply_node``; reach the fault; count it in ``internal_errors``; log it (``internal error in``);
leave the input model as it was; and give either a whole patched clone (the override, the
wrappers, the MLP patches of the un-faulted run; the H3 block index all or none) with the fault's
message in a WARNING line of the status, or the input model itself, unpatched, with "NOT APPLIED"
and the fault's message in the status. Two scenarios: the CPU without guarded kernels (kernel
auto) and the tests' fake guarded families (kernel sage, tests/unit/fake_quality_families.py),
each with an override already on the model, layers that ask for their own attention function,
the quality guard and H3 MLP chunking on.

Refusals stay errors (kernel 'sage' where no sage kernel runs, an invalid input), and what
contain.not_ours calls ComfyUI's (an exception raised through run_comfy, a sticky CUDA error)
passes through uncounted.

Needs COMFYUI_PATH (``bash .ci/run`` sets it in every pass); skipped with the reason otherwise.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import sys
from types import SimpleNamespace

import pytest
import torch

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
if not COMFYUI_PATH or not os.path.isfile(os.path.join(COMFYUI_PATH, "comfy", "model_patcher.py")):
    _reason = "COMFYUI_PATH not set (point it at a ComfyUI tree): the sweep runs on ComfyUI's ModelPatcher"
    print(f"\n[test_node_contained] skipped: {_reason}")
    pytest.skip(_reason, allow_module_level=True)
if COMFYUI_PATH not in sys.path:
    sys.path.insert(0, COMFYUI_PATH)
import comfy.cli_args  # noqa: E402

comfy.cli_args.args.cpu = True  # before comfy.model_management is imported
import comfy.model_management  # noqa: E402,F401
import comfy.model_patcher  # noqa: E402
import comfy.ops  # noqa: E402

from safe_ops import contain, patch  # noqa: E402
from safe_ops.attention.override import SafeAttention  # noqa: E402
from safe_ops.ui import run_stats  # noqa: E402
from tools.harness.tiny_models import H3_CONFIG  # noqa: E402

try:
    import comfy.ldm.minimax.model as h3
except Exception:  # noqa: BLE001 - 0.3.75 has no H3: a plain module stands in
    h3 = None

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INJECTOR = os.path.join(ROOT, "tests", "comfy", "test_nodes", "fault_injector.py")
SETTINGS = dict(kernel="auto", mlp_chunking="tokens", mlp_chunk_tokens=16, verify="first", debug_sync=False,
                quality="balanced", probe_step=2, exact_steps=1)
FAULT = "SafeSage test fault injected in "


def _injector():
    """tests/comfy/test_nodes/fault_injector.py, under the name its raising code imports."""
    mod = sys.modules.get("safesage_fault_injector")
    if mod is None:
        spec = importlib.util.spec_from_file_location("safesage_fault_injector", INJECTOR)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["safesage_fault_injector"] = mod
        spec.loader.exec_module(mod)
    mod.ROOT = os.path.realpath(ROOT)
    return mod


def their_attention(*args, **kwargs):          # a layer's own attention function (newer ComfyUI)
    raise AssertionError("not called while patching")


def someone_elses_override(func, *args, **kwargs):
    return func(*args, **kwargs)


def _model():
    """A fresh ModelPatcher: the tiny H3 (two blocks: a fault on the block index's second block
    leaves the first one installed; one token-refiner block) or, without H3, a
    plain module with a ``blocks.0``; another pack's override on it, and layers asking for their own
    attention (one under ``blocks.<i>``, one not)."""
    if h3 is not None:
        dm = h3.MiniMaxH3Model(**{**H3_CONFIG, "num_layers": 2}, dtype=torch.float32, device="cpu", operations=comfy.ops.manual_cast)
        told, untold = dm.blocks[0], next(m for n, m in dm.named_modules() if n and not n.startswith("blocks"))
    else:
        dm = torch.nn.Module()
        dm.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
        dm.proj = torch.nn.Linear(4, 4)
        told, untold = dm.blocks[0], dm.proj
    for mod in (told, untold):
        mod.comfy_attention = SimpleNamespace(function=their_attention)
    base = torch.nn.Module()
    base.diffusion_model = dm
    mp = comfy.model_patcher.ModelPatcher(base, torch.device("cpu"), torch.device("cpu"))
    mp.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = someone_elses_override
    return mp


def _frozen(v):
    """A value's structure, with identities at the leaves: equal iff nothing in it was changed."""
    if isinstance(v, dict):
        return tuple(sorted(((repr(k), _frozen(x)) for k, x in v.items())))
    if isinstance(v, (list, tuple)):
        return tuple(_frozen(x) for x in v)
    return id(v)


def _state(mp) -> tuple:
    return _frozen(mp.model_options), _frozen(mp.wrappers), _frozen(mp.object_patches)


def _patches(mp) -> dict:
    """What SafeSage installs on a clone, by name: the override's type and chain, the wrappers, the
    object patches, the per-block patches."""
    to = mp.model_options.get("transformer_options", {})
    att = to.get(patch.OVERRIDE_KEY)
    return {"override": (type(att).__name__, getattr(att, "previous", None)),
            "wrappers": sorted((str(t), k) for t, d in mp.wrappers.items() for k in d),
            "object_patches": sorted(mp.object_patches),
            "blocks": sorted(map(repr, (to.get("patches_replace") or {}).get("dit", {})))}


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    """ComfyUI's cast functions as they were before the test (the MLP patch wraps them once, for
    the process); the stats store empty."""
    for owner, name in ((comfy.ops, "cast_bias_weight"), (comfy.ops, "uncast_bias_weight"),
                        (comfy.model_management, "get_cast_buffer"), (comfy.model_management, "get_aimdo_cast_buffer")):
        if hasattr(owner, name):
            monkeypatch.setattr(owner, name, getattr(owner, name))
    run_stats.reset()
    yield
    run_stats.reset()


def _record(inj, settings) -> dict:
    """The functions apply_node runs, recorded in a warmed process (one call first), twice."""
    recs = []
    for i in range(3):
        mp = _model()
        rec = inj.Recorder()
        if i:
            sys.setprofile(rec)
        try:
            out = patch.apply_node(mp, **settings)
        finally:
            sys.setprofile(None)
        assert out.patched and out.model is not mp and "internal error" not in out.text, out.text
        if i:
            recs.append(rec.result())
            rec._frames.clear()
    counts = [{f["key"]: f["calls"] for f in r["functions"]} for r in recs]
    assert counts[0] == counts[1], {k: (counts[0].get(k), counts[1].get(k)) for k in set(counts[0]) | set(counts[1])
                                    if counts[0].get(k) != counts[1].get(k)}
    return recs[1]


def _sweep(caplog, settings, name, must_run=()) -> None:
    inj = _injector()
    ref_in = _model()
    ref = patch.apply_node(ref_in, **settings)
    whole = _patches(ref.model)
    rec = _record(inj, settings)
    keys = [f["key"] for f in rec["functions"]]
    missing = [m for m in must_run if not any(k.startswith(m) for k in keys)]
    assert not missing, "the recording lacks %s: %s" % (missing, keys)
    print("\n[%s] %d functions recorded; boundary (not injected): %s" % (
        name, len(keys), ", ".join(f["key"] for f in rec["boundary"])))
    cases = [(f["key"], 0) for f in rec["functions"]] + [(f["key"], 2) for f in rec["functions"] if f["calls"] >= 2]
    failures, outcome = [], {"patched": 0, "unpatched": 0}
    for key, only_call in cases:
        what = "%s%s" % (key, " (2nd call only)" if only_call else "")
        mp = _model()
        before = _state(mp)
        run_stats.reset()
        caplog.clear()
        injection = inj.Injection(key, only_call)
        try:
            with caplog.at_level(logging.WARNING, logger="SafeSage"), injection:
                out = patch.apply_node(mp, **settings)
        except Exception as e:  # noqa: BLE001 - what the node's execute would have raised
            failures.append("%s: raised %s: %s" % (what, type(e).__name__, e))
            continue
        hits = injection.counts()["hits"]
        if hits < 1:
            failures.append("%s: the fault was never reached (%s)" % (what, injection.counts()))
            continue
        wrong = []
        if run_stats.value("internal_errors") < 1:
            wrong.append("not counted in internal_errors")
        if not any("internal error in" in r.getMessage() and r.levelno >= logging.ERROR for r in caplog.records):
            wrong.append("not logged")
        if _state(mp) != before:
            wrong.append("the input model was changed")
        said = [ln for ln in out.text.splitlines() if FAULT + key in ln]
        if out.patched:
            outcome["patched"] += 1
            if out.model is mp:
                wrong.append("patched, but the model is the input itself")
            elif _patches(out.model) != whole and _patches(out.model) != {**whole, "blocks": []}:
                wrong.append("a half-patched clone: %s, un-faulted %s" % (_patches(out.model), whole))
            if not any(ln.startswith("WARNING: ") for ln in said):
                wrong.append("no WARNING line in the status names the fault:\n" + out.text)
        else:
            outcome["unpatched"] += 1
            if out.model is not mp:
                wrong.append("not patched, yet not the input model")
            if not (said and out.text.startswith("SafeSage NOT APPLIED")):
                wrong.append("the status does not say why the model is unpatched:\n" + out.text)
        if wrong:
            failures.append("%s: %s" % (what, "; ".join(wrong)))
    print("[%s] %d cases: %d gave a patched clone, %d the model unpatched" % (
        name, len(cases), outcome["patched"], outcome["unpatched"]))
    assert not failures, "%d of %d injections broke containment:\n%s" % (len(failures), len(cases),
                                                                          "\n".join(failures))
    # both outcomes are on the path (else the sweep tells one of them nothing)
    assert outcome["patched"] and outcome["unpatched"], outcome


# what each scenario's recording must hold (module and qualified name: they survive moves in a file)
MUST_RUN = ("safe_ops/patch.py:apply_safesage:", "safe_ops/patch.py:layer_attention_functions:",
            "safe_ops/patch.py:_quality_line:", "safe_ops/attention/kernel_choice.py:explain_auto:",
            "safe_ops/ui/status.py:process_lines:", "safe_ops/ui/status.py:limits_lines:",
            "safe_ops/attention/speed_budget.py:budget_line:",
            "safe_ops/attention/override.py:SafeAttention.__init__:", "safe_ops/policy.py:Policy.__post_init__:")
H3_MUST_RUN = ("safe_ops/models/h3/mlp_patch.py:install_h3_mlp_patches:", "safe_ops/quality/blocks.py:install_block_index:")


def _must_run():
    if h3 is None:
        print("\n[test_node_contained] this ComfyUI has no MiniMax H3 (0.3.75): a plain module stands in, so the "
              "MLP patch and the block index return early")
        return MUST_RUN
    return MUST_RUN + H3_MUST_RUN


def test_a_fault_at_node_time_never_fails_the_prompt_cpu(caplog):
    _sweep(caplog, SETTINGS, "node_cpu", _must_run())


def test_refusals_stay_errors_and_comfys_exceptions_pass_through(monkeypatch):
    mp = _model()
    before = _state(mp)
    with pytest.raises(patch.SafeSageError, match="kernel='sage'"):          # no sage kernel on this CPU
        patch.apply_node(mp, **{**SETTINGS, "kernel": "sage"})
    with pytest.raises(ValueError, match="SafeSage: verify"):
        patch.apply_node(mp, **{**SETTINGS, "verify": "sometimes"})

    class ComfyInterrupt(Exception):
        """Stands in for comfy.model_management.InterruptProcessingException."""

    def comfys(*a, **k):
        raise ComfyInterrupt("interrupted")

    monkeypatch.setattr(patch, "install_h3_mlp_patches", lambda m, s: contain.run_comfy(comfys))
    with pytest.raises(ComfyInterrupt):
        patch.apply_node(mp, **SETTINGS)
    monkeypatch.setattr(patch, "explain_auto", lambda *a: (_ for _ in ()).throw(
        RuntimeError("CUDA error: an illegal memory access was encountered")))
    monkeypatch.setattr(patch, "install_h3_mlp_patches", lambda m, s: {"patched": 0, "skipped": "stand-in"})
    with pytest.raises(RuntimeError, match="illegal memory access"):
        patch.apply_node(mp, **SETTINGS)
    assert run_stats.value("internal_errors") == 0
    assert _state(mp) == before


def test_an_explain_fault_gives_a_patched_model_with_a_shorter_status(monkeypatch):
    """The issue's case: the status line's helper raises; the model is patched, that line is left out."""
    ok = patch.apply_node(_model(), **SETTINGS)
    assert ok.patched and "auto picked" in ok.text

    def explain_auto(*a, **k):
        raise RuntimeError("a bug in the status line")

    monkeypatch.setattr(patch, "explain_auto", explain_auto)
    mp = _model()
    out = patch.apply_node(mp, **SETTINGS)
    assert out.patched and out.model is not mp and _patches(out.model) == _patches(ok.model)
    assert "auto picked" not in out.text and "a bug in the status line" in out.text
    assert len(out.text.splitlines()) == len(ok.text.splitlines()), "one line out, one WARNING line in"
    assert run_stats.value("internal_errors") == 1


def test_a_clone_that_shares_the_models_options_is_never_patched():
    """Never patched in place: a ModelPatcher whose clone() hands back itself, or a clone sharing its
    transformer_options, is given back unpatched, nothing installed on it."""
    def itself(mp):
        return mp

    def sharing(mp):
        c = comfy.model_patcher.ModelPatcher.clone(mp)
        c.model_options["transformer_options"] = mp.model_options["transformer_options"]
        return c

    for bad in (itself, sharing):
        mp = _model()
        before = _state(mp)
        mp.clone = lambda: bad(mp)
        run_stats.reset()
        out = patch.apply_node(mp, **SETTINGS)
        assert not out.patched and out.model is mp and _state(mp) == before, bad.__name__
        assert out.text.startswith("SafeSage NOT APPLIED") and "in place" in out.text, out.text
        assert run_stats.value("internal_errors") == 1


def _node():
    """nodes/safe_sage.py's SafeSageAttention, the pack imported as ComfyUI imports it (a package,
    comfy.model_management already imported) under a name of its own."""
    if importlib.util.find_spec("comfy_api") is None:
        pytest.skip("this ComfyUI tree has no comfy_api")
    name = "safesage_pack_test_node"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "__init__.py"),
                                                      submodule_search_locations=[ROOT])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name].nodes


def test_the_node_outputs_what_safe_ops_gives_and_never_a_model_patched_in_place(monkeypatch):
    """execute passes safe_ops' model and status on: the input itself where safe_ops patched nothing,
    and a RuntimeError where safe_ops says it patched yet hands back the input (patched in place)."""
    nodes = _node()
    inputs = dict(kernel="auto", mlp_chunking="auto", mlp_chunk_tokens=16384, verify="first", debug_sync=False)
    model, clone, seen = object(), object(), []

    def gives(result):
        def apply_node(m, **settings):
            seen.append((m, settings))
            return patch.Applied(result[0], result[1], "status of %s" % (result,), {})
        return apply_node

    monkeypatch.setattr(nodes._backend, "apply_node", gives((model, False)))
    out = nodes.safe_sage.SafeSageAttention.execute(model=model, **inputs)
    assert out.args == (model,) and out.ui.as_dict()["text"] == ("status of %s" % ((model, False),),)
    assert seen[-1][0] is model and seen[-1][1]["probe_step"] == 0 and seen[-1][1]["quality"] == "balanced"
    monkeypatch.setattr(nodes._backend, "apply_node", gives((clone, True)))
    assert nodes.safe_sage.SafeSageAttention.execute(model=model, **inputs).args == (clone,)
    monkeypatch.setattr(nodes._backend, "apply_node", gives((model, True)))
    with pytest.raises(RuntimeError, match="in place"):
        nodes.safe_sage.SafeSageAttention.execute(model=model, **inputs)


def test_a_fault_at_node_time_never_fails_the_prompt_guarded(caplog, fresh):
    """The fake guarded families (kernel sage): the refusal's check (which families are of kind
    sage) and the guard's move order in the status run too."""
    _sweep(caplog, {**SETTINGS, "kernel": "sage"}, "node_guarded",
           _must_run() + ("safe_ops/patch.py:_sage_cannot_run:", "safe_ops/attention/move_order.py:"))
