"""Apply SafeSage to a ComfyUI ModelPatcher: clone, override attention, patch H3 MLPs, mark runs.

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
from typing import Any

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
from .ui.status import process_lines

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


def apply_safesage(model_patcher: Any, policy: Policy = Policy(), node: str | None = None) -> tuple[Any, dict]:
    """Return a patched clone of ``model_patcher`` and a summary (``summary["text"]`` for humans).
    ``node``: ComfyUI's id of the SafeSage node (a subgraph node's path, e.g. ``"7:3"``), under which
    the quality guard publishes its outcome (quality/report.py); None outside a node."""
    rt = runtime()
    lines = [f"SafeSage: {rt.summary()}"]
    warnings: list[str] = []
    if policy.kernel == "sage" and rt.sage_family is None and not any(
            family_kind(k.family) == "sage" for k in installed_kernels(rt)):   # an extra family of kind sage
        raise SafeSageError(
            f"kernel='sage' was chosen but SageAttention cannot run here: {rt.sage_error}. "
            "Install a sageattention build that matches your torch/CUDA (see the pack README), "
            "or set kernel to 'auto' (uses SageAttention when it is usable, else ComfyUI's own attention).")

    m = model_patcher.clone()
    to = m.model_options.setdefault("transformer_options", {})
    prev = to.get(OVERRIDE_KEY)
    if isinstance(prev, SafeAttention):       # an earlier SafeSage node: replaced, its chain kept
        prev = prev.previous
    layer_fns, layer_lines = layer_attention_functions(_diffusion_model(m))
    attn = SafeAttention(policy, rt=rt, previous=prev, layer_functions=layer_fns)
    attn.quality.node = None if node is None else str(node)
    to[OVERRIDE_KEY] = attn
    if prev is not None:
        kind = attn.previous_kind
        lines.append(f"chained after the attention override already on the model ({function_name(prev)}): it runs "
                     "every call SafeSage does not give to a guarded kernel"
                     + (f"; it runs {kind} unguarded, so calls outside that kernel's limits go to ComfyUI's "
                        "attention_pytorch instead" if kind else ""))
    lines += layer_lines
    if attn.quality.active:
        try:
            nb = install_block_index(m, _diffusion_model(m))
            attn.quality.base_marked = nb > 0
        except Exception as e:  # noqa: BLE001 - see contain.py
            contain.internal_error(e, "installing the H3 block index", "blocks are told apart by call order")
            nb = 0
        lines.append(_quality_line(policy, attn, nb))

    # Count forwards, and mark where a sampling run ends (idempotent: removed, then added under
    # a fixed key).
    wrappers_mp = None
    installed: set = set()
    try:
        from comfy.patcher_extension import WrappersMP as wrappers_mp  # type: ignore
    except Exception:
        pass
    if wrappers_mp is not None and hasattr(m, "add_wrapper_with_key"):
        for name, fn in WRAPPERS.items():
            wtype = getattr(wrappers_mp, name, None)
            if wtype is None:
                continue
            if hasattr(m, "remove_wrappers_with_key"):
                m.remove_wrappers_with_key(wtype, WRAPPER_KEY)
            m.add_wrapper_with_key(wtype, WRAPPER_KEY, fn)
            installed.add(name)
    if attn.quality.active and attn.may_guard and "APPLY_MODEL" not in installed:
        # no step is ever read: the guard measures nothing and moves nothing (said, not implied)
        warnings.append("the quality guard is off: this ComfyUI has no APPLY_MODEL model wrappers "
                        "(comfy.patcher_extension.WrappersMP), so SafeSage cannot tell sampling steps apart; "
                        "attention runs as planned with the first-call fault checks only")

    # Always called: with "off" it removes MLP patches an earlier SafeSage node left on this model.
    setting: Any = policy.mlp_chunk_tokens if policy.mlp_chunking == "tokens" else policy.mlp_chunking
    mlp_summary = install_h3_mlp_patches(m, setting)
    if policy.mlp_chunking == "off":
        mlp_summary["skipped"] = "MLP chunking off" + (f" (removed {mlp_summary['removed']} earlier patches)"
                                                       if mlp_summary.get("removed") else "")
    for c in mlp_summary.get("conflicts", []) or []:
        warnings.append(f"MLP patch conflict: {c}")
    run_stats.set_info("mlp_patched", mlp_summary.get("patched", 0))

    # ComfyUI's own choice (--use-sage-attention / --use-ck-attention) read from its flags
    cand = attn.candidates(None)
    lines.append(f"kernel policy '{policy.kernel}': preference {' > '.join(cand)}")
    lines.append(explain_auto(rt, attn.planning_families(), None, policy.kernel))
    if rt.sage_family is None and policy.kernel == "auto":
        lines.append(f"SageAttention not used: {rt.sage_error}"
                     + ("; attention runs ComfyUI's own function" if cand[0] == "sdpa" else ""))
    lines.append(f"verify: {policy.verify}; debug_sync: {'on' if policy.debug_sync else 'off'}")
    if mlp_summary.get("patched"):
        lines.append(f"H3 MLPs patched: {mlp_summary['patched']} (chunking {policy.mlp_chunking})")
    else:
        lines.append(f"H3 MLPs not patched: {mlp_summary.get('skipped')}")
    lines += process_lines(run_stats.snapshot())     # what earlier prompts switched off
    for w in warnings:
        lines.append("WARNING: " + w)
        log.warning("SafeSage: %s", w)
    text = "\n".join(lines)
    log.info("%s", text)
    return m, {"text": text, "runtime": rt.summary(), "candidates": cand, "mlp": mlp_summary,
               "warnings": warnings}
