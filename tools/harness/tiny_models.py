"""Write tiny random-weight diffusion models with ComfyUI's own model classes (no downloads).

Run as a module with the server's python; COMFYUI_PATH must point at the ComfyUI tree under test,
and that tree (first) and the repository root must be on PYTHONPATH (tools.harness.comfy_server.make_model
sets both):

    PYTHONPATH=$COMFYUI_PATH:. python -m tools.harness.tiny_models sd2 OUT.safetensors [--seed N]
    PYTHONPATH=$COMFYUI_PATH:. python -m tools.harness.tiny_models h3  OUT.safetensors [--seed N]   (H3 trees only)
    PYTHONPATH=$COMFYUI_PATH:. python -m tools.harness.tiny_models lotus  OUT.safetensors [--seed N]
    PYTHONPATH=$COMFYUI_PATH:. python -m tools.harness.tiny_models sd_vae OUT.safetensors [--seed N]

Prints one JSON line on stdout describing what was written (detected model class, counts the tests
use to derive expected numbers).

sd2: an SD2-class UNet, one level (model_channels 320, context_dim 1024, linear transformer):
     ComfyUI detects it as SD20 and LotusConditioning's [1, 2, 1024] embedding fits its context.
lotus: the sd2 UNet with Lotus-D's class embedding (adm_in_channels 4, 'sequential'): ComfyUI
     detects it as LotusD, the class of lotus-depth-d-v1-1.safetensors (the quick-start template's
     model), and runs it through model_base.Lotus.
sd_vae: the SD1.x/SD2.x KL VAE (vae-ft-mse-840000-ema-pruned.safetensors' architecture and key
     names: ch 128, ch_mult 1-2-4-4, 4 latent channels; ComfyUI reads that encoder config from no
     key, so it is full size: about 84 M parameters, written fp16, 160 MiB), random weights.
h3:  a MiniMax H3 DiT: hidden 64, 1 block + 1 token-refiner block, 2 heads x 32, ffn 128,
     text_dim 1024. Fan-in-scaled init (std = fan_in**-0.5) so that the adaLN gates are O(1) and
     every block changes the output (with std 0.02 the blocks are no-ops and tests pass
     vacuously). The block and refiner Linear weights are stored fp8 e4m3 scaled, in the
     encoding that loads as QuantizedTensor on ComfyUI 0.3.75 and 0dd9b154: per layer a 0-d fp32
     `<layer>.weight_scale` (= amax/448), the weight as (w/scale).to(float8_e4m3fn), and the
     layer listed in the safetensors metadata `_quantization_metadata`.
"""

import argparse
import json
import os
import sys


def _setup_comfy():
    root = os.environ.get("COMFYUI_PATH")
    if not root or not os.path.isfile(os.path.join(root, "comfy", "model_management.py")):
        sys.exit("COMFYUI_PATH must point at a ComfyUI tree")
    import comfy.cli_args
    if os.path.realpath(os.path.dirname(os.path.dirname(comfy.cli_args.__file__))) != os.path.realpath(root):
        sys.exit("COMFYUI_PATH=%s is not the ComfyUI on PYTHONPATH (%s)" % (root, comfy.cli_args.__file__))

    comfy.cli_args.args.cpu = True  # before model_management is imported
    return root


SD2_UNET_CONFIG = {
    "use_checkpoint": False,
    "image_size": 32,
    "use_spatial_transformer": True,
    "legacy": False,
    "adm_in_channels": None,
    "in_channels": 4,
    "out_channels": 4,
    "model_channels": 320,
    "num_res_blocks": [1],
    "channel_mult": [1],
    "transformer_depth": [1],
    "transformer_depth_output": [1, 1],
    "transformer_depth_middle": 1,
    "context_dim": 1024,
    "use_linear_in_transformer": True,
    "use_temporal_attention": False,
    "use_temporal_resblock": False,
}


def make_sd2(out, seed):
    import torch
    import comfy.model_detection
    import comfy.supported_models
    import safetensors.torch

    torch.manual_seed(seed)
    model_config = comfy.supported_models.SD20(dict(SD2_UNET_CONFIG))
    unet = model_config.get_model({}).diffusion_model
    sd = {}
    for k, v in unet.state_dict().items():
        v = v.detach().float()
        if v.dim() > 1:  # fan-in scaled, so activations stay O(1) through the net
            sd[k] = (torch.randn_like(v) * v[0].numel() ** -0.5).contiguous()
        elif k.endswith(".weight"):  # the 1-d weights of a UNet are its norms
            sd[k] = torch.ones_like(v)
        else:
            sd[k] = torch.zeros_like(v)
    detected = comfy.model_detection.model_config_from_unet(sd, "")
    if detected is None or type(detected).__name__ != "SD20":
        raise SystemExit("tiny SD2 UNet detected as %r, expected SD20" % (type(detected).__name__,))
    unet.load_state_dict(sd)
    effect = _attention_effect_sd2(unet)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    safetensors.torch.save_file(sd, out)
    blocks = sorted({k.split(".transformer_blocks.")[0] + "." + k.split(".transformer_blocks.")[1].split(".")[0]
                     for k in sd if ".transformer_blocks." in k})
    return {
        "kind": "sd2",
        "path": out,
        "detected": type(detected).__name__,
        # every BasicTransformerBlock calls attention twice per forward: attn1 (self), attn2 (cross)
        "transformer_blocks": len(blocks),
        "attention_calls_per_forward": 2 * len(blocks),
        # relative change of one forward's output when every attention output is zeroed: shows
        # that attention matters in this random model, so "same latent" tests are not vacuous
        "attention_effect": effect,
        "bytes": os.path.getsize(out),
    }


def _rel_change(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def _zero_attention(func, *args, **kwargs):
    return func(*args, **kwargs) * 0.0


def _attention_effect_sd2(unet):
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 8, 8, generator=g)
    ctx = torch.randn(1, 2, 1024, generator=g)
    t = torch.tensor([500.0])
    with torch.no_grad():
        ref = unet(x, t, context=ctx, transformer_options={})
        ablated = unet(x, t, context=ctx, transformer_options={"optimized_attention_override": _zero_attention})
    return _rel_change(ablated, ref)


def _block_effects_h3(model):
    import torch

    g = torch.Generator().manual_seed(0)
    video = torch.randn(1, 24, 2, 4, 4, generator=g)
    audio = torch.randn(1, 32, 2, 4, generator=g)
    ctx = torch.randn(1, 2, 1024, generator=g)
    t = torch.tensor([500.0])

    def fwd(**opts):
        with torch.inference_mode():
            return model([video, audio], t, ctx, transformer_options=opts)[0]

    ref = fwd()
    no_attn = fwd(optimized_attention_override=_zero_attention)
    hooks = [m.register_forward_hook(lambda mod, inp, out: out * 0.0)
             for name, m in model.named_modules() if name.endswith(".mlp")]
    try:
        no_mlp = fwd()
    finally:
        for h in hooks:
            h.remove()
    return {"attention": _rel_change(no_attn, ref), "mlp": _rel_change(no_mlp, ref)}


def make_lotus(out, seed):
    """The tiny SD2 UNet with Lotus-D's class embedding (``label_emb``, adm_in_channels 4): ComfyUI
    detects it as LotusD and builds model_base.Lotus (its y = the depth task embedding)."""
    import torch
    import comfy.model_detection
    import comfy.supported_models
    import safetensors.torch

    if not hasattr(comfy.supported_models, "LotusD"):
        raise SystemExit("this ComfyUI has no Lotus support")
    torch.manual_seed(seed)
    # num_head_channels as LotusD has it since upstream added it (0.3.75 has only num_classes there)
    config = dict(SD2_UNET_CONFIG, adm_in_channels=4, num_heads=-1, num_head_channels=64)
    model_config = comfy.supported_models.LotusD(config)
    unet = model_config.get_model({}).diffusion_model
    sd = _fan_in_init(unet)
    detected = comfy.model_detection.model_config_from_unet(sd, "")
    if detected is None or type(detected).__name__ != "LotusD":
        raise SystemExit("tiny Lotus UNet detected as %r, expected LotusD" % (type(detected).__name__,))
    unet.load_state_dict(sd)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    safetensors.torch.save_file(sd, out)
    blocks = {k.split(".transformer_blocks.")[0] for k in sd if ".transformer_blocks." in k}
    return {"kind": "lotus", "path": out, "detected": type(detected).__name__,
            "transformer_blocks": len(blocks), "attention_calls_per_forward": 2 * len(blocks),
            "bytes": os.path.getsize(out)}


def _fan_in_init(module):
    """Random weights that keep activations O(1): fan-in scaled matrices/kernels, norm weights 1,
    biases 0 (the 1-d tensors of a UNet or VAE are its norms and biases)."""
    import torch

    sd = {}
    for k, v in module.state_dict().items():
        v = v.detach().float()
        if v.dim() > 1:
            sd[k] = (torch.randn_like(v) * v[0].numel() ** -0.5).contiguous()
        elif k.endswith(".weight"):
            sd[k] = torch.ones_like(v)
        else:
            sd[k] = torch.zeros_like(v)
    return sd


#: comfy/sd.py's "default SD1.x/SD2.x VAE parameters" (the encoder's are read from no key)
SD_VAE_DDCONFIG = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
                   "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}


def make_sd_vae(out, seed):
    """An SD KL VAE with random weights under the original checkpoint's key names (encoder.*,
    decoder.*, quant_conv.*, post_quant_conv.*); checked by loading it with comfy.sd.VAE and
    encoding / decoding a 16x16 image."""
    import torch
    import comfy.sd
    from comfy.ldm.models.autoencoder import AutoencoderKL
    import safetensors.torch

    torch.manual_seed(seed)
    model = AutoencoderKL(ddconfig=dict(SD_VAE_DDCONFIG), embed_dim=4)
    sd = {k: v.half() for k, v in _fan_in_init(model).items()}
    vae = comfy.sd.VAE(sd=dict(sd))
    img = torch.rand(1, 16, 16, 3)
    latent = vae.encode(img)
    back = vae.decode(latent)
    if tuple(latent.shape) != (1, 4, 2, 2) or tuple(back.shape[-3:]) != (16, 16, 3) or not torch.isfinite(back).all():
        raise SystemExit("tiny SD VAE: encode %s, decode %s" % (tuple(latent.shape), tuple(back.shape)))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    safetensors.torch.save_file(sd, out)
    return {"kind": "sd_vae", "path": out, "latent_channels": int(vae.latent_channels),
            "parameters": int(sum(v.numel() for v in sd.values())), "bytes": os.path.getsize(out)}


H3_CONFIG = dict(
    hidden_size=64, num_layers=1, token_refiner_num_layers=1, num_attention_heads=2,
    attention_head_dim=32, ffn_hidden_size=128, latents_dim=24, audio_latents_dim=32,
    text_dim=1024, timestep_input_dim=256, time_embed_hidden_size=64, time_embed_dim=64,
    rope_inv_freq_len=4,  # rope covers 3 axes x 2 x 4 = 24 of the 32 head dims (real H3: 96 of 128)
)


#: k RMSNorm weight channels scaled on ``--outlier-blocks`` (outside the rope's 24 rotated dims):
#: those blocks' keys and queries concentrate signal in a few channels, as H3's late blocks do
OUTLIER_CHANNELS = (30, 31)
OUTLIER_NORMS = ("k_norm",)          # keys only: x f on q too makes the softmax one-hot at these sizes


def make_h3(out, seed, blocks=None, outlier_blocks=(), outlier_factor=32.0):
    """``blocks``: DiT blocks (default H3_CONFIG's 1); ``outlier_blocks``: blocks whose q_norm/k_norm
    weights are ``outlier_factor`` on :data:`OUTLIER_CHANNELS` (the quality guard's tests)."""
    import torch
    import comfy.model_detection
    import comfy.supported_models
    import safetensors.torch

    if not hasattr(comfy.supported_models, "MiniMaxH3"):
        raise SystemExit("this ComfyUI has no MiniMax H3 support")
    torch.manual_seed(seed)
    from comfy.ldm.minimax.model import MiniMaxH3Model
    import comfy.ops

    config = dict(H3_CONFIG, num_layers=blocks or H3_CONFIG["num_layers"])
    model = MiniMaxH3Model(**config, dtype=torch.float32, device="cpu",
                           operations=comfy.ops.disable_weight_init)
    sd = {}
    for k, v in model.state_dict().items():
        v = v.detach().float()
        if k == "rope.inv_freq":
            n = v.shape[0]
            sd[k] = 1.0 / (10000.0 ** (torch.arange(n, dtype=torch.float32) / n))
        elif v.dim() >= 2:
            fan_in = v[0].numel()
            sd[k] = torch.randn_like(v) * fan_in ** -0.5
        elif k.endswith("bias"):
            sd[k] = torch.randn_like(v) * 0.02
        else:  # norm weights
            sd[k] = torch.ones_like(v)
            if any(k == f"blocks.{b}.attn.{n}.weight" for b in outlier_blocks for n in OUTLIER_NORMS):
                sd[k][list(OUTLIER_CHANNELS)] = outlier_factor
    model.load_state_dict(sd)
    model.requires_grad_(False)  # as ComfyUI does; kitchen's in-place RoPE refuses autograd
    effects = _block_effects_h3(model)
    quant_layers = {}
    for k in list(sd):
        if not k.endswith(".weight") or sd[k].dim() != 2:
            continue
        layer = k[: -len(".weight")]
        if not (layer.startswith("blocks.") or layer.startswith("token_refiner.blocks.")):
            continue
        if ".adaln_proj." in layer:  # keep the modulation path in full precision
            continue
        w = sd[k]
        scale = (w.abs().amax() / 448.0).clamp(min=1e-12).to(torch.float32)
        sd[k] = (w / scale).to(torch.float8_e4m3fn).contiguous()
        sd[layer + ".weight_scale"] = scale.reshape(())
        quant_layers[layer] = {"format": "float8_e4m3fn"}
    metadata = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": quant_layers})}
    detected = comfy.model_detection.model_config_from_unet(sd, "", metadata=metadata)
    if detected is None or type(detected).__name__ != "MiniMaxH3":
        raise SystemExit("tiny H3 detected as %r, expected MiniMaxH3" % (type(detected).__name__,))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    safetensors.torch.save_file(sd, out, metadata=metadata)
    return {
        "kind": "h3",
        "path": out,
        "detected": type(detected).__name__,
        "blocks": config["num_layers"],
        "outlier_blocks": list(outlier_blocks),
        "refiner_blocks": H3_CONFIG["token_refiner_num_layers"],
        "quantized_layers": sorted(quant_layers),
        # relative change of one forward's video output when attention / the MLPs are zeroed:
        # the blocks matter, so "same latent" and "MLP patched" tests are not vacuous
        "attention_effect": effects["attention"],
        "mlp_effect": effects["mlp"],
        "bytes": os.path.getsize(out),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["sd2", "h3", "lotus", "sd_vae"])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--blocks", type=int, default=None, help="h3: DiT blocks (default 1)")
    ap.add_argument("--outlier-blocks", default="", help="h3: comma-separated blocks with outlier q/k channels")
    ap.add_argument("--outlier-factor", type=float, default=32.0)
    a = ap.parse_args()
    _setup_comfy()
    if a.kind == "sd2":
        info = make_sd2(a.out, a.seed)
    elif a.kind == "lotus":
        info = make_lotus(a.out, a.seed)
    elif a.kind == "sd_vae":
        info = make_sd_vae(a.out, a.seed)
    else:
        info = make_h3(a.out, a.seed, a.blocks, tuple(int(b) for b in a.outlier_blocks.split(",") if b),
                       a.outlier_factor)
    print(json.dumps(info))


if __name__ == "__main__":
    main()
