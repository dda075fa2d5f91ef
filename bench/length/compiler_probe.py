#!/usr/bin/env python3
"""MiniMax H3 blocks under ComfyUI's allocation compiler (comfy-aimdo's malloc graph), with and
without SafeSage: graph breaks, rogues, peak memory and the output against the same arm without
the compiler. GPU only (the device tool's H200); each arm runs in its own child process, because
a mis-scoped free under the compiler aborts the whole process.

What it reproduces. ComfyUI 0.34+ with dynamic VRAM on CUDA records each sampling step's device
allocations (``comfy.model_prefetch``: ``malloc_graph_begin`` before H3's DIFFUSION_MODEL
wrappers, ``iterate("block")`` before every DiT block through ``prefetch_queue_pop(...,
malloc_scope="block")``, ``iterate(None)`` after the last, ``malloc_graph_end`` (``pop``: True
is a graph break), ``pause_malloc_graph`` for what must not be recorded, ``rogue_count`` at
cleanup). No complete compiler-era ComfyUI tree exists to run, so this script stands in for
upstream's ``model_prefetch``: it starts comfy-aimdo the way upstream ``main.py`` does
(``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync`` as ``cuda_malloc.py`` sets it, then
``comfy_aimdo.control.init`` before torch is imported, the CUDA context, then
``init_devices``), puts its own ``malloc_graph_enabled`` / ``pause_malloc_graph`` on
``comfy.model_prefetch`` (where SafeSage looks them up, as on a compiler-era ComfyUI) and drives
the scopes around ComfyUI 0dd9b154's real H3 ``DiTBlock`` modules at the real size (hidden
5376, 56 heads x 128, ffn 14336; bf16 weights resident, random) -- the residual stream updated
in place as H3 does, the output copied into a tensor made before ``begin`` as H3's ``forward``
does. Attention is what ComfyUI runs: ``attention_pytorch`` (its default on this GPU) or
``attention_sage`` (``--use-sage-attention``; with ``--emulate-arch sm120`` sage 2.2.0 dispatches
as on an RTX 5090), with SafeSage's override and MLP patch on top in the ``safesage-*`` arms.

What it cannot reproduce. Weight streaming (dynamic VRAM's VBAR, prefetch queues, offload
streams, per-block CUDA graphs), the rest of the model (embeddings, token refiner, final layer),
ComfyUI's sampler and wrappers, and an sm_120 GPU. The steps are the same input again, as a
sampler's are the same shapes again.

    python3 -m bench.length.compiler_probe --comfy /tmp/comfy/c0dd --out bench/results/compiler_h200.json \
        --arms plain-sdpa,safesage-sdpa,plain-sage,safesage-sage --tokens 169000 --blocks 2 --steps 3
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import subprocess
import sys
import time

from bench.common.cmdline import command

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HIDDEN, HEADS, HEAD_DIM, FFN, T_DIM = 5376, 56, 128, 14336, 2688
ARMS = ("plain-sdpa", "safesage-sdpa", "plain-sage", "safesage-sage")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--comfy", default=os.environ.get("COMFYUI_PATH"))
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--tokens", type=int, default=169_000)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--emulate-arch", default="sm120", help="what sage 2.2.0 and SafeSage see ('' = the real GPU)")
    ap.add_argument("--no-compiler", action="store_true", help="the same steps without recording (a control)")
    ap.add_argument("--verify", default="first")
    ap.add_argument("--free-gib", default="", help="safesage arms: the free memory SafeSage reads at each step "
                    "(e.g. 60,5,5: it drops after step 0), in GiB; default: the device's own")
    ap.add_argument("--blind", action="store_true", help="safesage arms: SafeSage is not told the compiler is on "
                    "(a control: plans and chunk sizes then follow free memory step by step)")
    ap.add_argument("--out")
    ap.add_argument("--timeout", type=int, default=420, help="per arm, seconds")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# =========================================================================== driver
def driver(a) -> None:
    res = {"bench": "compiler_probe", "command": command("length.compiler_probe"), "python": platform.python_version(),
           "tokens": a.tokens, "blocks": a.blocks, "steps": a.steps, "emulate_arch": a.emulate_arch,
           "compiler": not a.no_compiler, "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "arms": {}}
    for arm in [x for x in a.arms.split(",") if x]:
        cmd = [sys.executable, "-m", "bench.length.compiler_probe", "--child", arm] + [x for x in sys.argv[1:]]
        t0 = time.time()
        try:
            # the child imports ComfyUI's H3 blocks: its tree on PYTHONPATH (set here, the child's starter)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.abspath(a.comfy),
                                                                           os.environ.get("PYTHONPATH")])))
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, cwd=ROOT, env=env)
            rc, out, err = r.returncode, r.stdout, r.stderr
        except subprocess.TimeoutExpired as e:
            rc, out, err = "timeout", (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""), \
                (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
        final = next((x for x in reversed(lines) if x.get("final")), None)
        res["arms"][arm] = {"rc": rc, "secs": round(time.time() - t0, 1), "steps": [x for x in lines if "step" in x],
                            "result": final, "stderr_tail": err[-3000:]}
        print(json.dumps({"arm": arm, "rc": rc, "result": final}), flush=True)
        if rc != 0:
            print(err[-3000:], flush=True)
        elif final is None:
            print(out[-2000:], err[-2000:], flush=True)
        if a.out:
            _write(a.out, res)
    if a.out:
        _write(a.out, res)


def _write(path, res):
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


# =========================================================================== child
def _start_like_comfyui():
    """cuda_malloc.py's allocator, comfy_aimdo.control.init before torch, the CUDA context, then
    init_devices -- upstream main.py's order."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync" if not conf else conf + ",backend:cudaMallocAsync"
    assert "torch" not in sys.modules
    import comfy_aimdo.control as control
    if not control.init(simple_vram_headroom=None, nvml_pressure=True):
        raise SystemExit("comfy_aimdo.control.init failed")
    import torch
    assert torch.cuda.get_allocator_backend() == "cudaMallocAsync", torch.cuda.get_allocator_backend()
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.mem_get_info(dev)                  # creates the context, allocates nothing
    if not control.init_devices([(dev.index, 0)]):
        raise SystemExit("comfy_aimdo.control.init_devices failed")
    return torch, dev


class Compiler:
    """Stands in for upstream comfy.model_prefetch's compiler glue, on the real comfy-aimdo."""

    def __init__(self, torch, dev, enabled: bool):
        import comfy_aimdo.malloc_graph as mg
        self.mg, self.torch, self.dev, self.on = mg, torch, dev, enabled
        self.graph = None
        self.active = False
        self.breaks = 0

    # what SafeSage asks ComfyUI (comfy.model_prefetch.malloc_graph_enabled / pause_malloc_graph)
    def malloc_graph_enabled(self, device):
        return self.on and getattr(device, "type", None) == "cuda"

    @contextlib.contextmanager
    def pause_malloc_graph(self, sync=False):
        g = self.graph if self.active else None
        if g is not None:
            g.pause(sync)
        try:
            yield
        finally:
            if g is not None:
                g.resume(sync)

    # what H3's forward and prefetch_queue_pop do around the blocks
    def begin(self):
        if not self.on:
            return
        if self.graph is None:
            self.graph = self.mg.record(self.torch.cuda.current_stream(self.dev), False)
        else:
            self.graph.push()
        self.active = True

    def iterate(self, scope):
        if self.active and self.graph.iterate(scope):
            self.breaks += 1

    def end(self):
        if self.active:
            self.active = False
            if self.graph.pop():
                self.breaks += 1

    def abort(self):
        if self.graph is not None and self.active:
            self.active = False
            self.graph.abort()

    def stats(self):
        g = self.graph
        if g is None:
            return {}
        return {"rogues": g.rogue_count, "peak_used": g.peak_used, "virtual_bytes": g.virtual_bytes,
                "physical_bytes": g.physical_bytes}


def _emulate(arch: str):
    """sage 2.2.0 dispatches, and SafeSage plans, as on ``arch`` (bench/common/benchutil.py)."""
    from bench.common.benchutil import emulate_sage_arch, emulated_runtime
    try:
        emulate_sage_arch(arch)
    except ImportError:            # no sageattention here (the PyTorch arms): nothing to dispatch
        pass
    return emulated_runtime(arch)


def child(a) -> None:
    arm = a.child
    torch, dev = _start_like_comfyui()
    import comfy_aimdo
    from bench.common.synth_h3 import setup_comfy
    setup_comfy(a.comfy)                 # on PYTHONPATH, from the driver
    import comfy.cli_args
    comfy.cli_args.args.use_sage_attention = arm.endswith("sage")
    import comfy.ldm.minimax.model as h3
    import comfy.ldm.modules.attention as att
    import comfy.model_prefetch
    import comfy.ops
    comp = Compiler(torch, dev, not a.no_compiler)
    comfy.model_prefetch.malloc_graph_enabled = comp.malloc_graph_enabled
    comfy.model_prefetch.pause_malloc_graph = comp.pause_malloc_graph
    # what ComfyUI hands the override / runs: --use-sage-attention or its default on this GPU
    h3.optimized_attention = att.attention_sage if arm.endswith("sage") else att.attention_pytorch
    rt = _emulate(a.emulate_arch) if a.emulate_arch else None
    step_now = [0]
    if a.free_gib and arm.startswith("safesage"):
        import safe_ops.facts.budget
        free = [float(x) * 2 ** 30 for x in a.free_gib.split(",")]
        safe_ops.facts.budget.free_device_bytes = lambda device: int(free[min(step_now[0], len(free) - 1)])
    if a.blind:
        import safe_ops.facts.compiler
        safe_ops.facts.compiler.enabled = lambda device: False

    info = {"arm": arm, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(dev),
            "comfy_aimdo": getattr(comfy_aimdo, "__version__", None) or _dist("comfy-aimdo"),
            "sageattention": _dist("sageattention"), "allocator": torch.cuda.get_allocator_backend()}
    S, K = a.tokens, a.blocks
    with torch.inference_mode():
        g = torch.Generator(device=dev).manual_seed(0)
        blocks = []
        for _ in range(K):
            b = h3.DiTBlock(HIDDEN, HEADS, HEAD_DIM, FFN, T_DIM, 1e-5, 1e-5, adaln_dtype=torch.bfloat16,
                            dtype=torch.bfloat16, device=dev, operations=comfy.ops.disable_weight_init)
            for name, p in b.named_parameters():
                if p.ndim == 2:        # fan-in scaled, so that every block matters
                    p.copy_(torch.randn(p.shape, generator=g, device=dev) * p.shape[-1] ** -0.5)
                elif "norm" in name:
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g, device=dev) * 0.02)
            blocks.append(b)
        x0 = torch.randn(S, HIDDEN, generator=g, device=dev, dtype=torch.bfloat16)
        t_emb = torch.randn(1, T_DIM, generator=g, device=dev, dtype=torch.bfloat16)
        segs = [(0, S, 0)]
        to = {}

        def forward(out):
            comp.begin()
            try:
                h = x0.clone()
                for i, b in enumerate(blocks):
                    comp.iterate("block")
                    to["block_index"] = i
                    b(h, t_emb, segs, None, transformer_options=to)
                comp.iterate(None)
                out.copy_(h)
                del h
                comp.end()
            except BaseException:
                comp.abort()
                raise

        # One eager forward of plain ComfyUI first, outside any graph: the persistent workspaces
        # (cuBLAS/cuBLASLt, attention) exist before recording, as after a real ComfyUI's earlier
        # nodes and steps. SafeSage is installed after it, so its first call is in the recorded step.
        comp.on = False
        torch.cuda.current_blas_handle()
        warm = torch.empty_like(x0)
        forward(warm)
        del warm
        comp.on = not a.no_compiler
        if arm.startswith("safesage"):
            from safe_ops.models.h3 import cast_memo
            from safe_ops.ui import run_stats
            from safe_ops.attention.override import SafeAttention
            from safe_ops.models.h3.mlp_patch import H3ChunkedMLPForward
            from safe_ops.policy import Policy
            to["optimized_attention_override"] = SafeAttention(Policy(verify=a.verify), rt=rt)
            cast_memo.install()
            for i, b in enumerate(blocks):
                b.mlp.forward = H3ChunkedMLPForward(b.mlp, f"blocks.{i}.mlp", "auto")
        torch.cuda.synchronize()
        gc.collect()
        gc.disable()

        out = None
        for step in range(a.steps):
            step_now[0] = step
            torch.cuda.reset_peak_memory_stats(dev)
            breaks0, rog0 = comp.breaks, comp.stats().get("rogues", 0)
            t0 = time.perf_counter()
            out = torch.empty_like(x0)                   # outside the graph, as H3's forward
            forward(out)
            torch.cuda.synchronize()
            st = comp.stats()
            print(json.dumps({"step": step, "breaks": comp.breaks - breaks0,
                              "rogues_new": st.get("rogues", 0) - rog0, "ms": round((time.perf_counter() - t0) * 1e3, 1),
                              "torch_peak_allocated": torch.cuda.max_memory_allocated(dev), **st}), flush=True)
        final_stats = comp.stats()
        total_breaks = comp.breaks
        # the same forward without the compiler, in this process (graph destroyed first)
        comp.graph = None
        gc.enable()
        gc.collect()
        comp.on = False
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        ref = torch.empty_like(x0)
        t0 = time.perf_counter()
        forward(ref)
        torch.cuda.synchronize()
        eager_ms = (time.perf_counter() - t0) * 1e3
        eager_peak = torch.cuda.max_memory_allocated(dev) - base
        d = (out.float() - ref.float())
        rel = (d.norm() / ref.float().norm()).item()
        result = {"final": True, **info, "breaks_total": total_breaks, **final_stats,
                  "out_vs_no_compiler_rel_l2": rel, "out_bitwise_equal_no_compiler": bool(torch.equal(out, ref)),
                  "out_finite": bool(torch.isfinite(out).all()), "eager_ms": round(eager_ms, 1),
                  "eager_peak_extra_bytes": eager_peak, "out_checksum": float(out.float().sum().item())}
        if arm.startswith("safesage"):
            snap = run_stats.snapshot()
            result["safesage"] = {k: snap.get(k) for k in ("plans", "fallback_reasons", "probes", "probe_failures",
                                                            "replans", "mlp", "plan:kv_chunks", "plan:head_groups",
                                                            "plan:direct", "plan:repack", "plan:sdpa")}
            result["free_gib"], result["blind"] = a.free_gib, a.blind
        print(json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)          # no interpreter-exit destructor order games with aimdo's hooks


def _dist(name):
    import importlib.metadata as md
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


if __name__ == "__main__":
    args = parse()
    if args.child:
        child(args)
    else:
        driver(args)
