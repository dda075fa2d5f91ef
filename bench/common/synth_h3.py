"""Write a synthetic MiniMax-H3-shaped fp8_scaled checkpoint (random weights, real dimensions).

``--weights int8`` writes the block Linears as ComfyUI's ``int8_tensorwise`` instead, ``--weights
bf16`` leaves them bf16 (no quantization metadata): the report's clean int8 / bf16 rows.

The real `minimax_h3_ref2va_pruned_fp8_scaled.safetensors` is not available here, so this writes a
stand-in that goes through exactly the same ComfyUI loading code: every block / token-refiner
Linear (qkv_proj, out_proj, mlp.fc1, mlp.fc2) is stored float8_e4m3fn with a 0-d fp32
`<layer>.weight_scale` (= amax/448) and listed in the safetensors metadata
`_quantization_metadata`, so ComfyUI 0dd9b154 logs "Found quantization metadata version 1" /
"Detected mixed precision quantization" and loads them as QuantizedTensor (the encoding
tests/comfy/tiny_models.py uses, at real size).

Real dimensions by default: hidden 5376, 56 heads x 128, ffn 14336, text_dim 5120, 2 refiner
blocks; the number of DiT blocks is configurable (`--blocks`, real model 50; each fp8 block is
~0.39 GB, so 2-4 blocks keep the file small and quick to write). The adaLN modulation is stored
in the "curve" form that ComfyUI detects from `adaln_t_table` (`--adaln curve`, the default:
consistent with a "pruned" 50-block checkpoint of ~20 GB) or as the full-width time-embedder form
(`--adaln full`, +0.52 GB a block in bf16). Other weights are bf16, the output heads / patch
projections / time embedder fp32 as ComfyUI's H3 model declares them.

Initialisation is fan-in scaled (std = fan_in**-0.5) so the adaLN gates are O(1) and every block
changes the output. Deterministic from `--seed`: each tensor has its own generator seeded from
(seed, crc32(name)); numbers differ between a CPU and a CUDA generator, so the device used is
printed (`--device`, default cuda when available).

**Late-block drift** (synthetic; issue 46 goal 8): ``--drift-blocks N --drift-channels C
--drift-factor F`` multiplies C gain channels of the attention's ``q_norm`` and ``k_norm`` (the RMSNorm
weights applied to q and k, one per head dimension, shared by the heads) in each of the last N DiT
blocks by F: a few outlier q/k channels, the mechanism seen on the real H3's late blocks. The
channels are drawn per block from (seed, block) by Python's ``random`` (the same on every device);
the same C channels in q_norm and k_norm, so their logit terms grow by F squared. Every other tensor
is bit-identical to the undrifted checkpoint of the same seed and generator device.

Every checkpoint records its settings (blocks, seed, adaLN form, weights, dims, generator device, the
drift or null) as JSON in its safetensors metadata under ``safesage_synth`` (:func:`read_settings`
reads it back from the file's header, without torch); bench.repro records them in its JSON and keys
its kept latents on them. ``--reuse`` keeps an existing OUT whose recorded settings are the ones asked
for (a 50-block file takes ~25 s to write) and writes it again otherwise.

    PYTHONPATH=/path/to/ComfyUI python -m bench.common.synth_h3 OUT.safetensors --blocks 2 --seed 0
    PYTHONPATH=/path/to/ComfyUI python -m bench.common.synth_h3 /tmp/h3_50_drift.safetensors --blocks 50 \
        --drift-blocks 8 --drift-channels 4 --drift-factor 16 --reuse

Prints one JSON line describing what was written (or reused). Never commit the output.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import struct
import sys
import time
import zlib

REAL = dict(
    hidden_size=5376, num_attention_heads=56, attention_head_dim=128, ffn_hidden_size=14336,
    latents_dim=24, audio_latents_dim=32, text_dim=5120, timestep_input_dim=256,
    time_embed_hidden_size=5376, time_embed_dim=2688, rope_inv_freq_len=16,
    token_refiner_num_layers=2,
)
QUANT_SUFFIXES = (".attn.qkv_proj", ".attn.out_proj", ".mlp.fc1", ".mlp.fc2")
#: the safetensors metadata keys holding a checkpoint's settings and its info line (JSON)
SETTINGS_KEY, INFO_KEY = "safesage_synth", "safesage_synth_info"
DRIFT_NORMS = ("q_norm", "k_norm")


def setup_comfy(root: str | None):
    """The ComfyUI tree this process imports: it comes from ``PYTHONPATH`` (set by whoever starts the
    bench, e.g. ``PYTHONPATH=$COMFYUI_PATH python -m bench.common.synth_h3 ...``); exits saying so when ComfyUI is
    not importable or is another tree than ``root`` (--comfy / COMFYUI_PATH) names."""
    import importlib.util
    root = root or os.environ.get("COMFYUI_PATH")
    spec = importlib.util.find_spec("comfy")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("synth_h3: ComfyUI is not importable: put a ComfyUI tree with MiniMax H3 (0dd9b154) on "
                 "PYTHONPATH, e.g. PYTHONPATH=$COMFYUI_PATH python -m bench.<script> ...")
    found = os.path.dirname(list(spec.submodule_search_locations)[0])
    if root and os.path.realpath(found) != os.path.realpath(root):
        sys.exit(f"synth_h3: --comfy / COMFYUI_PATH names {root}, but PYTHONPATH imports ComfyUI from {found}")
    return found


def shapes(blocks: int, adaln: str, curve_k: int, curve_grid: int, dims: dict | None = None):
    """{name: (shape, kind)} of the H3 state dict, from ComfyUI's own module on the meta device."""
    import comfy.ops
    import torch
    from comfy.ldm.minimax.model import MiniMaxH3Model

    cfg = dict(REAL if dims is None else dims)
    cfg["num_layers"] = blocks
    if adaln == "curve":
        cfg["adaln_curve_grid"] = curve_grid
        cfg["time_embed_dim"] = curve_k
    with torch.device("meta"):
        m = MiniMaxH3Model(**cfg, dtype=torch.bfloat16, device="meta", operations=comfy.ops.disable_weight_init)
    out = {}
    for k, v in m.state_dict().items():
        out[k] = (tuple(v.shape), v.dtype)
    return out, cfg


def _gen(name: str, seed: int, device):
    import torch
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63))
    return g


def drift_plan(blocks: int, head_dim: int, seed: int, drift_blocks: int, drift_channels: int,
               drift_factor: float) -> dict | None:
    """The late-block drift as recorded (None without one): the last ``drift_blocks`` DiT blocks, each
    with its ``drift_channels`` gain channels of q_norm and k_norm (drawn from (seed, block), the same on
    every device) multiplied by ``drift_factor``."""
    if not drift_blocks:
        return None
    if not 0 < drift_blocks <= blocks:
        raise ValueError(f"--drift-blocks {drift_blocks}: 1 to the {blocks} blocks")
    if not 0 < drift_channels <= head_dim:
        raise ValueError(f"--drift-channels {drift_channels}: 1 to the head dimension {head_dim}")
    if not drift_factor > 0:
        raise ValueError(f"--drift-factor {drift_factor}: a positive factor")
    chans = {}
    for b in range(blocks - drift_blocks, blocks):
        rng = random.Random(seed * 1_000_003 + zlib.crc32(f"drift.blocks.{b}".encode()))
        chans[str(b)] = sorted(rng.sample(range(head_dim), drift_channels))
    return {"synthetic": True, "mechanism": "a few outlier q/k gain channels in late blocks (seen on the real H3)",
            "norms": list(DRIFT_NORMS), "blocks": [int(b) for b in chans], "channels_per_block": drift_channels,
            "factor": drift_factor, "channels": chans}


def drifted_channels(name: str, drift: dict | None):
    """The channels of tensor ``name`` the drift scales, or None."""
    if drift is None or not name.startswith("blocks."):
        return None
    parts = name.split(".")       # blocks.<i>.attn.<q_norm|k_norm>.weight
    if len(parts) == 5 and parts[2] == "attn" and parts[3] in drift["norms"] and parts[4] == "weight":
        return drift["channels"].get(parts[1])
    return None


def _recorded(path: str, key: str) -> dict | None:
    """The JSON a checkpoint of this module records under ``key`` in its safetensors metadata, read from
    the file's header without torch; None for another file or one that cannot be read."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100_000_000:
                return None
            header = json.loads(f.read(n))
        return json.loads((header.get("__metadata__") or {})[key])
    except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error):
        return None


def read_settings(path: str) -> dict | None:
    """What the checkpoint at ``path`` was made from (:func:`settings`; the drift under "drift"), or None."""
    return _recorded(path, SETTINGS_KEY)


def settings(blocks: int, seed: int, adaln: str, weights: str, generator_device: str, dims: dict | None,
             drift: dict | None, curve_k: int = 64, curve_grid: int = 1001) -> dict:
    """What a checkpoint is made from (its metadata; ``--reuse`` compares it)."""
    return {"blocks": blocks, "seed": seed, "adaln": adaln, "curve_k": curve_k, "curve_grid": curve_grid,
            "weights": weights, "generator_device": generator_device, "dims": "real" if dims is None else dims,
            "drift": drift}


def build(blocks: int = 2, seed: int = 0, adaln: str = "curve", curve_k: int = 64, curve_grid: int = 1001,
          device: str | None = None, dims: dict | None = None, weights: str = "fp8", drift_blocks: int = 0,
          drift_channels: int = 4, drift_factor: float = 16.0):
    """Return (state_dict on CPU, metadata, info). ``weights``: fp8 | int8 | bf16 block Linears;
    ``drift_*``: the late-block drift (:func:`drift_plan`; none with ``drift_blocks`` 0)."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    shp, cfg = shapes(blocks, adaln, curve_k, curve_grid, dims)
    drift = drift_plan(blocks, cfg["attention_head_dim"], seed, drift_blocks, drift_channels, drift_factor)
    sd, quant_layers = {}, {}
    for k, (shape, dtype) in shp.items():
        if k == "rope.inv_freq":
            n = shape[0]
            sd[k] = 1.0 / (10000.0 ** (torch.arange(n, dtype=torch.float32) / n))
            continue
        g = _gen(k, seed, device)
        if k == "adaln_t_table":  # [grid, K] time-embedding curve basis: smooth in t, O(1)
            grid, kk = shape
            t = torch.linspace(0, 1, grid, device=device, dtype=torch.float32)[:, None]
            freq = torch.randn(1, kk, generator=g, device=device) * 3.0
            phase = torch.rand(1, kk, generator=g, device=device) * 6.2832
            sd[k] = torch.sin(t * freq + phase).cpu().contiguous()
            continue
        if len(shape) >= 2:
            fan_in = 1
            for s in shape[1:]:
                fan_in *= s
            w = torch.randn(shape, generator=g, device=device, dtype=torch.float32) * fan_in ** -0.5
        elif k.endswith("bias"):
            w = torch.randn(shape, generator=g, device=device, dtype=torch.float32) * 0.02
        else:  # norm weights
            w = torch.ones(shape, device=device, dtype=torch.float32)
            chans = drifted_channels(k, drift)
            if chans is not None:
                w[chans] *= drift["factor"]
        layer = k[: -len(".weight")] if k.endswith(".weight") else None
        if (weights != "bf16" and layer is not None and w.dim() == 2 and layer.endswith(QUANT_SUFFIXES)
                and layer.startswith(("blocks.", "token_refiner.blocks."))):
            if weights == "int8":
                # ComfyUI's int8_tensorwise: int8 weight, 0-d fp32 weight_scale = amax/127
                scale = (w.abs().amax() / 127.0).clamp(min=1e-12).to(torch.float32)
                sd[k] = (w / scale).round().clamp(-127, 127).to(torch.int8).cpu().contiguous()
                quant_layers[layer] = {"format": "int8_tensorwise"}
            else:
                scale = (w.abs().amax() / 448.0).clamp(min=1e-12).to(torch.float32)
                sd[k] = (w / scale).to(torch.float8_e4m3fn).cpu().contiguous()
                quant_layers[layer] = {"format": "float8_e4m3fn"}
            sd[layer + ".weight_scale"] = scale.reshape(()).cpu()
        else:
            keep = torch.float32 if dtype == torch.float32 else torch.bfloat16
            sd[k] = w.to(keep).cpu().contiguous()
        del w
    made = settings(blocks, seed, adaln, weights, str(device), dims, drift, curve_k, curve_grid)
    metadata = ({"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": quant_layers})}
                if quant_layers else {})
    info = {
        "blocks": blocks, "refiner_blocks": cfg["token_refiner_num_layers"], "seed": seed, "adaln": adaln,
        "weights": weights,
        "generator_device": str(device), "quantized_layers": len(quant_layers),
        "hidden_size": cfg["hidden_size"], "heads": cfg["num_attention_heads"],
        "head_dim": cfg["attention_head_dim"], "ffn": cfg["ffn_hidden_size"], "text_dim": cfg["text_dim"],
        "drift": drift,
    }
    metadata.update({SETTINGS_KEY: json.dumps(made), INFO_KEY: json.dumps(info)})
    return sd, metadata, info


def wanted(blocks: int = 2, seed: int = 0, adaln: str = "curve", curve_k: int = 64, curve_grid: int = 1001,
           device: str | None = None, dims: dict | None = None, weights: str = "fp8", drift_blocks: int = 0,
           drift_channels: int = 4, drift_factor: float = 16.0) -> dict:
    """The settings :func:`build` records for these arguments, without building."""
    if device is None:
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    drift = drift_plan(blocks, (dims or REAL)["attention_head_dim"], seed, drift_blocks, drift_channels,
                       drift_factor)
    return json.loads(json.dumps(settings(blocks, seed, adaln, weights, str(device), dims, drift, curve_k,
                                          curve_grid)))


def write(out: str, reuse: bool = False, **kw) -> dict:
    """Write the checkpoint to ``out`` and return its info line; ``reuse``: keep an ``out`` made with
    the same settings (its recorded info, ``reused`` true)."""
    t0 = time.time()
    if reuse and os.path.exists(out) and read_settings(out) == wanted(**kw):
        info = _recorded(out, INFO_KEY)
        if info is not None:
            info.update(path=out, detected="MiniMaxH3", bytes=os.path.getsize(out), reused=True,
                        seconds=round(time.time() - t0, 1))
            return info
    import comfy.model_detection
    import safetensors.torch

    sd, metadata, info = build(**kw)
    detected = comfy.model_detection.model_config_from_unet(sd, "", metadata=metadata)
    if detected is None or type(detected).__name__ != "MiniMaxH3":
        raise SystemExit("synth_h3: detected as %r, expected MiniMaxH3" % (type(detected).__name__,))
    os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
    safetensors.torch.save_file(sd, out, metadata=metadata)
    info.update(path=out, detected=type(detected).__name__, bytes=os.path.getsize(out),
                seconds=round(time.time() - t0, 1))
    return info


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--blocks", type=int, default=2, help="DiT blocks (real model: 50)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--adaln", choices=["curve", "full"], default="curve")
    ap.add_argument("--weights", choices=["fp8", "int8", "bf16"], default="fp8",
                    help="block Linears: fp8_scaled (the reporter's failing checkpoint), ComfyUI's int8_tensorwise, "
                         "or plain bf16 (the report's clean int8/bf16 rows)")
    ap.add_argument("--device", default=None, help="generator device (default: cuda if available)")
    ap.add_argument("--comfy", default=None, help="ComfyUI tree (default: $COMFYUI_PATH)")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny dims (hidden 256, 2x128 heads, ffn 512) for CPU smoke tests; not H3-sized")
    ap.add_argument("--drift-blocks", type=int, default=0,
                    help="synthetic late-block drift: scale q_norm/k_norm gain channels in the last N blocks (0: none)")
    ap.add_argument("--drift-channels", type=int, default=4, help="channels scaled per drifting block")
    ap.add_argument("--drift-factor", type=float, default=16.0, help="their factor")
    ap.add_argument("--reuse", action="store_true", help="keep an existing OUT made with the same settings")
    a = ap.parse_args(argv)
    setup_comfy(a.comfy)
    import comfy.cli_args
    import torch
    if a.device == "cpu" or not torch.cuda.is_available():
        comfy.cli_args.args.cpu = True  # before comfy.model_management is imported
    dims = None
    if a.tiny:
        dims = dict(REAL, hidden_size=256, num_attention_heads=2, ffn_hidden_size=512, text_dim=5120,
                    time_embed_hidden_size=256, time_embed_dim=128)
    try:
        info = write(a.out, reuse=a.reuse, blocks=a.blocks, seed=a.seed, adaln=a.adaln, device=a.device, dims=dims,
                     weights=a.weights, drift_blocks=a.drift_blocks, drift_channels=a.drift_channels,
                     drift_factor=a.drift_factor)
    except ValueError as e:
        ap.error(str(e))
    print(json.dumps(info))


if __name__ == "__main__":
    main()
