"""SafeSageAttention: the node. Thin on purpose: schema and tooltips here, all logic in safe_ops.

Uses only the V3 API surface that ComfyUI 0.3.75 and 0dd9b154 (0.30.x) both have:
io.ComfyNode / io.Schema / io.Model / io.Combo / io.Int / io.Boolean / io.NodeOutput,
ui.PreviewText, and ComfyNode.validate_inputs (returning True or the error message).
"""
from __future__ import annotations

from comfy_api.latest import io, ui

from . import _backend

# The values a saved workflow stores for these widgets: part of the node's contract with
# users' files. safe_ops.policy.Policy validates them again (KERNELS, MLP_CHUNKING, VERIFY).
KERNELS = ["auto", "sage", "sdpa"]
MLP_CHUNKING = ["auto", "off", "tokens"]
VERIFY = ["first", "every", "off"]
QUALITY = ["balanced", "strict", "faults only"]

TIP_MODEL = (
    "The diffusion model straight from your loader (e.g. Load Diffusion Model / UNETLoader). "
    "It is cloned: the model going in is left unchanged."
)
TIP_KERNEL = (
    "Which attention kernel to run. Every call no guarded kernel takes runs exactly what ComfyUI "
    "would have run (its own attention function, or another attention node placed before this one), "
    "except that an unguarded SageAttention or comfy-kitchen call becomes ComfyUI's PyTorch attention. "
    "auto: SageAttention (or comfy-kitchen's INT8 attention) where the pack has measured it as faster "
    "than PyTorch attention on this GPU; on GPUs it has no measurements for, whatever ComfyUI is set to "
    "run (--use-sage-attention, --use-ck-attention). "
    "sage: prefer SageAttention; calls its kernels cannot index safely are rerouted (repacked, split, or "
    "given to ComfyUI's own attention), never run unsafely. If SageAttention cannot run here at all, "
    "the node stops with a message saying why and what to install (auto would use ComfyUI's attention). "
    "sdpa: never a SageAttention or comfy-kitchen kernel; every call runs ComfyUI's own attention "
    "(PyTorch attention where ComfyUI is set to SageAttention). Use it to rule SageAttention out when "
    "you see noise or crashes."
)
TIP_MLP_CHUNKING = (
    "MiniMax H3 only; other models are not touched. Runs each block's MLP (fc1, SiLU gate, fc2) "
    "over the tokens in chunks instead of all at once, which cuts its peak VRAM at long video "
    "lengths from many GiB to a few, with the same result. "
    "auto: at most 16,384 tokens per chunk (fewer when free GPU memory is short), evened out over the "
    "chunks a call needs. "
    "tokens: fixed chunks of mlp_chunk_tokens tokens. "
    "off: ComfyUI's own unchunked MLP."
)
TIP_MLP_CHUNK_TOKENS = (
    "Tokens per MLP chunk, used only when mlp_chunking is 'tokens'. Smaller uses less VRAM, "
    "larger is slightly faster. For scale: a 1664x960, 362-frame H3 video is about 169,000 tokens."
)
TIP_VERIFY = (
    "Checks that the attention kernel really computes attention on your GPU: a mismatched "
    "SageAttention build can return noise without any error. "
    "first: on the first call of each kind (kernel, dtype, head size, layout, size class), "
    "compare a small slice of the output with PyTorch SDPA; a kernel that fails is not used "
    "again for that kind and that call is recomputed safely. "
    "every: check every call (slower; for diagnosing). "
    "off: no check."
)
TIP_QUALITY = (
    "How much attention speed SafeSage may trade for accuracy (MiniMax H3's late blocks drift on quantised "
    "attention: morphing, garbled text). "
    "balanced: with kernel 'auto', every call runs the kernel with the least error whose predicted attention "
    "time is within 5% of the fastest one's, priced from SafeSage's speed table (on an RTX 50xx with "
    "--use-sage-attention and comfy-kitchen 0.2.36+ that is comfy-kitchen's INT8 attention, published at "
    "536 vs SageAttention's 560 TFLOP/s; where the table knows no second kernel, the fastest). At the first "
    "sampling step each block's error is measured on 1,024 sampled query rows against ComfyUI's own attention; "
    "from step 2 each block runs the least-error kernel within that budget, and a block whose error stands "
    "out (over 4.4x the run's median, or over its kernel's ceiling) moves to a kernel under it whatever the "
    "speed. The errors are remembered for the model: later prompts run the choices from step 1 and measure "
    "nothing (a LoRA, another kernel build or another size measures again; POST /safesage/quality/forget "
    "forgets). Measuring costs 0.46-0.53% of a 20-step prompt (4.6-5.3% of a 2-step one) in a ComfyUI that "
    "has run a prompt before, 0.78% (7.8%) in its first prompt on the RTX 40xx path (an H100 at 38k tokens, "
    "RTX dispatch emulated; the 50xx path's first prompt there, 13.6%, carried the H100's one-time compile of "
    "the kernels, which an RTX card does not pay); a prompt with remembered errors runs no measurement. "
    "strict: a 50% budget; the target is 2x the median and at most 0.02. "
    "faults only: nothing measured; the kernel policy's choice runs (crash and noise guards only). "
    "Per block in /safesage/stats."
)
TIP_PROBE_STEP = (
    "Optional: measure the blocks once more at this sampling step (1-based) and report it in "
    "/safesage/stats; it never changes a choice. 0: off."
)
TIP_EXACT_STEPS = (
    "Optional: the first and the last N sampling steps run ComfyUI's own attention (what SageAttention's "
    "authors advise for the steps that set composition and fine detail). 0: off."
)
TIP_DEBUG_SYNC = (
    "Diagnostics only; slows sampling down. Waits for the GPU after every guarded call, so a GPU "
    "fault is reported at the call that caused it instead of at some later, unrelated line "
    "(like F.silu in the original crash report). Leave off for normal use."
)


class SafeSageAttention(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SafeSageAttention",
            display_name="SafeSage Attention (MiniMax H3 safe)",
            category="model/patch/attention",
            description=(
                "Checks every attention call against what SageAttention's kernels can index and "
                "reroutes calls outside those limits (every temporary is made on the GPU stream that "
                "reads it, so none is held past the call), checks each new kind of call against "
                "PyTorch attention, and runs MiniMax H3's MLP in token chunks. An error in SafeSage's "
                "own code never fails the prompt: while sampling, that call runs ComfyUI's own code; "
                "while this node runs, the model goes on patched with that part left out (the status "
                "says which) or, where it could not be patched whole, unpatched (the status says why). "
                "The model going in is never changed. The node stops with a message only where you "
                "must act: kernel 'sage' where SageAttention cannot run, an invalid input, or a pack "
                "that failed to load. Put it right after the model loader."
            ),
            inputs=[
                io.Model.Input("model", tooltip=TIP_MODEL),
                io.Combo.Input("kernel", options=KERNELS, default="auto", tooltip=TIP_KERNEL),
                io.Combo.Input("mlp_chunking", options=MLP_CHUNKING, default="auto", tooltip=TIP_MLP_CHUNKING),
                io.Int.Input(
                    "mlp_chunk_tokens", default=16384, min=256, max=1048576, step=256,
                    tooltip=TIP_MLP_CHUNK_TOKENS,
                ),
                io.Combo.Input("verify", options=VERIFY, default="first", tooltip=TIP_VERIFY),
                io.Boolean.Input("debug_sync", default=False, tooltip=TIP_DEBUG_SYNC),
                # optional: workflows saved before these inputs existed load with the defaults
                io.Combo.Input("quality", options=QUALITY, default="balanced", tooltip=TIP_QUALITY, optional=True),
                io.Int.Input("quality_probe_step", default=0, min=0, max=10000, tooltip=TIP_PROBE_STEP,
                             optional=True),
                io.Int.Input("exact_steps", default=0, min=0, max=10000, tooltip=TIP_EXACT_STEPS, optional=True),
            ],
            outputs=[io.Model.Output()],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, kernel, mlp_chunking, verify, quality="balanced"):
        """Refuse an unknown combo value at /prompt, before anything is queued (HTTP 400,
        prompt_outputs_failed_validation): ComfyUI 0.3.75's validator does not check V3 io.Combo
        values, so without this a bad value would fail only when the node runs. It takes the combo
        inputs only, never **kwargs: ComfyUI skips its own checks for every input this function
        takes (the INT ranges of the others stay ComfyUI's). ComfyUI files the returned string under
        each input named here. A linked input arrives as None (its value is not known yet): the
        node's Policy checks it when it runs."""
        problems = []
        for name, value, allowed in (("kernel", kernel, KERNELS), ("mlp_chunking", mlp_chunking, MLP_CHUNKING),
                                     ("verify", verify, VERIFY), ("quality", quality, QUALITY)):
            if value is not None and value not in allowed:
                problems.append("%s: %r is not one of %s" % (name, value, ", ".join(repr(a) for a in allowed)))
        return "; ".join(problems) if problems else True

    @classmethod
    def execute(cls, *, model, kernel, mlp_chunking, mlp_chunk_tokens, verify, debug_sync, quality="balanced",
                quality_probe_step=0, exact_steps=0) -> io.NodeOutput:
        apply_node, _report = _backend.require()
        # this node's id (a subgraph node's path included): the quality outcome it shows is its own
        out = apply_node(model, node=getattr(getattr(cls, "hidden", None), "unique_id", None), kernel=kernel,
                         mlp_chunking=mlp_chunking, mlp_chunk_tokens=int(mlp_chunk_tokens), verify=verify, debug_sync=bool(debug_sync), quality=quality,
                         probe_step=int(quality_probe_step), exact_steps=int(exact_steps))
        if out.model is model and out.patched:
            # Postcondition: patches live on a clone, so the loader's cached model stays clean; the
            # input goes on as is only where safe_ops says it patched nothing.
            raise RuntimeError("SafeSage internal error: safe_ops patched the input model in place instead of a clone.")
        # safe_ops logs this text itself; here it only goes to the node (ui.PreviewText).
        return io.NodeOutput(out.model, ui=ui.PreviewText(out.text))


TIP_SIZE = "Of the MiniMax H3 video you plan to render (as on the H3 latent / reference-to-video node)."
TIP_LENGTH = "Frame count at 24 fps, as on the H3 node; H3 snaps it up to its 17k+5 frame grid."
TIP_REFS = ("Reference images of a reference-to-video graph (ref_image_size 'match'): each adds about one "
            "frame's worth of tokens.")
TIP_TEXT = "Prompt tokens after the text encoder (varies with the prompt; 256 is typical)."
TIP_PF_MODEL = ("Optional. Connect the SafeSage Attention node's MODEL to report with its settings (kernel, "
                "mlp_chunking); a model that is not MiniMax H3 is reported as such.")


class SafeSagePreflight(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SafeSagePreflight",
            display_name="SafeSage Preflight (MiniMax H3 size check)",
            category="model/patch/attention",
            description=(
                "Before you queue a long MiniMax H3 render: the packed token count of that size (ComfyUI's "
                "own formula), which limits of the SageAttention kernel on this GPU (and of comfy-kitchen's INT8 "
                "attention, if installed) it crosses, the plan "
                "SafeSage runs for each attention call, the MLP chunk size and the predicted memory of "
                "both, and the longest length predicted to fit the free memory (SafeSage, unguarded sage and "
                "ComfyUI's own attention), with the budget it assumed and what it does not model. Without a "
                "GPU it reports common GPUs. Runs no model."
            ),
            inputs=[
                io.Int.Input("width", default=1664, min=32, max=16384, step=32, tooltip=TIP_SIZE),
                io.Int.Input("height", default=960, min=32, max=16384, step=32, tooltip=TIP_SIZE),
                io.Int.Input("length", default=362, min=5, max=3600, step=1, tooltip=TIP_LENGTH),
                io.Int.Input("ref_images", default=0, min=0, max=16, tooltip=TIP_REFS),
                io.Int.Input("text_tokens", default=256, min=0, max=8192, tooltip=TIP_TEXT),
                io.Model.Input("model", optional=True, tooltip=TIP_PF_MODEL),
            ],
            outputs=[io.String.Output("report"), io.Int.Output("tokens")],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, *, width, height, length, ref_images, text_tokens, model=None) -> io.NodeOutput:
        r = _backend.preflight(int(width), int(height), int(length), int(ref_images), int(text_tokens), model)
        return io.NodeOutput(r["text"], int(r["tokens"].total), ui=ui.PreviewText(r["text"]))


NODES = [SafeSageAttention, SafeSagePreflight]
