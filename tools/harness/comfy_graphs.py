"""API-format graphs and latent helpers for the headless-ComfyUI tests."""

from __future__ import annotations

SAFESAGE_DEFAULTS = {
    "kernel": "auto",
    "mlp_chunking": "auto",
    "mlp_chunk_tokens": 16384,
    "verify": "first",
    "debug_sync": False,
}

# SafeSageAttention at its defaults, as an entry of sd2_chain's ``nodes``
SAFESAGE_NODE = ("SafeSageAttention", SAFESAGE_DEFAULTS)


def _common(model_ref, latent_node, seed, steps, cfg, scheduler, out_name):
    return {
        "2": {"class_type": "LotusConditioning", "inputs": {}},
        "3": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["2", 0]}},
        "4": latent_node,
        "5": {"class_type": "KSampler", "inputs": {
            "model": model_ref, "seed": seed, "steps": steps, "cfg": cfg,
            "sampler_name": "euler", "scheduler": scheduler, "denoise": 1.0,
            "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0]}},
        "6": {"class_type": "SafeSageTestSaveLatent", "inputs": {"samples": ["5", 0], "name": out_name}},
    }


def _with_model(unet_name, safesage):
    g = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": unet_name, "weight_dtype": "default"}}}
    model_ref = ["1", 0]
    if safesage is not None:
        g["10"] = {"class_type": "SafeSageAttention",
                   "inputs": {"model": ["1", 0], **SAFESAGE_DEFAULTS, **safesage}}
        model_ref = ["10", 0]
    return g, model_ref


def sd2_graph(unet_name, seed, out_name, safesage=None, steps=1, cfg=1.0):
    """UNETLoader -> (SafeSageAttention) -> KSampler(euler) with LotusConditioning (+ its
    ConditioningZeroOut as negative) on a 64x64 EmptyLatentImage -> save the latent.
    `safesage`: None for the graph without the node, else a dict of node inputs (over defaults)."""
    g, model_ref = _with_model(unet_name, safesage)
    latent = {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}}
    g.update(_common(model_ref, latent, seed, steps, cfg, "normal", out_name))
    return g


def sd2_chain(unet_name, seed, out_name, nodes, steps=1):
    """sd2_graph with ``nodes`` -- (class_type, inputs besides ``model``) -- chained between the
    loader and the sampler, ids 30, 31, ... (e.g. SafeSage, a LoRA, another attention override)."""
    g = sd2_graph(unet_name, seed, out_name, steps=steps)
    ref = ["1", 0]
    for i, (cls, inputs) in enumerate(nodes):
        nid = str(30 + i)
        g[nid] = {"class_type": cls, "inputs": {"model": ref, **inputs}}
        ref = [nid, 0]
    g["5"]["inputs"]["model"] = ref
    return g


def h3_graph(unet_name, seed, out_name, safesage=None, steps=1, cfg=1.0, width=64, height=64, length=5):
    """The same for MiniMax H3 on an EmptyMiniMaxH3LatentAV (default 64x64, 5 frames)."""
    g, model_ref = _with_model(unet_name, safesage)
    latent = {"class_type": "EmptyMiniMaxH3LatentAV",
              "inputs": {"width": width, "height": height, "length": length}}
    g.update(_common(model_ref, latent, seed, steps, cfg, "simple", out_name))
    return g


def saved_latents(entry: dict) -> list:
    """The tensors SafeSageTestSaveLatent wrote for a finished prompt (history entry)."""
    import safetensors.torch

    outs = [o for node in entry["outputs"].values() for o in node.get("safesage_latent", [])]
    assert len(outs) == 1, "expected one saved latent, got %r" % (entry["outputs"],)
    d = safetensors.torch.load_file(outs[0]["path"])
    return [d["t%d" % i] for i in range(outs[0]["count"])]


def max_rel_diff(a, b) -> float:
    """max |a - b| relative to the larger of max |b| and 1."""
    return float((a - b).abs().max() / max(float(b.abs().max()), 1.0))


def stats_delta(before: dict, after: dict, key: str) -> int:
    """Change of a counter in /safesage/stats; "a.b" reads a nested counter."""
    def get(d):
        for part in key.split("."):
            d = d.get(part, 0) if isinstance(d, dict) else 0
        return int(d or 0)
    return get(after) - get(before)


def canonical_inputs(inputs: dict) -> dict:
    """SaveVideo's inputs in one spelling across ComfyUI versions: 783545f6 nests the codec settings
    under ``format`` (``format.codec.*``, the old top-level ``codec`` kept as a hidden input that
    the frontend fills with 'auto') and adds ``codec.encoding.color_space`` (default 'auto'), which
    0dd9b154 does not have. The API copy spells the settings the way both accept."""
    out = dict(inputs)
    nested = {k: v for k, v in out.items() if k.startswith("format.codec")}
    if nested:
        out.pop("codec", None)                               # the hidden legacy input
        for k in nested:
            out[k[len("format."):]] = out.pop(k)
    if out.get("codec.encoding.color_space", "auto") == "auto":
        out.pop("codec.encoding.color_space", None)
    return out
