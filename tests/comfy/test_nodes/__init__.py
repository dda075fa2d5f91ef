"""Test-only ComfyUI custom nodes for SafeSage's headless-server tests (never shipped: the
fixture symlinks this folder into the server's custom_nodes as `safesage_test_nodes`).

SafeSageTestAttentionOverride puts an attention override on a model the way another pack (or
core's ModelAttentionBackend, where a tree lacks it) does: ``override(func, *a, **k)`` running
ComfyUI's own attention_pytorch.

SafeSageTestChainingOverride is a stand-in for core's BlockSparseAttention
(comfy_extras/nodes_sparse_attention.py, newer than the trees the CI runs): its override chains
the override that was on the model (``previous``; else ComfyUI's ``func``) for every call it
declines -- here every call, as core's does below min_tokens -- and it puts itself back on top
of whatever override is on the model at each step (ON_PREPARE_STATE), so a node applied after
it cannot replace it.

SafeSageTestSaveLatent writes every tensor of a LATENT (plain or nested, e.g. MiniMax H3's
audio-video latent, which core SaveLatent cannot save) to
<output>/safesage_test/<name>.safetensors as t0, t1, ... and reports the file in its UI output.

SafeSageTestTorchCompile is ComfyUI's TorchCompileModel with the ``eager`` backend to choose.

SafeSageTestFaults (fault_injector.py) records which of the pack's functions a prompt's sampling
runs, or makes one of them raise, for tests/comfy/test_fault_injection.py.
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


def _install_chaining_override(installed, name, transformer_options):
    """core's install_override: on top of the current override, idempotent once on top."""
    current = transformer_options.get("optimized_attention_override")
    if current in installed:
        return
    previous = current

    def override(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                 skip_output_reshape=False, **kwargs):
        args = (q, k, v, heads)
        kw = dict(mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                  skip_output_reshape=skip_output_reshape, **kwargs)
        return func(*args, **kw) if previous is None else previous(func, *args, **kw)

    installed.add(override)
    transformer_options["optimized_attention_override"] = override


class SafeSageTestChainingOverride:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "name": ("STRING", {"default": "chaining"})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "_for_testing/safesage"

    def patch(self, model, name):
        installed = set()
        m = model.clone()
        _install_chaining_override(installed, name, m.model_options.setdefault("transformer_options", {}))
        try:
            from comfy.patcher_extension import CallbacksMP
            on_prepare = getattr(CallbacksMP, "ON_PREPARE_STATE", None)
        except Exception:
            on_prepare = None
        if on_prepare is not None and hasattr(m, "add_callback_with_key"):
            m.add_callback_with_key(on_prepare, "safesage_test_chaining_" + name,
                                    lambda mp, timestep, model_options=None: _install_chaining_override(
                                        installed, name, (model_options if model_options is not None
                                                          else mp.model_options)["transformer_options"]))
        return (m,)


from .fault_injector import SafeSageTestFaults  # noqa: E402

class SafeSageTestTorchCompile:
    """ComfyUI's TorchCompileModel with torch's ``eager`` backend: the same ComfyUI function
    (``comfy_api.torch_helpers.set_torch_compile_wrapper``: the diffusion model ``torch.compile``d and
    swapped in from an APPLY_MODEL wrapper, transformer_options' guards skipped) and the same dynamo
    trace, without inductor's code generation, which takes minutes per step for the tiny H3 on a
    2-core CPU (the node's own choices are inductor and cudagraphs)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "backend": (["eager", "aot_eager", "inductor"],)}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "_for_testing/safesage"

    def patch(self, model, backend):
        from comfy_api.torch_helpers import set_torch_compile_wrapper
        import comfy_extras.nodes_torch_compile as tc
        m = model.clone()
        set_torch_compile_wrapper(model=m, backend=backend, options={"guard_filter_fn": tc.skip_torch_compile_dict})
        return (m,)


NODE_CLASS_MAPPINGS = {"SafeSageTestSaveLatent": SafeSageTestSaveLatent,
                       "SafeSageTestTorchCompile": SafeSageTestTorchCompile,
                       "SafeSageTestAttentionOverride": SafeSageTestAttentionOverride,
                       "SafeSageTestChainingOverride": SafeSageTestChainingOverride,
                       "SafeSageTestFaults": SafeSageTestFaults}
