"""Apply SafeSage to a ComfyUI ModelPatcher: clone, override attention, patch H3 MLPs, mark runs.

:func:`apply_node` is the SafeSage Attention node's whole run, contained (contain.py's rules): an
error of SafeSage's own code gives the model patched with less said about it, or -- where the
clone could not be made whole -- the node's input unpatched, with the reason in its status.

ComfyUI is imported lazily and every hook is looked up with ``getattr`` so the
pack loads on ComfyUI 0.3.75 (no MiniMax H3, no dynamic VRAM) and on 0dd9b154+.
Idempotent: applying twice (or to a clone of a patched model) replaces the
pack's own hooks under fixed keys. An attention override already on the model (another
pack's, core's ``ModelAttentionBackend``) is chained, not replaced: it runs every call
SafeSage does not give to a guarded kernel. Layers that ask ComfyUI for their own attention
function (newer ComfyUI's per-module ``comfy_attention``) are read here and reported.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple

from .facts import compiler
from . import contain
from .ui import run_stats
from .attention.override import SafeAttention
from .attention.special_calls import capturing, compiling
from .quality import guard as quality_guard
from .quality.blocks import install_block_index
from .attention.comfy_functions import function_name, unguarded_kind
from .models.h3.mlp_patch import install_h3_mlp_patches
from .policy import Policy
from .attention.kernel_choice import explain_auto
from .attention.move_order import describe as describe_moves
from .attention.speed_budget import budget_line
from .facts.devices import runtime
from .families.registry import family_kind, installed_kernels
from .ui.status import limits_lines, process_lines

log = logging.getLogger("SafeSage")

OVERRIDE_KEY = "optimized_attention_override"
WRAPPER_KEY = "safesage"


class SafeSageError(RuntimeError):
    """A choice on the node that cannot be honoured here; the message says what to do."""


@contain.boundary
def _forward_wrapper(executor, *args, **kwargs):
    """APPLY_MODEL wrapper, around each model evaluation (``BaseModel.apply_model``: one
    diffusion-model forward): count the forwards (the node's statistics), have ComfyUI's
    allocation compiler asked again once for this forward, and tell the quality guard a forward
    starts (which step; its one host read, quality/guard.py).

    An APPLY_MODEL wrapper, not a DIFFUSION_MODEL one: ComfyUI's TorchCompileModel swaps a
    ``torch.compile``d ``diffusion_model`` in from an APPLY_MODEL wrapper of its own, and H3's
    ``forward`` runs the DIFFUSION_MODEL wrappers inside it, so a DIFFUSION_MODEL wrapper is
    traced there (HAZARDS H-10): the step reading would be skipped and the count traced once.
    Here all three run eagerly, compiled model or not, whatever the wrappers' order."""
    try:
        _forward_start(args, kwargs)
    except Exception as e:  # noqa: BLE001 - see contain.py
        if contain.not_ours(e):
            raise
        contain.internal_error(e, "the quality guard's step reading", "this forward runs as planned")
    try:
        return executor(*args, **kwargs)
    finally:
        run_stats.count("forwards")


def _forward_start(args: tuple, kwargs: dict) -> None:
    if compiling() or capturing():
        return                       # traced / captured (a caller compiled apply_model itself): no host read
    compiler.forward_started()       # ComfyUI's compiler is asked once in this forward (facts/compiler.py)
    to = kwargs.get("transformer_options")
    if not isinstance(to, dict):     # apply_model takes it positionally (its 6th argument)
        to = next((a for a in args if isinstance(a, dict) and OVERRIDE_KEY in a), None)
    att = to.get(OVERRIDE_KEY) if isinstance(to, dict) else None
    # only where a guarded kernel may run: a model whose every call is ComfyUI's own pays no host read
    if isinstance(att, SafeAttention) and att.quality.active and att.may_guard:
        att.quality.forward_start(to, att.kernel_sites())


@contain.boundary
def _run_wrapper(executor, *args, **kwargs):
    """OUTER_SAMPLE wrapper: the sampling run ends here (also when it raised), so under ComfyUI's
    allocation compiler the next run chooses its plans and chunk sizes again. (A containment
    boundary: an error of SafeSage's in marking the run's end is counted and logged, never raised.)
    It also tells the quality guard which model the run samples (ComfyUI's CFGGuider is the executor's
    ``class_obj``; its ``model_patcher``): what it measured is remembered for that model (quality/memory.py)."""
    try:
        quality_guard.run_started(getattr(getattr(executor, "class_obj", None), "model_patcher", None))
    except Exception as e:  # noqa: BLE001 - see contain.py
        contain.internal_error(e, "the quality guard's run start", "this run's errors are not remembered")
    try:
        return executor(*args, **kwargs)
    finally:
        try:
            quality_guard.run_ended()        # reads what the run's last measured step left
        except Exception as e:  # noqa: BLE001 - see contain.py
            contain.internal_error(e, "the quality guard's run end", "its last report is not shown")
        try:
            compiler.new_run()
        except Exception as e:  # noqa: BLE001 - see contain.py
            contain.internal_error(e, "the sampling-run wrapper", "the next run keeps this run's plans")
        run_stats.count("sampling_runs")


def _diffusion_model(model_patcher) -> Any:
    return getattr(getattr(model_patcher, "model", None), "diffusion_model", None)


def layer_attention_functions(diffusion_model: Any) -> tuple[dict, list[str]]:
    """Which layers ask ComfyUI for an attention function of their own (newer ComfyUI: a module's
    ``comfy_attention.function``, set from the checkpoint or a LoRA; ``wrap_attn`` drops that
    preference before an override sees the call). Returns {block index: function} for the
    layers whose calls carry ``transformer_options["block_index"]`` (``blocks.<i>.``), and the
    status lines: which layers asked for what, and those whose calls cannot be told apart."""
    if diffusion_model is None or not hasattr(diffusion_model, "named_modules"):
        return {}, []
    by_block: dict = {}
    asked: dict[str, tuple] = {}          # function name -> (function, [layer paths])
    untold: list[str] = []
    for path, mod in diffusion_model.named_modules():
        fn = getattr(getattr(mod, "comfy_attention", None), "function", None)
        if fn is None:
            continue
        asked.setdefault(function_name(fn), (fn, []))[1].append(path)
        parts = path.split(".")
        if len(parts) > 1 and parts[0] == "blocks" and parts[1].isdigit():
            by_block[int(parts[1])] = fn
        else:
            untold.append(path)
    lines = []
    for name, (fn, paths) in asked.items():
        kind = unguarded_kind(fn)
        lines.append(f"{len(paths)} layer(s) ask for {name} ({', '.join(paths[:4])}{', ...' if len(paths) > 4 else ''}): "
                     + (f"SafeSage runs its {kind} kernel guarded for them, or ComfyUI's attention_pytorch where it "
                        "cannot" if kind else "SafeSage runs that function for them"))
    if untold:
        lines.append(f"WARNING: {len(untold)} layer(s) ask for their own attention but their calls carry no block "
                     f"index ({', '.join(untold[:4])}): SafeSage cannot tell them apart and treats them like the rest")
    return by_block, lines


def _quality_line(policy: Policy, attn: SafeAttention, blocks: int) -> str:
    """The node's status line for the quality guard."""
    if policy.quality == "faults only":
        head = "quality: faults only (no per-block error measurement)"
    else:
        order = attn.quality_order(None)          # move_order.move_order: the one rule, also Preflight's
        if order:
            head = (f"quality: {policy.quality}: each block's attention error is measured at step 1 against "
                    f"ComfyUI's own attention; a block over its target {describe_moves(order)} from step 2 "
                    "(per block: /safesage/stats, quality_last_run)")
        else:
            head = f"quality: {policy.quality}: {describe_moves(order)}"
        head += f"; blocks told apart by {'the H3 block index' if blocks else 'block_index, else call order'}"
    if policy.quality != "faults only":
        head += "; " + budget_line(policy.quality, policy.kernel, attn.rt.arch_name, attn.rt.device_name,
                                   [f for f in attn.kernels if f != "sdpa"], (attn.candidates(None) or [None])[0])
        head += ("; errors are remembered per model: a later prompt runs the choices from step 1 "
                 "(a LoRA, another kernel build or size measures again)")
    if policy.probe_step:
        head += f"; also measured (report only) at step {policy.probe_step}"
    if policy.exact_steps:
        head += f"; the first and last {policy.exact_steps} step(s) run ComfyUI's own attention"
    return head


# wrapper type (name in comfy.patcher_extension.WrappersMP) -> wrapper
WRAPPERS = {"APPLY_MODEL": _forward_wrapper, "OUTER_SAMPLE": _run_wrapper}


class Applied(NamedTuple):
    """What the SafeSage Attention node outputs (:func:`apply_node`)."""
    model: Any          # a patched clone; the node's input itself only where ``patched`` is False
    patched: bool
    text: str           # the node's status: what was patched, or why the model goes on unpatched
    summary: dict       # apply_safesage's summary ({} where not patched)


@contain.boundary
def apply_node(model_patcher: Any, node: str | None = None, **settings: Any) -> Applied:
    """The SafeSage Attention node's run (``settings``: :class:`Policy`'s fields; ``node``: as
    :func:`apply_safesage`'s), contained: an error in SafeSage's own code never fails the prompt
    (contain.py's rules).

    * Refusals raise, saying what to change: an invalid input (Policy's ``ValueError``), and
      :class:`SafeSageError` (kernel 'sage' where SageAttention cannot run).
    * An error in a part the model is whole without (a status line, the layer scan, the H3 block
      index, the limits lines): the model is patched, that part is left out and a WARNING line
      says so (:func:`_optional`).
    * An error in what patches the model (the runtime's facts, the clone, the override, the
      wrappers, the MLP patches): the model goes on unpatched -- the node's input itself, never a
      half-patched clone (everything is installed on a clone, and nothing on the input) -- and the
      status says why.
    Both are counted (``internal_errors``) and logged with their traceback
    (:func:`contain.internal_error`); what :func:`contain.not_ours` calls ComfyUI's (raised through
    ``run_comfy``; a sticky CUDA error) passes through."""
    try:
        policy = Policy(**settings)
    except ValueError:
        raise                                      # an invalid input, named by its message
    except Exception as e:  # noqa: BLE001 - see contain.py
        if contain.not_ours(e):
            raise
        return _unpatched(model_patcher, e, "reading the node's inputs")
    try:
        m, summary = apply_safesage(model_patcher, policy, node)
    except SafeSageError:
        raise
    except Exception as e:  # noqa: BLE001 - see contain.py
        if contain.not_ours(e):
            raise
        return _unpatched(model_patcher, e, "patching the model")
    more: list[str] = []
    limits = _optional(more, "the kernel limits lines", lambda: limits_lines(runtime(), policy), default=[])
    summary["warnings"] += more
    text = "\n".join([summary["text"], *limits, *("WARNING: " + w for w in more)])
    return Applied(m, True, text, summary)


@contain.boundary
def _unpatched(model_patcher: Any, e: Exception, what: str) -> Applied:
    contain.internal_error(e, f"the SafeSage Attention node ({what})",
                           "the model goes on unpatched (ComfyUI's own attention and MLP)")
    text = (f"SafeSage NOT APPLIED: an internal error of SafeSage's own code while {what}: "
            f"{type(e).__name__}: {e}\n"
            "The model goes on unpatched, as without this node: ComfyUI's own attention and MLP. "
            "Please report it, with the traceback from the log.")
    log.warning("%s", text)
    return Applied(model_patcher, False, text, {})


@contain.boundary
def _optional(warnings: list, what: str, fn: Callable[[], Any], default: Any = None,
              runs: str = "left out of the node's status") -> Any:
    """``fn()``, a part of the node's run the patched model is whole without: an error of
    SafeSage's own code in it is counted and logged (contain.internal_error), a warning for the
    node's status is added to ``warnings``, and ``default`` is returned."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - see contain.py
        if contain.not_ours(e):
            raise
        contain.internal_error(e, what, f"the model is patched; {what}: {runs}")
        warnings.append(f"{what}: {runs} (SafeSage internal error, in the log: {type(e).__name__}: {e})")
        return default


def _sage_cannot_run(rt) -> bool:
    """kernel='sage' asked where no sage-family kernel runs (an extra family of kind sage counts)."""
    return rt.sage_family is None and not any(family_kind(k.family) == "sage" for k in installed_kernels(rt))


def _clone(model_patcher: Any) -> Any:
    """``model_patcher.clone()``, checked before anything is installed on it: SafeSage never patches
    the model it is given (the loader's cached model stays clean)."""
    m = model_patcher.clone()
    opts = getattr(m, "model_options", None)
    if m is model_patcher or opts is getattr(model_patcher, "model_options", None) or (
            isinstance(opts, dict) and opts.get("transformer_options") is not None
            and opts.get("transformer_options") is model_patcher.model_options.get("transformer_options")):
        raise RuntimeError(f"{type(model_patcher).__name__}.clone() shares the model's options with the model "
                           "itself: SafeSage would patch the model in place")
    return m


def _install_wrappers(m: Any) -> set:
    """Count forwards, and mark where a sampling run ends (idempotent: removed, then added under a
    fixed key). Returns the names of the wrapper types installed."""
    installed: set = set()
    try:
        from comfy.patcher_extension import WrappersMP as wrappers_mp  # type: ignore
    except Exception:  # noqa: BLE001 - a ComfyUI without model wrappers
        return installed
    if not hasattr(m, "add_wrapper_with_key"):
        return installed
    for name, fn in WRAPPERS.items():
        wtype = getattr(wrappers_mp, name, None)
        if wtype is None:
            continue
        if hasattr(m, "remove_wrappers_with_key"):
            m.remove_wrappers_with_key(wtype, WRAPPER_KEY)
        m.add_wrapper_with_key(wtype, WRAPPER_KEY, fn)
        installed.add(name)
    return installed


def apply_safesage(model_patcher: Any, policy: Policy = Policy(), node: str | None = None) -> tuple[Any, dict]:
    """Return a patched clone of ``model_patcher`` and a summary (``summary["text"]`` for humans,
    ``summary["warnings"]``). An error here in what patches the clone raises (:func:`apply_node`
    then gives the model back unpatched); one in what only describes it, or in a part the clone is
    whole without, leaves that part out with a warning (:func:`_optional`).
    ``node``: ComfyUI's id of the SafeSage node (a subgraph node's path, e.g. ``"7:3"``), under which
    the quality guard publishes its outcome (quality/report.py); None outside a node."""
    rt = runtime()
    if policy.kernel == "sage" and _sage_cannot_run(rt):
        raise SafeSageError(
            f"kernel='sage' was chosen but SageAttention cannot run here: {rt.sage_error}. "
            "Install a sageattention build that matches your torch/CUDA (see the pack README), "
            "or set kernel to 'auto' (uses SageAttention when it is usable, else ComfyUI's own attention).")
    warnings: list[str] = []
    earlier = run_stats.snapshot()            # what earlier prompts switched off (status)

    # --- what patches the clone: an error here leaves the model unpatched (apply_node)
    m = _clone(model_patcher)
    to = m.model_options.setdefault("transformer_options", {})
    prev = to.get(OVERRIDE_KEY)
    if isinstance(prev, SafeAttention):       # an earlier SafeSage node: replaced, its chain kept
        prev = prev.previous
    layer_fns, layer_lines = _optional(
        warnings, "reading which layers ask for their own attention function",
        lambda: layer_attention_functions(_diffusion_model(m)), default=({}, []),
        runs="not read, so SafeSage treats every layer alike (as it does a layer whose calls carry no block index)")
    attn = SafeAttention(policy, rt=rt, previous=prev, layer_functions=layer_fns)
    attn.quality.node = None if node is None else str(node)
    to[OVERRIDE_KEY] = attn
    installed = _install_wrappers(m)
    # Always called: with "off" it removes MLP patches an earlier SafeSage node left on this model.
    setting: Any = policy.mlp_chunk_tokens if policy.mlp_chunking == "tokens" else policy.mlp_chunking
    mlp_summary = install_h3_mlp_patches(m, setting)
    run_stats.set_info("mlp_patched", mlp_summary.get("patched", 0))
    if policy.mlp_chunking == "off":
        mlp_summary["skipped"] = "MLP chunking off" + (f" (removed {mlp_summary['removed']} earlier patches)"
                                                       if mlp_summary.get("removed") else "")
    for c in mlp_summary.get("conflicts", []) or []:
        warnings.append(f"MLP patch conflict: {c}")

    # --- the clone is whole: what follows adds what it can do without (the H3 block index, all of
    # it or none) and describes it
    nb = _block_index(m, warnings) if attn.quality.active else 0
    attn.quality.base_marked = nb > 0
    rt_line, cand, lines = _optional(
        warnings, "the node's status",
        lambda: _status(warnings, rt, policy, attn, prev, layer_lines, nb, installed, mlp_summary, earlier),
        default=(None, None, ["SafeSage: the model is patched as set (its status could not be written)"]),
        runs="not written")
    for w in warnings:
        lines.append("WARNING: " + w)
        log.warning("SafeSage: %s", w)
    text = "\n".join(lines)
    log.info("%s", text)
    return m, {"text": text, "runtime": rt_line, "candidates": cand, "mlp": mlp_summary, "warnings": warnings}


def _block_index(m: Any, warnings: list) -> int:
    """The H3 block index (quality/blocks.py) on the clone, or none of it: after an error of
    SafeSage's own code while installing it, the clone's per-block patches are put back as they
    were (blocks are then told apart by call order, every block alike). ComfyUI's
    ``set_model_patch_replace`` puts a new ``transformer_options`` dict on the clone per block, so
    the clone's whole ``transformer_options`` is put back (a copy taken before, its per-block
    patches copied a level down in case a ComfyUI writes them in place)."""
    to = m.model_options.setdefault("transformer_options", {})
    kept = dict(to)
    if isinstance(to.get("patches_replace"), dict):
        kept["patches_replace"] = {k: dict(v) if isinstance(v, dict) else v for k, v in to["patches_replace"].items()}
    nb = _optional(warnings, "the H3 block index", lambda: install_block_index(m, _diffusion_model(m)),
                   runs="not installed, so blocks are told apart by call order")
    if nb is not None:
        return nb
    m.model_options["transformer_options"] = kept
    return 0


def _status(warnings: list, rt, policy: Policy, attn: SafeAttention, prev: Any, layer_lines: list[str],
            nb: int, installed: set, mlp_summary: dict, earlier: dict) -> tuple[str | None, list | None, list[str]]:
    """The runtime's summary, the kernel preference and the node's status lines for a patched clone.
    Each line is :func:`_optional`: an error of SafeSage's own code in one leaves that line out
    (and adds a warning)."""
    rt_line = _optional(warnings, "the runtime summary", rt.summary)
    cand = _optional(warnings, "the kernel preference", lambda: attn.candidates(None))
    lines: list[str] = [f"SafeSage: {rt_line or 'the model is patched'}"]

    def line(what: str, fn: Callable[[], Any]) -> None:
        got = _optional(warnings, what, fn)
        if isinstance(got, str):
            lines.append(got)
        elif got:
            lines.extend(got)

    if prev is not None:
        line("the chained override's line", lambda: _chained_line(attn, prev))
    lines += layer_lines
    if attn.quality.active:
        line("the quality guard's line", lambda: _quality_line(policy, attn, nb))
    if attn.quality.active and attn.may_guard and "APPLY_MODEL" not in installed:
        # no step is ever read: the guard measures nothing and moves nothing (said, not implied)
        warnings.append("the quality guard is off: this ComfyUI has no APPLY_MODEL model wrappers "
                        "(comfy.patcher_extension.WrappersMP), so SafeSage cannot tell sampling steps apart; "
                        "attention runs as planned with the first-call fault checks only")
    if cand:
        lines.append(f"kernel policy '{policy.kernel}': preference {' > '.join(cand)}")
    # ComfyUI's own choice (--use-sage-attention / --use-ck-attention) read from its flags
    line("the line on auto's choice", lambda: explain_auto(rt, attn.planning_families(), None, policy.kernel))
    if rt.sage_family is None and policy.kernel == "auto":
        lines.append(f"SageAttention not used: {rt.sage_error}"
                     + ("; attention runs ComfyUI's own function" if cand and cand[0] == "sdpa" else ""))
    lines.append(f"verify: {policy.verify}; debug_sync: {'on' if policy.debug_sync else 'off'}")
    if mlp_summary.get("patched"):
        lines.append(f"H3 MLPs patched: {mlp_summary['patched']} (chunking {policy.mlp_chunking})")
    else:
        lines.append(f"H3 MLPs not patched: {mlp_summary.get('skipped')}")
    line("what earlier prompts switched off", lambda: process_lines(earlier))
    return rt_line, cand, lines


def _chained_line(attn: SafeAttention, prev: Any) -> str:
    kind = attn.previous_kind
    return (f"chained after the attention override already on the model ({function_name(prev)}): it runs "
            "every call SafeSage does not give to a guarded kernel"
            + (f"; it runs {kind} unguarded, so calls outside that kernel's limits go to ComfyUI's "
               "attention_pytorch instead" if kind else ""))

