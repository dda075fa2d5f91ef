"""Test-only ComfyUI custom nodes for SafeSage's headless-server tests (never shipped: the
fixture symlinks this folder into the server's custom_nodes as `safesage_test_nodes`).

SafeSageTestAttentionOverride puts an attention override on a model the way another pack (or
core's ModelAttentionBackend, where a tree lacks it) does: ``override(func, *a, **k)`` running
ComfyUI's own attention_pytorch.

SafeSageTestSaveLatent writes every tensor of a LATENT (plain or nested, e.g. MiniMax H3's
audio-video latent, which core SaveLatent cannot save) to
<output>/safesage_test/<name>.safetensors as t0, t1, ... and reports the file in its UI output.
"""

import os

import folder_paths
import safetensors.torch


class SafeSageTestSaveLatent:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",), "name": ("STRING", {"default": "latent"})}}

    RETURN_TYPES = ()
    FUNCTION = "save"
    OUTPUT_NODE = True
    CATEGORY = "_for_testing/safesage"

    def save(self, samples, name):
        s = samples["samples"]
        tensors = list(s.tensors) if getattr(s, "is_nested", False) else [s]
        out_dir = os.path.join(folder_paths.get_output_directory(), "safesage_test")
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "%s.safetensors" % os.path.basename(name))
        safetensors.torch.save_file(
            {"t%d" % i: t.detach().float().cpu().contiguous() for i, t in enumerate(tensors)}, path)
        return {"ui": {"safesage_latent": [{"path": path, "count": len(tensors)}]}}


class SafeSageTestAttentionOverride:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",)}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "_for_testing/safesage"

    def patch(self, model):
        import comfy.ldm.modules.attention as att
        pytorch = att.attention_pytorch

        def another_packs_override(func, *args, **kwargs):
            return pytorch(*args, **kwargs)

        m = model.clone()
        m.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = another_packs_override
        return (m,)


NODE_CLASS_MAPPINGS = {"SafeSageTestSaveLatent": SafeSageTestSaveLatent,
                       "SafeSageTestAttentionOverride": SafeSageTestAttentionOverride}
