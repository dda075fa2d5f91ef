"""Reproduce the reporter's abort (seed-bug-report.md) with real ComfyUI 0dd9b154 code, and SafeSage's fix.

Three modes:

  python bench/repro.py all --comfy COMFY --ckpt CKPT --out bench/results/repro_h200.json [...]
      driver: runs every (size, arm) in a fresh process (worker below), with a per-arm timeout,
      optional ballast process (so the card has the reporter's ~32 GB), and writes the JSON after
      every arm (outcome, exit signal, last log lines, s/step, peak memory, rel. L2 vs the
      PyTorch-attention arm of the same size).
  python bench/repro.py worker --comfy COMFY --ckpt CKPT --arm ARM --size NAME --result R.json
      one arm in this process: ComfyUI's own start-up steps from main.py (cli args, comfy-aimdo
      init + DynamicVRAM ModelPatcher, cudaMallocAsync), comfy.sd.load_diffusion_model (the
      UNETLoader path), an EmptyMiniMaxH3LatentAV latent, random text-encoder states of the real
      shape as conditioning, BasicGuider + res_multistep + beta sigmas through
      SamplerCustomAdvanced's sampling path (guider.sample), then saves the sampled latent.
  python bench/repro.py enrich JSON LOGDIR
      re-reads the worker logs of a finished run (LOGDIR = the driver's --work) into the JSON.
  python bench/repro.py --table [JSON ...]
      prints the markdown table for docs/REPRODUCTION.md of each JSON. A completed row is marked silently
      wrong when its rel. L2 vs the PyTorch arm is over twice the unguarded sage arm's at 38k (inside
      every kernel limit) on the same checkpoint, taken from any JSON given.

Arms (ComfyUI command-line flags / environment / graph):
  pytorch        no --use-sage-attention (ComfyUI's default PyTorch attention), dynamic VRAM
  sage           --use-sage-attention, dynamic VRAM (the reporter's failing configuration)
  safesage       --use-sage-attention + SafeSageAttention node defaults (apply_safesage, Policy())
  safesage_sage  the same with kernel='sage' (forces the guarded SageAttention path)
  sage_blocking  --use-sage-attention, dynamic VRAM, CUDA_LAUNCH_BLOCKING=1
  sage_nodyn     --use-sage-attention --disable-dynamic-vram
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# name -> (width, height, length in frames, text tokens); packed S = text + 2*audio_t + video tokens
SIZES = {
    "38k": (1344, 768, 124, 256),     # the reporter's clean size (1344x768 / 124 frames)
    "100k": (1024, 1024, 328, 256),   # just past S = 99,866 (row * 21504 > 2^31 in int32)
    "169k": (1664, 960, 362, 256),    # the reporter's failing size (1664x960 / 362 frames)
    # CPU smoke sizes (tiny model)
    "tiny": (64, 64, 22, 16),
    "tiny2": (96, 64, 39, 16),
}

ARMS = {
    "pytorch": {"flags": [], "env": {}, "safesage": None},
    "sage": {"flags": ["--use-sage-attention"], "env": {}, "safesage": None},
    "safesage": {"flags": ["--use-sage-attention"], "env": {}, "safesage": {}},
    "safesage_sage": {"flags": ["--use-sage-attention"], "env": {}, "safesage": {"kernel": "sage"}},
    "sage_blocking": {"flags": ["--use-sage-attention"], "env": {"CUDA_LAUNCH_BLOCKING": "1"}, "safesage": None},
    "sage_nodyn": {"flags": ["--use-sage-attention", "--disable-dynamic-vram"], "env": {}, "safesage": None},
    # the comparison cases with SafeSage inserted (each matched with its own unguarded arm)
    "safesage_blocking": {"flags": ["--use-sage-attention"], "env": {"CUDA_LAUNCH_BLOCKING": "1"}, "safesage": {}},
    "safesage_nodyn": {"flags": ["--use-sage-attention", "--disable-dynamic-vram"], "env": {}, "safesage": {}},
    "safesage_pytorch": {"flags": [], "env": {}, "safesage": {}},
}
# guarded arm -> the same configuration without SafeSage
UNGUARDED = {"safesage": "sage", "safesage_sage": "sage", "safesage_blocking": "sage_blocking",
             "safesage_nodyn": "sage_nodyn", "safesage_pytorch": "pytorch"}
ARM_LABEL = {
    "pytorch": "PyTorch attention + dynamic VRAM",
    "sage": "--use-sage-attention + dynamic VRAM (unguarded)",
    "safesage": "SafeSageAttention (node defaults) + dynamic VRAM",
    "safesage_sage": "SafeSageAttention kernel=sage + dynamic VRAM",
    "sage_blocking": "--use-sage-attention + dynamic VRAM + CUDA_LAUNCH_BLOCKING=1",
    "sage_nodyn": "--use-sage-attention --disable-dynamic-vram",
    "safesage_blocking": "SafeSageAttention + CUDA_LAUNCH_BLOCKING=1",
    "safesage_nodyn": "SafeSageAttention + --disable-dynamic-vram",
    "safesage_pytorch": "SafeSageAttention, no --use-sage-attention (PyTorch attention)",
}


# --------------------------------------------------------------------------------------- worker
class _Result:
    def __init__(self, path):
        self.path = path
        self.d = {"phase": "start"}
        self.flush()

    def set(self, **kw):
        self.d.update(kw)
        self.flush()

    def flush(self):
        if not self.path:
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.d, f, indent=1, default=str)
        os.replace(tmp, self.path)


class _NvmlPeak:
    """Device-wide used memory, polled every 20 ms (includes aimdo's own allocations)."""

    def __init__(self):
        import threading
        self.ok = False
        try:
            import pynvml
            pynvml.nvmlInit()
            idx = int((os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0])
            self.h = pynvml.nvmlDeviceGetHandleByIndex(idx)
            self.nv = pynvml
            self.start_used = self.peak = pynvml.nvmlDeviceGetMemoryInfo(self.h).used
            self.total = pynvml.nvmlDeviceGetMemoryInfo(self.h).total
            self.ok = True
        except Exception as e:  # no NVML (CPU smoke run)
            self.err = repr(e)
            return
        self.stop = False
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        while not self.stop:
            try:
                self.peak = max(self.peak, self.nv.nvmlDeviceGetMemoryInfo(self.h).used)
            except Exception:
                pass
            time.sleep(0.02)

    def info(self):
        if not self.ok:
            return {"nvml": self.err}
        return {"nvml_used_at_start_gib": round(self.start_used / 2 ** 30, 2),
                "nvml_peak_used_gib": round(self.peak / 2 ** 30, 2),
                "nvml_peak_process_gib": round((self.peak - self.start_used) / 2 ** 30, 2),
                "nvml_total_gib": round(self.total / 2 ** 30, 2)}


def _memory_at_oom(torch, model, nv) -> dict:
    """Who holds the device when an allocation fails: PyTorch's live tensors, the blocks its allocator
    keeps cached (reserved - allocated; with cudaMallocAsync, the pool's reserved memory), aimdo's
    resident weights, and what CUDA itself says is free."""
    ev = {}
    try:
        st = torch.cuda.memory_stats()
        free, total = torch.cuda.mem_get_info()
        ev.update(torch_allocated_gib=round(st.get("allocated_bytes.all.current", 0) / 2 ** 30, 2),
                  torch_reserved_gib=round(st.get("reserved_bytes.all.current", 0) / 2 ** 30, 2),
                  torch_peak_allocated_gib=round(st.get("allocated_bytes.all.peak", 0) / 2 ** 30, 2),
                  torch_peak_reserved_gib=round(st.get("reserved_bytes.all.peak", 0) / 2 ** 30, 2),
                  cuda_free_mib=free >> 20, cuda_total_gib=round(total / 2 ** 30, 2))
    except Exception as e:  # noqa: BLE001 - evidence only, the OOM is re-raised
        ev["torch_error"] = repr(e)
    try:
        ev["weights_resident_mib"] = int(model.loaded_size()) >> 20
    except Exception as e:  # noqa: BLE001
        ev["weights_error"] = repr(e)
    ev.update(nv.info())
    return ev


def _empty_av_latent_copy(width, height, length):
    """comfy_extras/nodes_minimax_h3.py (0dd9b154) _empty_av_latent, verbatim logic, batch 1."""
    import comfy.model_management
    import comfy.nested_tensor
    import torch
    n = max(5, length)
    while n % 17 != 5:
        n += 1
    latent_t = 2 if n <= 5 else ((n - 5) // 17) * 5 + 2
    audio_t = round(n / 24 * 40)
    dev = comfy.model_management.intermediate_device()
    video = torch.zeros([1, 24, latent_t, height // 16, width // 16], device=dev)
    audio = torch.zeros([1, 32, 2, audio_t], device=dev)
    return {"samples": comfy.nested_tensor.NestedTensor((video, audio))}


class _RandomNoiseCopy:
    """comfy_extras/nodes_custom_sampler.py Noise_RandomNoise."""

    def __init__(self, seed):
        self.seed = seed

    def generate_noise(self, input_latent):
        import comfy.sample
        return comfy.sample.prepare_noise(input_latent["samples"], self.seed, input_latent.get("batch_index"))


def _emulate_arch(arch: str, res) -> None:
    """ComfyUI's own sage call runs what it runs on ``arch`` (benchutil.emulate_sage_arch)."""
    from benchutil import emulate_sage_arch
    res.set(emulated_arch=arch, real_arch=emulate_sage_arch(arch))


def _safesage_sees_arch(arch: str) -> None:
    """SafeSage plans for the emulated arch too (its runtime is the only thing that changes)."""
    import safe_ops.patch
    from benchutil import emulated_runtime
    fake = emulated_runtime(arch)
    safe_ops.patch.runtime = lambda: fake


def worker(a):
    """One arm, in this process, following main.py's start-up order."""
    res = _Result(a.result)
    arm = ARMS[a.arm]
    width, height, length, text_len = SIZES[a.size]
    comfy_root = os.path.abspath(a.comfy)
    sys.path.insert(0, comfy_root)
    os.chdir(comfy_root)
    flags = list(arm["flags"]) + list(a.comfy_flag or [])
    if a.cpu:  # CPU smoke run: no sage there; keep the rest of the path
        flags = [f for f in flags if f != "--use-sage-attention"] + ["--cpu"]
    sys.argv = [os.path.join(comfy_root, "main.py")] + flags
    res.set(comfy_argv=flags, arm=a.arm, size=a.size, width=width, height=height, length=length,
            text_len=text_len, env={k: os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "CUDA_LAUNCH_BLOCKING")})

    # ---- main.py, in its order
    import comfy.options
    comfy.options.enable_args_parsing()
    import logging

    from comfy.cli_args import args, enables_dynamic_vram
    logging.basicConfig(level=getattr(logging, "DEBUG" if a.debug else "INFO"), stream=sys.stdout,
                        format="%(levelname).3s] %(message)s", force=True)
    import faulthandler
    faulthandler.enable(file=sys.stderr, all_threads=True)
    import comfy_aimdo.control
    if enables_dynamic_vram():
        simple_vram_headroom = None if args.reserve_vram is None else int(args.reserve_vram * 1024 ** 3)
        try:
            comfy_aimdo.control.init(simple_vram_headroom=simple_vram_headroom, nvml_pressure=not args.disable_nvml_pressure)
        except TypeError:
            comfy_aimdo.control.init(simple_vram_headroom=simple_vram_headroom)
    import cuda_malloc  # noqa: F401  (sets PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync as main.py does)
    res.set(alloc_conf_after_cuda_malloc=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    nv = _NvmlPeak()

    import comfy.memory_management
    import comfy.model_management
    import comfy.model_patcher
    import comfy.utils
    import torch
    dyn = False
    if args.enable_dynamic_vram or (enables_dynamic_vram() and comfy.model_management.is_nvidia() and not comfy.model_management.is_wsl()):
        ok = comfy_aimdo.control.init_devices((d.index, int(args.vram_headroom * 1024 ** 3))
                                              for d in comfy.model_management.get_all_torch_devices())
        if ok:
            if a.debug:
                comfy_aimdo.control.set_log_debug()
            else:
                comfy_aimdo.control.set_log_info()
            comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
            comfy.memory_management.aimdo_enabled = True
            dyn = True
            logging.info("DynamicVRAM support detected and enabled")
        else:
            logging.warning("No working comfy-aimdo install detected. DynamicVRAM support disabled.")
    import comfy.ldm.minimax.model as h3
    import comfy.sample
    import comfy.samplers
    import comfy.sd
    try:  # the node modules import comfy_api.latest, which needs PyAV (too big to carry to the GPU box)
        if os.environ.get("REPRO_NO_NODE_MODULES"):
            raise ImportError("REPRO_NO_NODE_MODULES set")
        import comfy_extras.nodes_custom_sampler as cs
        import comfy_extras.nodes_minimax_h3 as h3nodes
        node_src = "comfy_extras (EmptyMiniMaxH3LatentAV, Guider_Basic, Noise_RandomNoise)"
    except ImportError as e:
        h3nodes = cs = None
        node_src = f"local copies of the 0dd9b154 node code ({e})"
    versions = {"torch": torch.__version__, "python": sys.version.split()[0],
                "dynamic_vram": dyn,
                "attention": "sage" if args.use_sage_attention else "pytorch-default"}
    for mod in ("comfy_aimdo", "comfy_kitchen", "sageattention", "triton"):
        try:
            import importlib.metadata as md
            versions[mod] = md.version(mod.replace("_", "-"))
        except Exception:
            versions[mod] = None
    if torch.cuda.is_available():
        versions["gpu"] = torch.cuda.get_device_name(0)
        versions["cuda"] = torch.version.cuda
    res.set(versions=versions, node_code=node_src, phase="imported")

    if a.emulate_arch:
        _emulate_arch(a.emulate_arch, res)

    # ---- UNETLoader -> (SafeSageAttention)
    t0 = time.time()
    model = comfy.sd.load_diffusion_model(a.ckpt)
    res.set(phase="loaded", load_s=round(time.time() - t0, 2), patcher=type(model).__name__)
    if arm["safesage"] is not None:
        sys.path.append(REPO)  # appended: the repo's nodes/ must not shadow ComfyUI's nodes.py
        import safe_ops.patch
        import safe_ops.policy
        import safe_ops.report
        policy = safe_ops.policy.Policy(**arm["safesage"])
        if a.emulate_arch:
            _safesage_sees_arch(a.emulate_arch)
        model, summary = safe_ops.patch.apply_safesage(model, policy)
        res.set(safesage_summary=summary.get("text"))

    # ---- EmptyMiniMaxH3LatentAV -> conditioning (random text-encoder states of the real shape)
    if h3nodes is not None:
        latent = h3nodes.EmptyMiniMaxH3LatentAV.execute(width, height, length)[0]
        mine = _empty_av_latent_copy(width, height, length)
        assert [list(t.shape) for t in latent["samples"].unbind()] == [list(t.shape) for t in mine["samples"].unbind()]
    else:
        latent = _empty_av_latent_copy(width, height, length)
    lv, la = latent["samples"].unbind()
    diff = model.model.diffusion_model
    text_dim = diff.condition_proj.weight.shape[1]
    layout = h3.PackedLayout(text_len, lv.shape[2], (lv.shape[3] + 1) // 2 * 2, (lv.shape[4] + 1) // 2 * 2, la.shape[-1])
    S = layout.seq_len
    g = torch.Generator().manual_seed(a.seed + 1)
    ctx = torch.randn(1, text_len, text_dim, generator=g) * 1.0
    positive = [[ctx, {}]]
    res.set(phase="latent", packed_tokens=S, video_latent=list(lv.shape), audio_latent=list(la.shape),
            s_times_qkv_stride=S * 3 * diff.blocks[0].attn.heads * diff.blocks[0].attn.head_dim,
            blocks=len(diff.blocks), refiner_blocks=len(diff.token_refiner.blocks))
    logging.info("packed tokens S=%d (video %s, audio %s, text %d)", S, list(lv.shape), list(la.shape), text_len)

    # ---- BasicGuider + KSamplerSelect(res_multistep) + BasicScheduler(beta) + RandomNoise -> SamplerCustomAdvanced
    if cs is not None:
        guider = cs.Guider_Basic(model)
        guider.set_conds(positive)
        noise = cs.Noise_RandomNoise(a.seed)
    else:
        guider = comfy.samplers.CFGGuider(model)          # = Guider_Basic
        guider.inner_set_conds({"positive": positive})
        noise = _RandomNoiseCopy(a.seed)
    sampler = comfy.samplers.sampler_object("res_multistep")
    sigmas = comfy.samplers.calculate_sigmas(model.get_model_object("model_sampling"), "beta", a.steps).cpu()
    step_t = []
    cuda = torch.cuda.is_available() and not a.cpu

    def callback(step, x0, x, total):
        if cuda:
            torch.cuda.synchronize()
        step_t.append(time.time())
        res.set(phase=f"step {step + 1}/{total} done", step_end_times=[round(t - t_start, 3) for t in step_t])

    # Weight residency at the start of every DiT block (dynamic VRAM: the model's aimdo VBAR;
    # host-side counters, no sync): a drop then rise within a step is aimdo evicting and
    # re-faulting weights while the step runs.
    resident = []

    def _resident(mod, args, i=None):
        try:
            resident.append((i, int(model.loaded_size()) >> 20))
        except Exception as e:  # noqa: BLE001 - evidence only
            resident.append((i, repr(e)))
    hooks = [b.register_forward_pre_hook(lambda m, args, i=i: _resident(m, args, i)) for i, b in enumerate(diff.blocks)]
    try:
        model_mib = int(model.model_size()) >> 20
    except Exception:
        model_mib = None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    res.set(phase="sampling", model_size_mib=model_mib)
    t_start = time.time()
    try:
        samples = guider.sample(noise.generate_noise(latent), latent["samples"], sampler, sigmas,
                                denoise_mask=None, callback=callback, disable_pbar=True, seed=noise.seed)
    except torch.OutOfMemoryError:
        res.set(memory_at_oom=_memory_at_oom(torch, model, nv), resident_mib_per_block=resident[:400])
        raise
    if cuda:
        torch.cuda.synchronize()
    t_end = time.time()
    for h in hooks:
        h.remove()
    vals = [r for _, r in resident if isinstance(r, int)]
    res.set(resident_mib_per_block=resident[:400],
            resident_mib_min=min(vals) if vals else None, resident_mib_max=max(vals) if vals else None)
    out_v, out_a = [t.float().cpu() for t in samples.unbind()]
    per_step = []
    prev = t_start
    for t in step_t:
        per_step.append(round(t - prev, 3))
        prev = t
    mem = {}
    if cuda:
        st = torch.cuda.memory_stats()
        mem = {"torch_peak_allocated_gib": round(st.get("allocated_bytes.all.peak", 0) / 2 ** 30, 2),
               "torch_peak_reserved_gib": round(st.get("reserved_bytes.all.peak", 0) / 2 ** 30, 2)}
    mem.update(nv.info())
    finite = bool(torch.isfinite(out_v).all() and torch.isfinite(out_a).all())
    if a.latent_out:
        torch.save({"video": out_v, "audio": out_a}, a.latent_out)
    res.set(phase="done", completed=True, sample_s=round(t_end - t_start, 3), s_per_step=per_step,
            memory=mem, finite=finite, video_abs_mean=float(out_v.abs().mean()))
    if arm["safesage"] is not None:
        try:
            res.set(safesage_report=safe_ops.report.snapshot())
        except Exception as e:
            res.set(safesage_report=f"n/a: {e!r}")
    logging.info("REPRO DONE arm=%s size=%s S=%d steps=%s", a.arm, a.size, S, per_step)


# --------------------------------------------------------------------------------------- driver
def _sig_name(rc):
    try:
        return signal.Signals(-rc).name
    except Exception:
        return str(rc)


def _tail(path, n=25):
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []
    return [ln[:400] for ln in lines[-n:]]


def _error_line(lines):
    """The exception line of the last traceback, else the last ERR] / non-empty line."""
    import re
    for ln in reversed(lines):
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Abort\w*)\b", ln.strip()):
            return ln.strip()
    for ln in reversed(lines):
        if ln.startswith("ERR]") and ln[4:].strip():
            return ln.strip()
    for ln in reversed(lines):
        if ln.strip():
            return ln.strip()
    return None


KEY_LINES = ("ERR]", "terminate called", "what():", "Exception raised from", "Fatal Python error",
             "Found quantization metadata", "Detected mixed precision", "DynamicVRAM support", "Device: cuda",
             "model weight dtype", "prepared for dynamic VRAM", "loaded partially", "loaded completely",
             "Using sage attention", "Using pytorch attention", "aimdo", "Staged", "offloaded")


def _log_excerpt(path):
    """Key lines of a worker log: loader/VRAM lines, errors, and the aborting thread's innermost frames."""
    try:
        with open(path, "r", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    keys = [ln[:300] for ln in lines if any(k in ln for k in KEY_LINES) and "Found comfy_kitchen backend" not in ln]
    frames = []
    for i, ln in enumerate(lines):
        if ln.startswith("Current thread"):
            frames = [x.strip()[:300] for x in lines[i + 1:i + 9] if x.strip().startswith("File")]
    return {"key_lines": keys, "python_stack_at_abort": frames}


def _grep_count(path, words):
    n = 0
    try:
        with open(path, "r", errors="replace") as f:
            for ln in f:
                low = ln.lower()
                if any(w in low for w in words):
                    n += 1
    except OSError:
        pass
    return n


def _rel_l2(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


class Ballast:
    """A separate process that holds GPU memory so that about `free_gib` stays free."""

    def __init__(self, free_gib, log):
        code = (
            "import torch,sys,time\n"
            "free,total=torch.cuda.mem_get_info()\n"
            f"n=max(0,free-int({free_gib}*2**30))\n"
            "x=torch.empty(n,dtype=torch.uint8,device='cuda') if n else None\n"
            "torch.cuda.synchronize()\n"
            "print('BALLAST',n,total,flush=True)\n"
            "time.sleep(1e6)\n")
        self.log = open(log, "w")
        self.p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.p.stdout.readline().split()
        if not line or line[0] != "BALLAST":
            raise RuntimeError("ballast process failed: see " + log)
        self.bytes, self.total = int(line[1]), int(line[2])

    def stop(self):
        self.p.terminate()
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            self.p.kill()


def _latent_store(a, doc) -> dict:
    """--keep-latents DIR: the sampled latents of earlier driver runs with the same checkpoint, steps, seed
    and emulated arch, {(size, arm): path}, so arms split over several device calls are still compared
    with the PyTorch arm and with their own unguarded arm. A store made for other settings is emptied."""
    if not a.keep_latents:
        return {}
    os.makedirs(a.keep_latents, exist_ok=True)
    st = os.stat(a.ckpt)
    key = {"ckpt": os.path.abspath(a.ckpt), "ckpt_bytes": st.st_size, "ckpt_mtime": int(st.st_mtime),
           "steps": a.steps, "seed": a.seed, "emulate_arch": a.emulate_arch, "cpu": a.cpu}
    meta = os.path.join(a.keep_latents, "store.json")
    old = None
    if os.path.exists(meta):
        with open(meta) as f:
            old = json.load(f)
    if old != key:
        for n in os.listdir(a.keep_latents):
            if n.endswith(".pt"):
                os.remove(os.path.join(a.keep_latents, n))
        with open(meta, "w") as f:
            json.dump(key, f)
    found = {}
    for n in sorted(os.listdir(a.keep_latents)):
        size, _, arm = n[:-3].partition("_")
        if n.endswith(".pt") and size in SIZES and arm in ARMS:
            found[(size, arm)] = os.path.join(a.keep_latents, n)
    doc["earlier_latents"] = sorted(f"{s}:{r}" for s, r in found)
    return found


def driver(a):
    import torch  # only for the diff; the driver never touches the GPU
    work = os.path.abspath(a.work)
    os.makedirs(work, exist_ok=True)
    out_path = os.path.abspath(a.out)
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    t_begin = time.time()
    doc = {"command": " ".join(shlex.quote(x) for x in sys.argv), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
           "ckpt": a.ckpt, "steps": a.steps, "seed": a.seed, "ballast_free_gib": a.ballast_free_gib,
           "sizes": {s: dict(zip(("width", "height", "length", "text_len"), SIZES[s])) for s in a.sizes},
           "arms": {k: {"label": ARM_LABEL[k], "comfy_flags": ARMS[k]["flags"], "env": ARMS[k]["env"],
                        "safesage_policy": ARMS[k]["safesage"]} for k in a.arms},
           "repo_rev": a.repo_rev, "runs": []}
    if a.synth_info and os.path.exists(a.synth_info):
        with open(a.synth_info) as f:
            doc["checkpoint"] = json.loads(f.read().strip().splitlines()[-1])

    def save():
        doc["elapsed_s"] = round(time.time() - t_begin, 1)
        with open(out_path + ".tmp", "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(out_path + ".tmp", out_path)
        if a.copy_to:
            import shutil
            shutil.copy(out_path, a.copy_to)

    ballast = None
    if a.ballast_free_gib:
        ballast = Ballast(a.ballast_free_gib, os.path.join(work, "ballast.log"))
        doc["ballast"] = {"held_gib": round(ballast.bytes / 2 ** 30, 2), "total_gib": round(ballast.total / 2 ** 30, 2)}
    save()
    plan = [tuple(x.split(":")) for x in a.plan] if a.plan else [(s, r) for s in a.sizes for r in a.arms]
    doc["plan"] = [f"{s}:{r}" for s, r in plan]
    doc["sizes"] = {s: dict(zip(("width", "height", "length", "text_len"), SIZES[s])) for s in dict.fromkeys(s for s, _ in plan)}
    refs = {}
    latents = {}   # (size, arm) -> sampled latent, for guarded-vs-unguarded comparisons
    keep = _latent_store(a, doc)
    for (size, arm), path in keep.items():
        latents[(size, arm)] = torch.load(path)
        if arm == "pytorch":
            refs[size] = latents[(size, arm)]
    try:
        for size, arm in plan:
            left = a.deadline - (time.time() - t_begin)
            run = {"size": size, "arm": arm}
            if left < a.min_left:
                run.update(outcome="skipped (time budget)")
                doc["runs"].append(run)
                save()
                continue
            tag = f"{size}_{arm}"
            log = os.path.join(work, tag + ".log")
            rjson = os.path.join(work, tag + ".json")
            lat = os.path.join(work, tag + ".pt")
            for p in (rjson, lat):
                if os.path.exists(p):
                    os.remove(p)
            cmd = [sys.executable, os.path.abspath(__file__), "worker", "--comfy", a.comfy, "--ckpt", a.ckpt,
                   "--arm", arm, "--size", size, "--steps", str(a.steps), "--seed", str(a.seed),
                   "--result", rjson, "--latent-out", lat]
            if a.cpu:
                cmd.append("--cpu")
            if a.debug:
                cmd.append("--debug")
            if a.emulate_arch:
                cmd += ["--emulate-arch", a.emulate_arch]
            env = dict(os.environ)
            env["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
            env["PYTHONUNBUFFERED"] = "1"
            env.update(ARMS[arm]["env"])
            timeout = min(a.arm_timeout, max(10, left - 5))
            t0 = time.time()
            with open(log, "w") as lf:
                p = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, process_group=0)
                try:
                    rc = p.wait(timeout)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                    rc = "timeout"
            wall = round(time.time() - t0, 1)
            w = {}
            if os.path.exists(rjson):
                with open(rjson) as f:
                    w = json.load(f)
            run.update(command="".join(f"{k}={v} " for k, v in ARMS[arm]["env"].items())
                       + "PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync " + " ".join(shlex.quote(x) for x in cmd[1:]),
                       rc=rc, wall_s=wall, worker=w)
            if rc == 0 and w.get("completed"):
                run["outcome"] = "completed"
            elif rc == "timeout":
                run["outcome"] = f"timeout after {timeout:.0f} s (phase: {w.get('phase')})"
            elif isinstance(rc, int) and rc < 0:
                run["outcome"] = f"process abort: {_sig_name(rc)} (phase: {w.get('phase')})"
            else:
                run["outcome"] = f"Python error, exit {rc} (phase: {w.get('phase')})"
                run["error"] = _error_line(_tail(log, 60))
            run["log_tail"] = _tail(log, 25)
            run["aimdo_evict_lines"] = _grep_count(log, ("evict",))
            run["cuda_error_lines"] = _grep_count(log, ("illegal memory access", "cuda error", "device-side assert"))
            if run["outcome"] == "completed" and os.path.exists(lat):
                cur = torch.load(lat)
                latents[(size, arm)] = cur
                if a.keep_latents:
                    os.replace(lat, os.path.join(a.keep_latents, tag + ".pt"))
                else:
                    os.remove(lat)
                if arm == "pytorch":
                    refs[size] = cur
            # every completed arm of this size against the PyTorch arm, whichever ran first
            if refs.get(size) is not None:
                ref_latent = refs[size]
                for r in doc["runs"] + [run]:
                    cur = latents.get((size, r["arm"]))
                    if r["size"] != size or cur is None or "rel_l2_vs_pytorch" in r:
                        continue
                    r["rel_l2_vs_pytorch"] = _rel_l2(torch.cat([cur["video"].flatten(), cur["audio"].flatten()]),
                                                     torch.cat([ref_latent["video"].flatten(), ref_latent["audio"].flatten()]))
                    r["rel_l2_video"] = _rel_l2(cur["video"], ref_latent["video"])
                    r["rel_l2_audio"] = _rel_l2(cur["audio"], ref_latent["audio"])
            # each guarded arm against its own unguarded configuration (whichever ran first)
            for g, u in UNGUARDED.items():
                for r in doc["runs"] + [run]:
                    if r["size"] != size or r["arm"] != g or (size, g) not in latents or (size, u) not in latents:
                        continue
                    a_, b_ = latents[(size, g)], latents[(size, u)]
                    r["unguarded_arm"] = u
                    r["rel_l2_vs_unguarded"] = _rel_l2(torch.cat([a_["video"].flatten(), a_["audio"].flatten()]),
                                                       torch.cat([b_["video"].flatten(), b_["audio"].flatten()]))
            doc["runs"].append(run)
            save()
            if len(doc["runs"]) == 1 and run["outcome"] != "completed" and a.fail_fast:
                doc["aborted"] = "first arm did not complete: setup problem, nothing else run"
                print("[repro] first arm failed; stopping (--fail-fast)", flush=True)
                return doc
            print(f"[repro] {size:>5} {arm:<14} {run['outcome']}  wall {wall}s  "
                  f"S={w.get('packed_tokens')} steps={w.get('s_per_step')} rel={run.get('rel_l2_vs_pytorch')}", flush=True)
    finally:
        if ballast is not None:
            ballast.stop()
        save()
    return doc


# --------------------------------------------------------------------------------------- table
def _fmt(x, nd=3):
    if x is None:
        return "–"
    if isinstance(x, float):
        if x == 0:
            return "0"
        if abs(x) < 1e-3 or abs(x) >= 1e4:
            return f"{x:.2e}"
        return f"{x:.{nd}f}"
    return str(x)


WRONG_FACTOR = 2.0   # a completed row is "silently wrong" above this many times the in-limit error


def _run_identity(doc) -> tuple:
    """What makes two driver runs' latents comparable: the checkpoint, steps, seed and emulated arch."""
    ck = doc.get("checkpoint") or {}
    cmd = doc.get("command", "").split()
    arch = cmd[cmd.index("--emulate-arch") + 1] if "--emulate-arch" in cmd else None
    return (ck.get("bytes") or doc.get("ckpt"), ck.get("blocks"), ck.get("weights", "fp8"),
            doc.get("steps"), doc.get("seed"), arch)


def in_limit_error(docs, doc):
    """The attention kernel's own error through this model: rel. L2 vs the PyTorch arm of the unguarded
    sage arm at the reporter's clean size (38k, 37,966 tokens: inside every sage kernel's index limits,
    the smallest of which is 99,866) in any of `docs` made with the same checkpoint, steps, seed and arch.
    None when no such run is among them."""
    key = _run_identity(doc)
    for d in docs:
        if _run_identity(d) != key:
            continue
        for r in d.get("runs", []):
            if r["size"] == "38k" and r["arm"] == "sage" and r.get("outcome") == "completed" \
                    and r.get("rel_l2_vs_pytorch") is not None:
                return r["rel_l2_vs_pytorch"]
    return None


def table(doc, docs=()) -> str:
    """Markdown table of one driver run. A completed row is marked silently wrong when its rel. L2 vs the
    PyTorch arm passes WRONG_FACTOR x in_limit_error (looked up in doc and `docs`); without that
    reference no row is judged, and a line under the table says so."""
    floor = in_limit_error([doc, *docs], doc)
    rows = ["| tokens (S) | arm | outcome | rel. L2 vs PyTorch arm | rel. L2 vs own unguarded arm | s/step | peak GPU mem (torch alloc / NVML, GiB) | weights resident during the step (MiB, min–max) |",
            "|---|---|---|---|---|---|---|---|"]
    size_order = {k: i for i, k in enumerate(SIZES)}
    size_order.update({"38k": 0, "100k": 1, "169k": 2})
    arm_order = {k: i for i, k in enumerate(ARMS)}
    for r in sorted(doc.get("runs", []), key=lambda r: (size_order.get(r["size"], 9), arm_order.get(r["arm"], 9))):
        w = r.get("worker", {}) or {}
        S = w.get("packed_tokens")
        size = f"{r['size']} ({S:,})" if S else r["size"]
        steps = w.get("s_per_step")
        st = "; ".join(_fmt(x, 2) for x in steps) if steps else "–"
        mem = w.get("memory") or {}
        m = "–"
        if mem:
            m = f"{_fmt(mem.get('torch_peak_allocated_gib'), 1)} / {_fmt(mem.get('nvml_peak_process_gib'), 1)}"
        out = r.get("outcome", "")
        if r.get("error"):
            out += ": `" + r["error"].strip()[:120].replace("|", "\\|") + "`"
            oom = w.get("memory_at_oom") or {}
            if "cuda_free_mib" in oom:
                out += (f"; then: CUDA free {oom['cuda_free_mib']:,} MiB, torch allocated {oom['torch_allocated_gib']} / "
                        f"reserved {oom['torch_reserved_gib']} GiB, weights resident {oom.get('weights_resident_mib', '?')} MiB")
        elif out.startswith(("process abort", "timeout")):
            what = [ln.split("what():", 1)[1].strip() for ln in r.get("key_lines", []) if "what():" in ln]
            if what:
                out += ": `" + what[-1][:100].replace("|", "\\|") + "`"
            stack = r.get("python_stack_at_abort") or []
            if stack:
                import re
                mm = re.search(r'File ".*?([^/]+/[^/]+\.py)", line (\d+) in (\S+)', stack[0])
                if mm:
                    out += f"; Python was at `{mm.group(1)}:{mm.group(2)} {mm.group(3)}`"
        elif out == "completed" and floor is not None and (r.get("rel_l2_vs_pytorch") or 0) > WRONG_FACTOR * floor:
            out += " **(silently wrong output)**"
        rel = r.get("rel_l2_vs_pytorch")
        ru = r.get("rel_l2_vs_unguarded")
        ru = f"{_fmt(ru, 4)} (vs {r['unguarded_arm']})" if ru is not None else "–"
        lo, hi = w.get("resident_mib_min"), w.get("resident_mib_max")
        res_ = f"{lo:,}–{hi:,} of {w.get('model_size_mib') or 0:,}" if lo is not None else "–"
        rows.append(f"| {size} | {ARM_LABEL.get(r['arm'], r['arm'])} | {out} | {_fmt(rel, 4) if rel is not None else '–'} "
                    f"| {ru} | {st} | {m} | {res_} |")
    if floor is None:
        rows.append("\n(No unguarded sage run at 38k with this checkpoint among the tables given: "
                    "no row is judged wrong or right by its rel. L2.)")
    return "\n".join(rows)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "enrich":  # re-read a run's worker logs into its JSON (fills key_lines / stack)
        path, logdir = argv[1], argv[2]
        with open(path) as f:
            doc = json.load(f)
        for r in doc["runs"]:
            log = os.path.join(logdir, f"{r['size']}_{r['arm']}.log")
            if os.path.exists(log):
                r.update(_log_excerpt(log))
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        return
    if argv and argv[0] == "--table":
        # one table per JSON; each is judged against the in-limit run of any JSON given with it
        docs = []
        for path in argv[1:] or [os.path.join(HERE, "results", "repro_h200.json")]:
            with open(path) as f:
                docs.append(json.load(f))
        print("\n\n".join(table(d, docs) for d in docs))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--comfy", required=True, help="ComfyUI 0dd9b154 tree")
    common.add_argument("--ckpt", required=True, help="checkpoint from bench/synth_h3.py")
    common.add_argument("--steps", type=int, default=2)
    common.add_argument("--seed", type=int, default=77)
    common.add_argument("--cpu", action="store_true", help="CPU smoke run (adds --cpu to ComfyUI's args)")
    common.add_argument("--debug", action="store_true", help="ComfyUI/aimdo log level DEBUG")
    common.add_argument("--emulate-arch", default=None, metavar="smNNN",
                        help="sage 2.2: make sageattn dispatch as on this arch (e.g. sm120: the per_warp "
                             "quantiser + sm89 FP8-PV kernels an RTX 5090 runs) and let SafeSage plan for it")
    w = sub.add_parser("worker", parents=[common])
    w.add_argument("--arm", choices=list(ARMS), required=True)
    w.add_argument("--size", choices=list(SIZES), required=True)
    w.add_argument("--result", default=None)
    w.add_argument("--latent-out", default=None)
    w.add_argument("--comfy-flag", action="append", default=[])
    d = sub.add_parser("all", parents=[common])
    d.add_argument("--sizes", nargs="+", default=["169k", "100k", "38k"], choices=list(SIZES))
    d.add_argument("--arms", nargs="+", default=["pytorch", "sage", "safesage", "safesage_sage", "sage_blocking", "sage_nodyn"],
                   choices=list(ARMS))
    d.add_argument("--out", default=os.path.join(HERE, "results", "repro_h200.json"))
    d.add_argument("--copy-to", default=None, help="also copy the JSON here after every arm")
    d.add_argument("--work", default="/tmp/repro")
    d.add_argument("--ballast-free-gib", type=float, default=0.0, help="hold GPU memory in another process so this much stays free")
    d.add_argument("--arm-timeout", type=float, default=150.0)
    d.add_argument("--deadline", type=float, default=1e9, help="seconds for the whole driver; later arms are skipped")
    d.add_argument("--min-left", type=float, default=20.0, help="skip an arm when fewer seconds than this are left")
    d.add_argument("--plan", nargs="+", default=None, metavar="SIZE:ARM",
                   help="explicit run order (default: every size x every arm)")
    d.add_argument("--fail-fast", action="store_true", help="stop if the very first arm does not complete")
    d.add_argument("--repo-rev", default=None, help="git revision of this pack (recorded in the JSON)")
    d.add_argument("--keep-latents", default=None, metavar="DIR",
                   help="keep each completed arm's latent here and compare with those an earlier run "
                        "(same checkpoint, steps, seed, arch) left, so arms can be split over calls")
    d.add_argument("--synth-info", default=None, help="synth_h3.py's JSON line, recorded in the results")
    a = ap.parse_args(argv)
    if a.mode == "worker":
        worker(a)
    else:
        driver(a)


if __name__ == "__main__":
    main()
