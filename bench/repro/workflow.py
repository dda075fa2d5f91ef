"""The API-format graph one row queues on its ComfyUI server: the reporter's sampling path.

UNETLoader -> SafeSageReproProbe -> (SafeSageAttention) -> BasicGuider + KSamplerSelect(res_multistep)
+ BasicScheduler(beta) + RandomNoise -> SamplerCustomAdvanced on an EmptyMiniMaxH3LatentAV latent
-> SafeSageReproSaveLatent. Conditioning: SafeSageReproConditioning, random text-encoder states of
the real shape (no text encoder is loaded). The SafeSageRepro* nodes are the bench's own
(bench/repro/probe_pack); everything else is ComfyUI's and SafeSage's own node code.
"""
from __future__ import annotations

SAFESAGE_NODE = "SafeSageAttention"


def node_defaults(object_info_entry: dict) -> dict:
    """A node's required inputs at their defaults, from the server's /object_info entry (so the
    graph uses the node defaults the running pack declares), MODEL-type inputs left out."""
    out = {}
    for name, spec in object_info_entry["input"]["required"].items():
        opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
        if spec[0] == "MODEL":
            continue
        if "default" in opts:
            out[name] = opts["default"]
        elif isinstance(spec[0], list) and spec[0]:     # an old-style combo: its first option
            out[name] = spec[0][0]
    return out


def row_graph(unet_name: str, width: int, height: int, length: int, text_len: int, steps: int,
              seed: int, latent_path: str, safesage_inputs: dict | None = None) -> dict:
    """safesage_inputs: None for a graph without SafeSageAttention, else its full inputs (but model)."""
    g = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": unet_name, "weight_dtype": "default"}},
        "2": {"class_type": "SafeSageReproProbe", "inputs": {"model": ["1", 0]}},
    }
    model = ["2", 0]
    if safesage_inputs is not None:
        g["10"] = {"class_type": SAFESAGE_NODE, "inputs": {"model": model, **safesage_inputs}}
        model = ["10", 0]
    g.update({
        # the in-process worker drew the states with seed + 1; kept, so latents stay comparable
        "3": {"class_type": "SafeSageReproConditioning",
              "inputs": {"model": model, "text_len": text_len, "seed": seed + 1}},
        "4": {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": width, "height": height, "length": length}},
        "5": {"class_type": "RandomNoise", "inputs": {"noise_seed": seed}},
        "6": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "res_multistep"}},
        "7": {"class_type": "BasicScheduler", "inputs": {"model": model, "scheduler": "beta", "steps": steps,
                                                         "denoise": 1.0}},
        "8": {"class_type": "BasicGuider", "inputs": {"model": model, "conditioning": ["3", 0]}},
        "9": {"class_type": "SamplerCustomAdvanced",
              "inputs": {"noise": ["5", 0], "guider": ["8", 0], "sampler": ["6", 0], "sigmas": ["7", 0],
                         "latent_image": ["4", 0]}},
        "11": {"class_type": "SafeSageReproSaveLatent", "inputs": {"samples": ["9", 0], "path": latent_path}},
    })
    return g
