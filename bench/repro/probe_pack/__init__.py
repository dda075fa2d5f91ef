"""The reproduction harness's own ComfyUI node pack: what the in-process worker used to read from
its own state, read inside a real ComfyUI server. Never shipped with SafeSage.

bench/repro/worker.py symlinks this folder into the custom_nodes of the server it starts for a row
(as safesage_repro_probe) and sets two variables for that server:

  SAFESAGE_REPRO_PROBE_OUT     a JSON file this pack rewrites at every phase, so what it saw before
                               a native abort is still there after it
  SAFESAGE_REPRO_EMULATE_ARCH  e.g. sm120 (bench/common/benchutil.py): the start-up hook

Start-up hook. ComfyUI imports custom nodes after main.py's own start-up (cli args, comfy-aimdo,
cuda_malloc, devices) and before it serves a prompt. With SAFESAGE_REPRO_EMULATE_ARCH set, this
import makes sage 2.2.0's ``sageattn`` dispatch as on that arch (benchutil.emulate_sage_arch), so
ComfyUI's own ``attention_sage`` runs that arch's kernels. SafeSage is made to plan for the same
arch (benchutil.emulated_runtime, bound wherever a SafeSage module holds ``runtime``) when the
probe node runs: custom nodes load in directory order, SafeSage possibly after this pack, and the
probe node runs before SafeSageAttention, which takes the probe's model.

Nodes (category safesage/repro):
  SafeSageReproProbe(model) -> model   records the loaded model, then times the sampling through an
      OUTER_SAMPLE wrapper on a clone (ComfyUI's own wrapper mechanism): each step's end (after a
      device sync), weight residency at every DiT block (aimdo's VBAR, host-side counters), peak
      memory, the packed sequence length; on an OOM, who held the memory (memory.memory_at_oom)
      before ComfyUI's OOM handling unloads the models.
  SafeSageReproConditioning(model, text_len, seed) -> CONDITIONING   random text-encoder states of
      the real shape [1, text_len, the model's text_dim] (no text encoder is loaded)
  SafeSageReproSaveLatent(samples, path)   output node: the sampled video and audio latents,
      float32 on the CPU, torch.save'd to ``path``

Route: GET /safesage_repro/memory -> the server's torch memory now (memory_now; soak.py).
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time

# this pack is loaded by ComfyUI from custom_nodes/, not as part of bench/: the repository is on the
# server's PYTHONPATH (bench/repro/worker.py puts it there)
from bench.common import benchutil
from bench.repro import memory

log = logging.getLogger("safesage_repro")


class _Record:
    """The probe's findings, rewritten to SAFESAGE_REPRO_PROBE_OUT on every change."""

    def __init__(self, path):
        self.path = path
        self.d = {}

    def set(self, **kw):
        self.d.update(kw)
        if not self.path:
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.d, f, indent=1, default=str)
        os.replace(tmp, self.path)


record = _Record(os.environ.get("SAFESAGE_REPRO_PROBE_OUT"))
ARCH = os.environ.get("SAFESAGE_REPRO_EMULATE_ARCH") or None


# ------------------------------------------------------------------------------ start-up hook
def _startup():
    record.set(phase="server started", comfy_argv=sys.argv[1:],
               env={k: os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "CUDA_LAUNCH_BLOCKING")})
    if ARCH:
        try:
            record.set(emulated_arch=ARCH, real_arch=benchutil.emulate_sage_arch(ARCH))
            log.info("safesage_repro: sageattn dispatches as on %s", ARCH)
        except Exception as e:  # noqa: BLE001 - no sage 2.2 here (CPU): recorded, the run goes on
            record.set(emulated_arch=ARCH, sage_emulation_error=repr(e))


def safesage_sees_arch(arch: str, modules=None) -> list[str]:
    """Bind SafeSage's runtime, as it reads on ``arch``, wherever a loaded module holds the real
    ``runtime`` function of a loaded safe_ops.facts.devices (SafeSage is loaded under its folder's name).
    Returns the modules changed."""
    modules = sys.modules if modules is None else modules
    changed = []
    for name, rtm in list(modules.items()):
        if not name.endswith("safe_ops.facts.devices") or not hasattr(rtm, "sage_family_for"):
            continue
        real = vars(rtm).get("_repro_real_runtime") or rtm.runtime
        fake = benchutil.emulated_runtime(arch, rtm=rtm, real=real())

        def emulated(device=None):          # runtime(device): every GPU reads as ``arch``
            return fake
        emulated._repro_real_runtime = real
        for mname, m in list(modules.items()):
            fn = vars(m).get("runtime") if hasattr(m, "__dict__") else None
            if fn is real or getattr(fn, "_repro_real_runtime", None) is real:
                setattr(m, "runtime", emulated)
                changed.append(mname)
        rtm._repro_real_runtime = real
    return sorted(changed)


def _versions() -> dict:
    import importlib.metadata as md

    import torch
    out = {"torch": torch.__version__, "python": sys.version.split()[0]}
    try:
        import comfy.cli_args
        import comfy.memory_management
        out["dynamic_vram"] = bool(getattr(comfy.memory_management, "aimdo_enabled", False))
        out["attention"] = "sage" if comfy.cli_args.args.use_sage_attention else "pytorch-default"
    except Exception as e:  # noqa: BLE001
        out["comfy_error"] = repr(e)
    for mod in ("comfy_aimdo", "comfy_kitchen", "sageattention", "triton"):
        try:
            out[mod] = md.version(mod.replace("_", "-"))
        except Exception:  # noqa: BLE001
            out[mod] = None
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["cuda"] = torch.version.cuda
    return out


# ------------------------------------------------------------------------------ sampling wrapper
def _layout(guider, diff, shapes) -> dict:
    """The packed sequence ComfyUI's H3 builds for this latent and conditioning."""
    import comfy.ldm.minimax.model as h3
    lv, la = [list(s) for s in shapes[:2]]
    text_len = guider.original_conds["positive"][0]["cross_attn"].shape[1]
    S = h3.PackedLayout(text_len, lv[2], (lv[3] + 1) // 2 * 2, (lv[4] + 1) // 2 * 2, la[-1]).seq_len
    att = diff.blocks[0].attn
    return {"packed_tokens": S, "video_latent": lv, "audio_latent": la, "text_len": text_len,
            "s_times_qkv_stride": S * 3 * att.heads * att.head_dim,
            "blocks": len(diff.blocks), "refiner_blocks": len(diff.token_refiner.blocks)}


def _outer_sample(executor, noise, latent_image, sampler, sigmas, denoise_mask=None, callback=None,
                  disable_pbar=False, seed=None, **kw):
    import comfy.model_management
    import torch
    guider = executor.class_obj
    patcher = guider.model_patcher
    diff = patcher.model.diffusion_model
    try:
        record.set(**_layout(guider, diff, kw.get("latent_shapes") or [latent_image.shape]))
    except Exception as e:  # noqa: BLE001 - not an H3 graph: the timings still count
        record.set(layout_error=repr(e))
    cuda = comfy.model_management.get_torch_device().type == "cuda"
    step_t, resident = [], []

    def timed(step, x0, x, total):
        if cuda:
            torch.cuda.synchronize()
        step_t.append(time.time())
        record.set(phase=f"step {step + 1}/{total} done", step_end_times=[round(t - t0, 3) for t in step_t])
        if callback is not None:
            return callback(step, x0, x, total)

    # weight residency at the start of every DiT block: a drop then rise within a step is aimdo
    # evicting and re-faulting weights while the step runs
    def at_block(i):
        try:
            resident.append((i, int(patcher.loaded_size()) >> 20))
        except Exception as e:  # noqa: BLE001 - evidence only
            resident.append((i, repr(e)))
    hooks = [b.register_forward_pre_hook(lambda m, a, i=i: at_block(i)) for i, b in enumerate(diff.blocks)]
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    record.set(phase="sampling")
    t0 = time.time()
    try:
        out = executor(noise, latent_image, sampler, sigmas, denoise_mask, timed, disable_pbar, seed, **kw)
        if cuda:
            torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        record.set(memory_at_oom=memory.memory_at_oom(torch, patcher), resident_mib_per_block=resident[:400])
        raise
    finally:
        for h in hooks:
            h.remove()
    t_end = time.time()
    vals = [r for _, r in resident if isinstance(r, int)]
    per_step, prev = [], t0
    for t in step_t:
        per_step.append(round(t - prev, 3))
        prev = t
    record.set(phase="sampled", sample_s=round(t_end - t0, 3), s_per_step=per_step,
               resident_mib_per_block=resident[:400],
               resident_mib_min=min(vals) if vals else None, resident_mib_max=max(vals) if vals else None,
               memory=memory.torch_peaks(torch) if cuda else {})
    return out


# ------------------------------------------------------------------------------ nodes
class SafeSageReproProbe:
    CATEGORY = "safesage/repro"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "probe"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",)}}

    def probe(self, model):
        import comfy.patcher_extension as pe
        record.set(phase="loaded", patcher=type(model).__name__, versions=_versions(),
                   alloc_conf_after_cuda_malloc=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
        try:
            record.set(model_size_mib=int(model.model_size()) >> 20)
        except Exception:  # noqa: BLE001
            record.set(model_size_mib=None)
        if ARCH:
            record.set(safesage_emulated_in=safesage_sees_arch(ARCH))
        m = model.clone()
        m.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, "safesage_repro", _outer_sample)
        return (m,)


class SafeSageReproConditioning:
    CATEGORY = "safesage/repro"
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",),
                             "text_len": ("INT", {"default": 256, "min": 1, "max": 1 << 20}),
                             "seed": ("INT", {"default": 0, "min": 0, "max": 0xFFFFFFFFFFFFFFFF})}}

    def make(self, model, text_len, seed):
        import torch
        text_dim = model.model.diffusion_model.condition_proj.weight.shape[1]
        ctx = torch.randn(1, text_len, text_dim, generator=torch.Generator().manual_seed(seed))
        return ([[ctx, {}]],)


class SafeSageReproSaveLatent:
    CATEGORY = "safesage/repro"
    RETURN_TYPES = ()
    FUNCTION = "save"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",), "path": ("STRING", {"default": ""})}}

    def save(self, samples, path):
        import torch
        s = samples["samples"]
        out_v, out_a = [t.float().cpu() for t in (s.unbind() if getattr(s, "is_nested", False) else (s,))]
        if path:
            torch.save({"video": out_v, "audio": out_a}, path)
        record.set(phase="done", completed=True, finite=bool(torch.isfinite(out_v).all() and torch.isfinite(out_a).all()),
                   video_abs_mean=float(out_v.abs().mean()))
        return {}


NODE_CLASS_MAPPINGS = {c.__name__: c for c in (SafeSageReproProbe, SafeSageReproConditioning, SafeSageReproSaveLatent)}


# ------------------------------------------------------------------------------ route
MEMORY_PATH = "/safesage_repro/memory"


def memory_now() -> dict:
    """The server's own view of its GPU memory now (bench/repro/soak.py reads it between prompts):
    torch's allocated / reserved bytes and the caching allocator's live allocation count on ComfyUI's
    device; {"device": "cpu"} without CUDA."""
    import comfy.model_management
    import torch
    dev = comfy.model_management.get_torch_device()
    if dev.type != "cuda":
        return {"device": str(dev)}
    st = torch.cuda.memory_stats(dev)
    return {"device": str(dev), "allocated": torch.cuda.memory_allocated(dev),
            "reserved": torch.cuda.memory_reserved(dev),
            "active_allocations": int(st.get("active.all.current", 0))}


def _register_route():
    try:
        from aiohttp import web
        from server import PromptServer
        routes = PromptServer.instance.routes
    except (ImportError, AttributeError):
        return

    async def handler(request):
        return web.json_response(memory_now())
    routes.get(MEMORY_PATH)(handler)


_startup()
_register_route()
