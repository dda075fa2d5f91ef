"""Preflight: what a MiniMax H3 render of a given size asks of each attention kernel.

Pure arithmetic (no GPU, no ComfyUI): the packed token count of an H3 graph,
the shape of the attention call H3 makes (strided views into the fused qkv
buffer), and for each known kernel family the envelope violations and the
plan SafeSage would run.
"""
from __future__ import annotations

from dataclasses import dataclass

from .envelope import FAMILIES, AttnCall, TensorDesc, check
from .planner import plan_for

# MiniMax H3 at 0dd9b154 (comfy/ldm/minimax/model.py, comfy_extras/nodes_minimax_h3.py)
H3_HEADS = 56
H3_HEAD_DIM = 128
H3_HIDDEN = 5376
H3_FFN = 14336
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


@dataclass(frozen=True)
class H3Tokens:
    video: int
    audio: int
    refs: int
    text: int

    @property
    def total(self) -> int:
        return self.video + self.audio + self.refs + self.text


def h3_tokens(width: int, height: int, length: int, ref_images: int = 0,
              text_tokens: int = H3_TEXT_TOKENS) -> H3Tokens:
    """Packed sequence length of an H3 graph (video latent /16, patch 1x2x2; stereo audio at 40 Hz)."""
    frames = h3_frame_count(length)
    per_frame = (height // 32) * (width // 32)
    video = h3_latent_t(frames) * per_frame
    audio = 2 * round(frames / H3_FPS * H3_AUDIO_LATENT_FPS)
    refs = ref_images * per_frame          # ref_image_size "match": one frame grid per reference
    return H3Tokens(video, audio, refs, text_tokens)


def h3_attention_call(S: int, dtype: str = "bfloat16", arch: str = "") -> AttnCall:
    """H3's attention call: [1,56,S,128] HND views into the [S, 3*56*128] qkv_proj output."""
    row = 3 * H3_HEADS * H3_HEAD_DIM
    t = TensorDesc((1, H3_HEADS, S, H3_HEAD_DIM), (S * row, H3_HEAD_DIM, row, 1))
    return AttnCall(t, t, t, dtype, "HND", False, "cuda", arch, 2)


def preflight(S: int, families: list[str] | None = None, budget_bytes: int | None = None) -> list[dict]:
    """Per kernel family: violations of H3's call at S tokens and the plan SafeSage would run."""
    try:
        from . import envelope_sage2  # noqa: F401  (registers the sage 2.x families)
    except ImportError:
        pass
    call = h3_attention_call(S)
    rows = []
    for fam in families or [f for f in FAMILIES if f != "sdpa"]:
        env = FAMILIES[fam]
        viol = check(call, env)
        plan = plan_for(call, env, budget_bytes)
        rows.append({"family": fam, "source": env.source,
                     "violations": [str(v) for v in viol],
                     "plan": plan.describe(reasons=False) if plan else "no plan inside the envelope: PyTorch SDPA"})
    return rows
