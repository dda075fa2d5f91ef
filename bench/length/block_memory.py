#!/usr/bin/env python3
"""What holds memory at a MiniMax H3 DiT block's peak, per ComfyUI tree and arm (issue 47 item 1, CPU).

ComfyUI's own ``MiniMaxH3Model`` (``comfy/ldm/minimax/model.py`` of the tree on PYTHONPATH) with one
DiT block at H3's real structure -- hidden W (default H3's 5,376), W/96 heads of 128 (H3: 56, attention
width 7,168 = 4/3 W), ffn 8/3 W, rope
over 96 of the 128 head dims, bf16 weights through ``comfy.ops.manual_cast`` -- runs one forward on a
packed sequence of S tokens (64 text, 32 audio, the rest video) under
:class:`bench.common.live_storage.LiveStorages`, as ComfyUI's sampler runs it: the model patcher's
OUTER_SAMPLE and APPLY_MODEL wrappers around it (SafeSage's arms install theirs there), step 1 of 4,
under ``torch.inference_mode``. The peak is taken while the block's forward runs (forward hooks; its
attention and its MLP are separate windows, ``phases``); the model's own holders around the block (the
embedded stream, the rope table, the latents handed in) are in it, the weights are not. The time
embedding is 64 wide (it sizes per-timestep rows, not per-token tensors) and text comes in at the hidden
width (no token refiner); the packed layout is built as ComfyUI's extra_conds does.

Arms (ComfyUI imported with ``--use-pytorch-cross-attention`` on the CPU):

  comfy     ComfyUI's ``attention_pytorch`` and MLP: no SafeSage (the SDPA arm).
  sage      ComfyUI's ``attention_sage`` (``--use-sage-attention``) with ``sageattn`` replaced by
            bench/common/standin_families.py's stand-in, which allocates what sage 2.2.0's sm_120 path
            allocates (int8 q/k, output, transposed V and its fp8 copy) around SDPA's result: the
            unguarded sage arm of the GPU length runs.
  safesage  ``apply_safesage`` on the model patcher (the node's path) over the sage arm's ComfyUI, the
            node's defaults except: kernel "sage" (the guarded family is the same stand-in, kind sage;
            "auto" has no measurement on the CPU and would hand every call on) and MLP chunking at a fixed
            CHUNK tokens (on the GPU "auto" chunks 16,384 tokens, far below S: a constant there too).
            Step 1 of a sampling run, so the quality guard measures the block (1,024 sampled rows and a
            candidate on them): S > 1,024 keeps that constant in S.
  safesage_faults_only  the same with quality "faults only" (no probe).

What the stand-in cannot show: a real kernel's workspace inside its launch, the GPU allocator's slack,
and SafeSage's plans for long sequences (head groups, key chunks: at these sizes every call is one
launch of the whole problem).

Every activation outside attention is linear in S (SDPA's CPU kernel keeps its scores inside the op),
so ``bytes_at_peak = a + b * S`` from >= 3 token counts; ``b / (W * 2)`` is the number of
hidden-state-sized bf16 tensors per token at the peak. Run per tree (ComfyUI from PYTHONPATH; this
file edits no sys.path), merged into one JSON:

    PYTHONPATH=<ComfyUI 0dd9b154> python3 -m bench.length.block_memory --tree-label 0dd9b154 --merge \\
        --out bench/results/block_memory_cpu.json
    PYTHONPATH=<ComfyUI 783545f6> python3 -m bench.length.block_memory --tree-label 783545f6 --merge \\
        --out bench/results/block_memory_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import types

from bench.common.cmdline import command, write_json

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
H3_WIDTH = 5376
HEAD_DIM = 128
TEXT, AUDIO_T, LAT_HW = 64, 16, 16            # text tokens, audio latent frames (x2 channels), latent h = w
CHUNK = 256                                   # the safesage arm's MLP chunk (tokens)
ARMS = ("comfy", "sage", "safesage", "safesage_faults_only")
#: what runs each arm's attention calls
ARM_ATTENTION = {
    "comfy": "ComfyUI's attention_pytorch",
    "sage": "ComfyUI's attention_sage, sageattn = bench/common/standin_families.py's sage 2.2 sm_120 stand-in",
    "safesage": "SafeSage's override (guarded standin_sage, quality guard step 1) over ComfyUI's attention_sage",
    "safesage_faults_only": "SafeSage's override (guarded standin_sage, quality 'faults only') over ComfyUI's attention_sage",
}
STEPS = 4                                     # the sampling schedule step 1 belongs to
EXTRA_FAMILIES = "bench.common.standin_families"


def comfy_tree() -> str:
    """The ComfyUI tree PYTHONPATH imports; exits saying what to set when it has no H3."""
    from tools.harness.comfy_attention_fn import imported_comfy
    tree = imported_comfy()
    if tree is None or not os.path.isfile(os.path.join(tree, "comfy", "ldm", "minimax", "model.py")):
        sys.exit("bench.length.block_memory: put a ComfyUI tree with MiniMax H3 (0dd9b154 or later) on PYTHONPATH: "
                 "PYTHONPATH=<ComfyUI tree> python3 -m bench.length.block_memory ...")
    return tree


def comfy_modules():
    """ComfyUI's modules, imported for the CPU with PyTorch attention (before model_management)."""
    import comfy.cli_args
    comfy.cli_args.args.cpu = True
    comfy.cli_args.args.use_pytorch_cross_attention = True
    import comfy.ldm.minimax.model as h3
    import comfy.ldm.modules.attention as attention
    import comfy.model_patcher
    import comfy.ops
    return h3, attention, comfy.model_patcher, comfy.ops


def heads_of(width: int) -> int:
    """H3's heads for ``width``: 56 heads of 128 at 5,376 (the attention is 4/3 of the hidden width)."""
    return width * 4 // 3 // HEAD_DIM


def config(width: int) -> dict:
    if width % (3 * HEAD_DIM):
        raise ValueError(f"width must be a multiple of {3 * HEAD_DIM} (H3: 5376 = 14 x {3 * HEAD_DIM}: 56 heads of "
                         f"{HEAD_DIM}, attention 4/3 of the width, ffn 8/3 of it)")
    return dict(hidden_size=width, num_layers=1, token_refiner_num_layers=0, num_attention_heads=heads_of(width),
                attention_head_dim=HEAD_DIM, ffn_hidden_size=width * 8 // 3, latents_dim=24, audio_latents_dim=32,
                text_dim=width, timestep_input_dim=256, time_embed_hidden_size=64, time_embed_dim=64,
                rope_inv_freq_len=16)


def build_model(width: int, seed: int = 0):
    """ComfyUI's MiniMaxH3Model, one block, bf16, fan-in scaled random weights (blocks change the stream)."""
    import torch
    h3, _, _, ops = comfy_modules()
    torch.manual_seed(seed)
    dm = h3.MiniMaxH3Model(**config(width), dtype=torch.bfloat16, device="cpu", operations=ops.manual_cast)
    with torch.no_grad():
        for name, p in list(dm.named_parameters()) + list(dm.named_buffers()):
            if name == "rope.inv_freq":
                n = p.shape[0]
                p.copy_(1.0 / (10000.0 ** (torch.arange(n, dtype=torch.float32) / n)))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape) * p[0].numel() ** -0.5)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape) * 0.02)
            else:
                p.fill_(1.0)
    dm.requires_grad_(False)
    return dm


def video_frames(tokens: int) -> int:
    """Latent video frames giving at least ``tokens`` packed tokens (64 per frame)."""
    per = (LAT_HW // 2) ** 2
    return max(1, -(-(tokens - TEXT - 2 * AUDIO_T) // per))


def inputs(width: int, frames: int, seed: int = 1) -> dict:
    import torch
    h3, _, _, _ = comfy_modules()
    g = torch.Generator().manual_seed(seed)
    video = torch.randn(1, 24, frames, LAT_HW, LAT_HW, generator=g)
    audio = torch.randn(1, 32, 2, AUDIO_T, generator=g)
    context = torch.randn(1, TEXT, width, generator=g).to(torch.bfloat16)
    layout = h3.PackedLayout(TEXT, frames, LAT_HW, LAT_HW, AUDIO_T)
    return {"x": [video, audio], "timestep": torch.tensor([500.0]), "context": context,
            "payload": {"layout": layout}, "tokens": int(layout.seq_len)}


def _sigmas(step: int, steps: int = STEPS) -> dict:
    import torch
    sched = torch.linspace(1.0, 0.0, steps + 1)
    return {"sigmas": sched[step - 1:step].clone(), "sample_sigmas": sched}


class _SageFlag:
    """``--use-sage-attention`` for one arm: H3's ``optimized_attention`` is ComfyUI's ``attention_sage``,
    whose ``sageattn`` is the stand-in (restored on exit)."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        if self.on:
            from bench.common import standin_families
            h3, attention, _, _ = comfy_modules()
            self.saved = (h3.optimized_attention, getattr(attention, "sageattn", None))
            h3.optimized_attention = attention.attention_sage
            attention.sageattn = standin_families.sageattn
        return self

    def __exit__(self, *exc):
        if self.on:
            h3, attention, _, _ = comfy_modules()
            h3.optimized_attention, sageattn = self.saved
            if sageattn is None:
                del attention.sageattn
            else:
                attention.sageattn = sageattn


def _patcher(dm, arm: str):
    """The model patcher of ``arm`` (SafeSage applied through its public ``apply_safesage``)."""
    import torch
    _, _, model_patcher, _ = comfy_modules()
    base = torch.nn.Module()
    base.diffusion_model = dm
    p = model_patcher.ModelPatcher(base, torch.device("cpu"), torch.device("cpu"))
    if not arm.startswith("safesage"):
        return p
    from safe_ops.patch import apply_safesage
    from safe_ops.policy import Policy
    quality = "faults only" if arm == "safesage_faults_only" else Policy().quality
    m, _ = apply_safesage(p, Policy(kernel="sage", mlp_chunking="tokens", mlp_chunk_tokens=CHUNK, quality=quality))
    return m


def _sample(m, forward):
    """``forward(transformer_options)`` as ComfyUI's sampler runs a model evaluation: the patcher's
    OUTER_SAMPLE wrappers (their executor's ``class_obj`` a guider holding ``m``, as CFGGuider's) around
    its APPLY_MODEL wrappers (``BaseModel.apply_model``'s arguments)."""
    import comfy.patcher_extension as pe
    to = pe.copy_nested_dicts(m.model_options.get("transformer_options", {}))
    pe.merge_nested_dicts(to.setdefault("wrappers", {}), m.wrappers, copy_dict1=False)
    to.update(_sigmas(1))

    def apply_model(x, t, c_concat=None, c_crossattn=None, control=None, transformer_options={}, **kw):
        return forward(transformer_options)

    def outer_sample(*args, **kwargs):
        return pe.WrapperExecutor.new_executor(
            apply_model, pe.get_all_wrappers(pe.WrappersMP.APPLY_MODEL, to)).execute(None, None, None, None, None, to)

    guider = types.SimpleNamespace(model_patcher=m)      # what CFGGuider hands its OUTER_SAMPLE wrappers
    return pe.WrapperExecutor.new_class_executor(outer_sample, guider,
                                                 pe.get_all_wrappers(pe.WrappersMP.OUTER_SAMPLE, to)).execute()


def measure(dm, arm: str, frames: int, depth: int = 4) -> dict:
    """One forward of ``dm`` under ``arm`` with the tracker: the block's peak, live storages there."""
    import torch
    from bench.common.live_storage import LiveStorages
    inp = inputs(dm.hidden_size, frames)
    tr = LiveStorages(depth=depth, roots=(comfy_tree(), ROOT), window=False)
    block = dm.blocks[0]
    hooks = []
    for mod, phase in ((block, "block"), (block.attn, "attention"), (block.mlp, "mlp")):
        hooks += [mod.register_forward_pre_hook(lambda *a, phase=phase: tr.enter(phase)),
                  mod.register_forward_hook(lambda *a: tr.leave())]
    m = _patcher(dm, arm)

    def forward(to):
        with tr:
            return dm(inp["x"], inp["timestep"], inp["context"], transformer_options=to,
                      minimax_payload=inp["payload"])
    try:
        with torch.inference_mode(), _SageFlag(arm != "comfy"):
            for name, t in (("model input: video latent", inp["x"][0]), ("model input: audio latent", inp["x"][1]),
                            ("model input: context", inp["context"])):
                tr.add(t, name)
            m.patch_model()
            try:
                out = _sample(m, forward)
            finally:
                m.unpatch_model()
        finite = bool(torch.isfinite(out[0]).all())
    finally:
        for h in hooks:
            h.remove()
    return {"tokens": inp["tokens"], "frames": frames, "peak_bytes": tr.peak, "peak_phase": tr.peak_phase,
            "phase_peaks": dict(tr.phase_peaks), "finite": finite, "allocations": tr.allocations,
            "at_peak": tr.at_peak}


def _hs(tokens: int, width: int) -> int:
    return tokens * width * 2


def summarise(runs: list, width: int, top: int = 15) -> dict:
    """Per arm: the fit over token counts (the block's peak and each phase's), the top sites at the
    largest run's peak (bytes, and ``units``: in one S x W bf16 hidden state)."""
    from bench.common.live_storage import fit_linear, top_sites
    xs = [r["tokens"] for r in runs]

    def fit(ys):
        a, b, resid = fit_linear(xs, ys)
        return {"constant_bytes": round(a), "bytes_per_token": round(b, 1),
                "hidden_states_per_token": round(b / (width * 2), 3), "fit_max_residual_bytes": round(resid)}

    big = max(runs, key=lambda r: r["tokens"])
    hs = _hs(big["tokens"], width)
    hidden_sized = sum(1 for s in big["at_peak"] if abs(s.nbytes - hs) <= hs // 64)
    phases = sorted({p for r in runs for p in r["phase_peaks"]})
    return {
        "points": [{"tokens": r["tokens"], "peak_bytes": r["peak_bytes"], "peak_phase": r["peak_phase"],
                    "finite": r["finite"]} for r in runs],
        **fit([r["peak_bytes"] for r in runs]),
        "phases": {p: fit([r["phase_peaks"].get(p, 0) for r in runs]) for p in phases},
        "at_tokens": big["tokens"], "peak_bytes": big["peak_bytes"], "peak_phase": big["peak_phase"],
        "peak_hidden_states": round(big["peak_bytes"] / hs, 3),
        "hidden_state_sized_storages_at_peak": hidden_sized,
        "top_sites": [g.as_dict(hs) for g in top_sites(big["at_peak"], top)],
    }


def _rev(path: str) -> str | None:
    """``git rev-parse --short HEAD`` of ``path``, ``+dirty`` with tracked changes; None outside git."""
    try:
        r = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        d = subprocess.run(["git", "-C", path, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
        return (r.stdout.strip() + ("+dirty" if d else "")) if r.returncode == 0 and r.stdout.strip() else None
    except OSError:
        return None


def _comfy_version(tree: str) -> str | None:
    try:
        with open(os.path.join(tree, "comfyui_version.py")) as f:
            return next((ln.split("=", 1)[1].strip().strip("\"'") for ln in f if ln.startswith("__version__")), None)
    except OSError:
        return None


def run_tree(width: int, tokens: list, arms: tuple, top: int = 15) -> dict:
    dm = build_model(width)
    _, attention, _, _ = comfy_modules()
    out = {"width": width, "heads": heads_of(width), "ffn": width * 8 // 3, "mlp_chunk_tokens_safesage": CHUNK,
           "comfy_default_attention": getattr(attention.optimized_attention, "__name__", "?"), "arms": {}}
    from bench.common import standin_families
    for arm in arms:
        before = dict(standin_families.LAUNCHES)
        runs = [measure(dm, arm, video_frames(t)) for t in tokens]
        out["arms"][arm] = {"attention": ARM_ATTENTION[arm], **summarise(runs, width, top),
                            "stand_in_launches": {k: v - before[k] for k, v in standin_families.LAUNCHES.items()
                                                  if v != before[k]}}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree-label", required=True, help="the ComfyUI tree's name in the JSON (e.g. 0dd9b154)")
    ap.add_argument("--width", type=int, default=H3_WIDTH)
    ap.add_argument("--tokens", default="4192,6240,8288",
                    help="packed token counts (>= 3; above ~4,000 the probe's 1,024 rows stop setting the peak)")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--merge", action="store_true", help="add this tree to --out's existing JSON")
    a = ap.parse_args(argv)
    os.environ["SAFESAGE_EXTRA_FAMILIES"] = EXTRA_FAMILIES       # before safe_ops' registry is imported
    tree = comfy_tree()
    import torch
    torch.set_num_threads(a.threads)
    tokens = [int(t) for t in a.tokens.split(",")]
    arms = tuple(x for x in a.arms.split(",") if x)
    t0 = time.time()
    res = run_tree(a.width, tokens, arms, a.top)
    res.update({"command": f"PYTHONPATH=<ComfyUI {a.tree_label}> " + command("length.block_memory"),
                "comfyui_tree": tree.replace(os.path.expanduser("~"), "~"), "comfyui_version": _comfy_version(tree),
                "comfyui_git": _rev(tree), "repo_rev": _rev(ROOT), "torch": torch.__version__, "threads": a.threads,
                "python": platform.python_version(), "wall_s": round(time.time() - t0, 1),
                "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    doc = {}
    if a.out and a.merge and os.path.exists(a.out):
        with open(a.out) as f:
            doc = json.load(f)
    doc.setdefault("bench", "bench/length/block_memory.py: live tensor storages at an H3 DiT block's peak (CPU)")
    doc.setdefault("trees", {})[a.tree_label] = res
    write_json(doc, a.out)
    return doc


if __name__ == "__main__":
    main()
