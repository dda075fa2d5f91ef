"""A stand-in raylight worker for tests/unit/test_multigpu_worker.py: ``python raylight_worker_child.py PACK_DIR``.

Like a Ray actor of raylight it has ComfyUI's tree on its PYTHONPATH and no custom nodes: the pack
is not importable by name (the test leaves the repository off PYTHONPATH). It receives
safe_ops/multigpu/worker.py as raylight would deliver it pickled by value -- loaded here by path, not
imported -- and runs ``model = apply_in_worker(model, PACK_DIR, settings)`` on a real ModelPatcher of
a tiny MiniMax H3, then ``report(model)``. Prints one JSON line.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import torch

PACK = sys.argv[1]
import comfy.cli_args  # noqa: E402

comfy.cli_args.args.cpu = True
import comfy.model_patcher  # noqa: E402
import comfy.ops  # noqa: E402
import comfy.ldm.minimax.model as h3  # noqa: E402

H3_CONFIG = dict(
    hidden_size=64, num_layers=2, token_refiner_num_layers=1, num_attention_heads=2,
    attention_head_dim=32, ffn_hidden_size=128, latents_dim=24, audio_latents_dim=32,
    text_dim=1024, timestep_input_dim=256, time_embed_hidden_size=64, time_embed_dim=64,
    rope_inv_freq_len=16,
)


def main() -> None:
    importable = importlib.util.find_spec("safe_ops") is not None
    spec = importlib.util.spec_from_file_location("delivered_worker",
                                                  os.path.join(PACK, "safe_ops", "multigpu", "worker.py"))
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    dm = h3.MiniMaxH3Model(**H3_CONFIG, dtype=torch.bfloat16, device="cpu", operations=comfy.ops.manual_cast)
    base = torch.nn.Module()
    base.diffusion_model = dm
    model = comfy.model_patcher.ModelPatcher(base, torch.device("cpu"), torch.device("cpu"))
    settings = dict(kernel="auto", mlp_chunking="tokens", mlp_chunk_tokens=256)
    patched = worker.apply_in_worker(model, PACK, settings)
    bad = worker.apply_in_worker(model, PACK, dict(kernel="no such kernel"))
    rep = worker.report(patched)
    print(json.dumps({
        "pack_importable_by_name": importable,
        "same_model": patched is model,
        "object_patches": sorted(getattr(patched, "object_patches", {})),
        "input_object_patches": sorted(getattr(model, "object_patches", {})),
        "bad_settings_same_model": bad is model,
        "report": {k: v for k, v in rep.items() if k != "multigpu"},
        "multigpu_counters": (sorted(rep["multigpu"]) if isinstance(rep.get("multigpu"), dict)
                              else rep.get("multigpu")),
    }))


if __name__ == "__main__":
    main()
