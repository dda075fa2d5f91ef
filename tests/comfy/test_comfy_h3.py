"""MiniMax H3 through SafeSageAttention in a real ComfyUI (0dd9b154 or later; skipped on 0.3.75,
which has no H3). Tiny random H3 (hidden 64, 1 block + 1 token-refiner block), fan-in-scaled init
so its blocks matter, block/refiner Linear weights stored fp8 e4m3 scaled with the
`_quantization_metadata` safetensors encoding (tiny_models.py).

Expected counts come from the model's structure:
  * MLPs patched = DiT blocks + token-refiner blocks (every H3 MLP is patched), read from
    /safesage/stats `mlp_patched`, which reports the latest application of the node;
  * attention calls through the override = DiT blocks x forwards. The token refiner's attention
    runs in model_base.MiniMaxH3.extra_conds (preprocess_text_embeds), which gets no
    transformer_options, so ComfyUI never routes it through an override; KSampler with euler and
    cfg 1.0 runs one forward per step (the uncond is skipped).
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from tools.harness.comfy_graphs import h3_graph, max_rel_diff, saved_latents, stats_delta

from safe_ops.models.h3.dims import h3_tokens

# fp8-dequantized weights are identical on both paths; chunked MLP and the attention override only
# change summation order in fp32 on CPU.
REL_TOL = 1e-3
#: the graph's text: LotusConditioning's fixed prompt embedding is [1, 2, 1024]
LOTUS_TEXT_TOKENS = 2


def test_h3_tiny_model_is_informative(tiny_h3):
    assert tiny_h3["detected"] == "MiniMaxH3"
    assert len(tiny_h3["quantized_layers"]) == 4 * (tiny_h3["blocks"] + tiny_h3["refiner_blocks"])
    # zeroing attention / the MLPs changes one forward's output by more than a few percent
    assert tiny_h3["attention_effect"] > 0.02, tiny_h3
    assert tiny_h3["mlp_effect"] > 0.02, tiny_h3


def _pair(comfy, unet, seed, steps, safesage, tag, **size):
    plain = comfy.run(h3_graph(unet, seed, tag + "_plain", steps=steps, **size))
    before = comfy.safesage_stats()
    node = comfy.run(h3_graph(unet, seed, tag + "_safesage", safesage=safesage, steps=steps, **size))
    after = comfy.safesage_stats()
    return saved_latents(plain), saved_latents(node), before, after


def test_h3_fp8_same_latent_mlps_patched_attention_counted(comfy, tiny_h3, seed_counter):
    unet = os.path.basename(tiny_h3["path"])
    steps = 2
    # 256x256, 22 frames: a few hundred video+audio tokens, so 256-token MLP chunks really split
    plain, patched, before, after = _pair(comfy, unet, seed_counter(), steps,
                                          {"mlp_chunking": "tokens", "mlp_chunk_tokens": 256}, "h3",
                                          width=256, height=256, length=22)
    assert len(plain) == len(patched) == 2  # video and audio latents
    for p, q in zip(plain, patched):
        assert p.shape == q.shape
        assert torch.isfinite(p).all() and p.abs().max() > 0
        assert max_rel_diff(q, p) <= REL_TOL, (q - p).abs().max()

    n_mlps = tiny_h3["blocks"] + tiny_h3["refiner_blocks"]
    # mlp_patched: how many MLPs the latest SafeSageAttention application patched (a gauge)
    assert after.get("mlp_patched") == n_mlps, after
    calls = stats_delta(before, after, "attention_calls")
    assert calls == tiny_h3["blocks"] * steps, (calls, after)
    assert stats_delta(before, after, "forwards") == steps, after
    plan_calls = sum(stats_delta(before, after, k) for k in after if k.startswith("plan:"))
    assert plan_calls == calls, after
    # the patched DiT-block MLPs really ran, chunked, once per forward each (the refiner's
    # MLP sees only the 2 text tokens: below one chunk), and none fell back to ComfyUI's MLP
    assert stats_delta(before, after, "mlp.chunked_calls") == tiny_h3["blocks"] * steps, after["mlp"]
    chunks = -(-h3_tokens(256, 256, 22, text_tokens=LOTUS_TEXT_TOKENS).total // 256)
    assert chunks == 3, chunks                   # 448 video + 74 audio + 2 text tokens
    assert stats_delta(before, after, "mlp.chunks") == chunks * tiny_h3["blocks"] * steps, after["mlp"]
    assert after["mlp"]["fallbacks"] == before["mlp"]["fallbacks"], after["mlp"]


def test_h3_mlp_chunking_off_patches_no_mlp(comfy, tiny_h3, seed_counter):
    unet = os.path.basename(tiny_h3["path"])
    plain, patched, before, after = _pair(comfy, unet, seed_counter(), 1, {"mlp_chunking": "off"}, "h3off")
    for p, q in zip(plain, patched):
        # no sage here: attention is ComfyUI's own function, the MLP ComfyUI's own: the same bits
        assert torch.equal(q, p), (q - p).abs().max()
    assert after.get("mlp_patched") == 0, after
    assert stats_delta(before, after, "attention_calls") == tiny_h3["blocks"]
    assert stats_delta(before, after, "mlp.calls") == 0, "no MLP went through SafeSage's forward"
