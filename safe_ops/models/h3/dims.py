"""MiniMax H3's facts: its dimensions, its packed token arithmetic, its attention call (with V as
this ComfyUI hands it), its modules.

The ground floor of the pack: imports nothing of it but the envelope's call description, and
ComfyUI only lazily (:func:`comfy_h3_tokens`, :func:`comfy_v_layout`). H3's MLP and Preflight,
the bench and the tests take H3's numbers from here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...families.envelope import AttnCall, TensorDesc

# MiniMax H3 at 0dd9b154 (comfy/ldm/minimax/model.py, comfy_extras/nodes_minimax_h3.py)
H3_HEADS = 56
H3_HEAD_DIM = 128
H3_HIDDEN = 5376
H3_FFN = 14336
H3_LAYERS = 50
H3_FPS = 24
H3_AUDIO_LATENT_FPS = 40
H3_TEXT_TOKENS = 256          # a typical prompt after the Qwen3-VL encoder (varies)


def h3_latent_t(frame_count: int) -> int:
    """Latent frames for a frame count on the 17k+5 grid (nodes_minimax_h3.video_latent_t)."""
    return 2 if frame_count <= 5 else ((frame_count - 5) // 17) * 5 + 2


def h3_frame_count(length: int) -> int:
    n = max(5, length)
    while n % 17 != 5:
        n += 1
    return n


def _frame_rows(height: int, width: int) -> int:
    """Tokens per latent frame: latent H/16 x W/16, padded to the 2x2 patch, one row per patch."""
    lh, lw = height // 16, width // 16
    return -(-lh // 2) * -(-lw // 2)


def ref_latent_hw(width: int, height: int) -> tuple[int, int]:
    """Latent (h, w) of a reference image of the target's own size under ref_image_size "match":
    MiniMaxH3ReferenceToVideo rounds it to the 32-pixel canvas (round half to even, as Python's
    round) and encodes it at /16. That rounding sits inline in the node's execute(), so it is
    repeated here; the frame grid it feeds is ComfyUI's own in comfy_h3_tokens."""
    tw = max(32, round(width / 32) * 32)
    th = max(32, round(height / 32) * 32)
    return th // 16, tw // 16


@dataclass(frozen=True)
class H3Tokens:
    video: int
    audio: int
    refs: int
    text: int
    source: str = "SafeSage's copy of ComfyUI's H3 arithmetic"

    @property
    def total(self) -> int:
        return self.video + self.audio + self.refs + self.text


def h3_tokens(width: int, height: int, length: int, ref_images: int = 0,
              text_tokens: int = H3_TEXT_TOKENS) -> H3Tokens:
    """Packed sequence length of an H3 graph (video latent /16, patch 1x2x2; stereo audio at 40 Hz).

    Reference images are counted as images of the target's own size (``ref_image_size`` "match";
    references of another aspect ratio change the count a little)."""
    frames = h3_frame_count(length)
    video = h3_latent_t(frames) * _frame_rows(height, width)
    audio = 2 * round(frames / H3_FPS * H3_AUDIO_LATENT_FPS)
    rh, rw = ref_latent_hw(width, height)
    refs = ref_images * _frame_rows(rh * 16, rw * 16)
    return H3Tokens(video, audio, refs, text_tokens)


def comfy_h3_tokens(width: int, height: int, length: int, ref_images: int = 0,
                    text_tokens: int = H3_TEXT_TOKENS) -> H3Tokens | None:
    """The same count from ComfyUI's own code: ``temporal_shape`` of the H3 nodes and the
    ``seq_len`` of ``PackedLayout`` for that latent. None when this ComfyUI has no H3 (or
    ComfyUI is not importable here)."""
    # PackedLayout builds position tensors of the whole sequence on the CPU: beyond a few
    # million tokens (far past any H3 render) that costs GiBs, so the pack's own count is used.
    if h3_tokens(width, height, length, ref_images, text_tokens).total > COMFY_COUNT_MAX_TOKENS:
        return None
    try:
        from comfy.ldm.minimax.model import PackedLayout  # type: ignore
        from comfy_extras.nodes_minimax_h3 import temporal_shape  # type: ignore
        return _comfy_count(PackedLayout, temporal_shape, width, height, length, ref_images, text_tokens)
    except Exception:      # no H3 in this ComfyUI, or its signatures changed: the pack's own count
        return None


COMFY_COUNT_MAX_TOKENS = 4_000_000


def packed_tokens(width: int, height: int, length: int, ref_images: int = 0,
                  text_tokens: int = H3_TEXT_TOKENS) -> H3Tokens:
    """The packed token count of an H3 graph as this process can best know it: ComfyUI's own
    (:func:`comfy_h3_tokens`) where this ComfyUI has H3, else SafeSage's copy (:func:`h3_tokens`).
    Its ``source`` says which."""
    return comfy_h3_tokens(width, height, length, ref_images, text_tokens) or \
        h3_tokens(width, height, length, ref_images, text_tokens)


def _comfy_count(PackedLayout, temporal_shape, width, height, length, ref_images, text_tokens) -> H3Tokens:
    _, latent_t, audio_t = temporal_shape(length)
    lh, lw = height // 16, width // 16
    lh, lw = lh + lh % 2, lw + lw % 2                   # pad_to_patch_size((1, 2, 2))
    rh, rw = ref_latent_hw(width, height)
    refs = [{"kind": "image", "latent_h": rh, "latent_w": rw}] * ref_images

    def seq(n_refs):
        return PackedLayout(text_tokens, latent_t, lh, lw, audio_t, refs=refs[:n_refs] or None).seq_len

    total = seq(ref_images)
    no_refs = seq(0)
    video = latent_t * _frame_rows(height, width)
    return H3Tokens(video, no_refs - video - text_tokens, total - no_refs, text_tokens,
                    "ComfyUI's own H3 code (temporal_shape + PackedLayout)")


#: V as H3's attention hands it over: "strided", a view into the fused qkv buffer (0dd9b154, and
#: compiler-era upstream again), or "contiguous", its own token-major copy (783545f6's v.clone(),
#: the peak-memory fix #15486 that #15665 removed again)
V_LAYOUTS = ("strided", "contiguous")


def h3_attention_call(S: int, dtype: str = "bfloat16", arch: str = "", v_layout: str = "strided") -> AttnCall:
    """H3's attention call: [1,56,S,128] HND views of q and k into the [S, 3*56*128] qkv_proj
    output; V the same view, or (``v_layout="contiguous"``) a copy of it, token-major."""
    if v_layout not in V_LAYOUTS:
        raise ValueError(f"v_layout must be one of {V_LAYOUTS}, got {v_layout!r}")
    row = 3 * H3_HEADS * H3_HEAD_DIM
    t = TensorDesc((1, H3_HEADS, S, H3_HEAD_DIM), (S * row, H3_HEAD_DIM, row, 1))
    inner = H3_HEADS * H3_HEAD_DIM
    v = t if v_layout == "strided" else TensorDesc(t.shape, (S * inner, H3_HEAD_DIM, inner, 1))
    return AttnCall(t, t, v, dtype, "HND", False, "cuda", arch, 2)


def v_layout_here() -> tuple[str, str]:
    """(V's layout in H3's attention call, where that was read): this ComfyUI's own H3 when it is
    loaded (783545f6 copies V, 0dd9b154 and later upstream hand a view), else 0dd9b154's view."""
    got = comfy_v_layout()
    if got is not None:
        return got, "read from this ComfyUI's H3 Attention"
    return "strided", "ComfyUI's H3 not loaded here: 0dd9b154's layout"


def attention_call_here(S: int, arch: str = "") -> AttnCall:
    """H3's attention call at ``S`` tokens with V as this ComfyUI hands it (:func:`v_layout_here`)."""
    return h3_attention_call(S, arch=arch, v_layout=v_layout_here()[0])


_V_LAYOUT: dict = {}


def comfy_v_layout() -> str | None:
    """How this ComfyUI's H3 hands V to attention, read from ComfyUI's own ``Attention.forward``:
    run once on a tiny instance on the CPU with an override that records the tensors' strides.
    None when ComfyUI with H3 is not loaded here (or its Attention cannot be run that way)."""
    import sys
    mod = sys.modules.get(H3_MODEL_MODULE)
    if mod is None or not hasattr(mod, "Attention"):
        return None
    key = id(mod.Attention)
    if key not in _V_LAYOUT:
        _V_LAYOUT[key] = _probe_v_layout(mod)
    return _V_LAYOUT[key]


def _probe_v_layout(mod) -> str | None:
    try:
        import torch

        import comfy.ops
        heads, d, hidden, s = 2, 8, 16, 3
        attn = mod.Attention(hidden, heads, d, 1e-6, dtype=torch.float32, device="cpu",
                             operations=comfy.ops.disable_weight_init)
        for p in attn.parameters():
            torch.nn.init.ones_(p)
        seen = {}

        def record(func, q, k, v, *a, **kw):
            seen.update(q=q.stride(), v=v.stride())
            return torch.zeros(1, q.shape[-2], heads * d)      # [B, S, H*D], as ComfyUI returns it

        with torch.no_grad():
            attn(torch.ones(s, hidden), transformer_options={"optimized_attention_override": record})
        if not seen:
            return None
        return "strided" if seen["v"][2] == 3 * heads * d else "contiguous" if seen["v"][2] == heads * d else None
    except Exception:  # another signature or a ComfyUI that cannot run it here: unknown
        return None


# Where ComfyUI defines H3 (comfy/ldm/minimax/model.py): the model class and its MLP class.
H3_MODEL_MODULE = "comfy.ldm.minimax.model"
H3_MODEL_CLASS = "MiniMaxH3Model"
H3_MLP_CLASS = "MLP"


def is_h3_model(diffusion_model: Any) -> bool:
    t = type(diffusion_model)
    return t.__name__ == H3_MODEL_CLASS and t.__module__ == H3_MODEL_MODULE


def is_h3_mlp(m: Any) -> bool:
    t = type(m)
    return t.__name__ == H3_MLP_CLASS and t.__module__ == H3_MODEL_MODULE


def find_h3_mlps(diffusion_model: Any) -> list:
    """(path, module) of every MiniMax H3 ``MLP`` (blocks and token-refiner blocks)."""
    return [(name, m) for name, m in diffusion_model.named_modules() if is_h3_mlp(m)]
