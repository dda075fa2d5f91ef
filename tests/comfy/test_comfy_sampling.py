"""Real sampling through SafeSageAttention on a tiny SD2-class UNet (ComfyUI's own model classes,
random weights, no downloads): same latent as without the node, every attention call counted.

Expected counts come from the graph, not from observation:
  * the tiny UNet has `transformer_blocks` BasicTransformerBlocks (input, middle, 2 output), each
    calling attention twice per forward (attn1 self, attn2 cross): tiny_models.py reports
    `attention_calls_per_forward` = 2 x blocks = 8;
  * KSampler with euler runs one model forward per step; with cfg 1.0 ComfyUI skips the negative
    (uncond) entirely, so forwards == steps; with cfg > 1 cond and uncond run either batched in
    one forward or as two forwards, which is why that case is counted through the pack's own
    `forwards` counter (its APPLY_MODEL wrapper, installed on every ComfyUI the CI runs).
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from tools.harness.comfy_graphs import saved_latents, sd2_graph, stats_delta

# Without sageattention every attention call runs ComfyUI's own function through the override,
# with the caller's arguments: the latent is the same to the last bit.


def _run_pair(comfy, unet, seed, steps, cfg, safesage, tag):
    base = comfy.run(sd2_graph(unet, seed, "%s_plain" % tag, steps=steps, cfg=cfg))
    before = comfy.safesage_stats()
    node = comfy.run(sd2_graph(unet, seed, "%s_safesage" % tag, safesage=safesage, steps=steps, cfg=cfg))
    after = comfy.safesage_stats()
    (plain,) = saved_latents(base)
    (patched,) = saved_latents(node)
    return plain, patched, before, after


def test_sd2_same_latent_and_every_attention_call_counted(comfy, tiny_sd2, seed_counter):
    unet = os.path.basename(tiny_sd2["path"])
    per_forward = tiny_sd2["attention_calls_per_forward"]
    assert per_forward == 8 and tiny_sd2["transformer_blocks"] == 4, tiny_sd2
    steps = 2
    plain, patched, before, after = _run_pair(comfy, unet, seed_counter(), steps, 1.0, {}, "sd2_cfg1")

    assert plain.shape == patched.shape == (1, 4, 8, 8)
    assert torch.isfinite(plain).all() and plain.abs().max() > 0
    assert torch.equal(patched, plain), (patched - plain).abs().max()

    calls = stats_delta(before, after, "attention_calls")
    assert calls == per_forward * steps, (calls, before, after)
    assert stats_delta(before, after, "forwards") == steps, after
    plan_calls = sum(stats_delta(before, after, k) for k in after if k.startswith("plan:"))
    assert plan_calls == calls, "every attention call must be planned: %r" % after
    # no mask, supported head_dim/dtype: SDPA is this CPU's plan, not a fallback
    assert stats_delta(before, after, "fallbacks") == 0, after


def test_sd2_with_cfg_and_explicit_sdpa(comfy, tiny_sd2, seed_counter):
    """cfg > 1 (the negative really runs) and kernel='sdpa': still the same latent."""
    unet = os.path.basename(tiny_sd2["path"])
    per_forward = tiny_sd2["attention_calls_per_forward"]
    steps = 1
    plain, patched, before, after = _run_pair(comfy, unet, seed_counter(), steps, 3.0,
                                              {"kernel": "sdpa"}, "sd2_cfg3")
    assert torch.isfinite(plain).all()
    assert torch.equal(patched, plain), (patched - plain).abs().max()
    calls = stats_delta(before, after, "attention_calls")
    forwards = stats_delta(before, after, "forwards")
    assert forwards in (steps, 2 * steps), forwards  # cond+uncond batched, or not: ComfyUI's choice
    assert calls == per_forward * forwards, (calls, forwards)


def test_sd2_input_model_is_not_mutated(comfy, tiny_sd2, seed_counter):
    """After a graph with the node, the same loader output used without the node samples exactly
    like a fresh baseline (the node patched a clone), and the override is not called."""
    unet = os.path.basename(tiny_sd2["path"])
    seed = seed_counter()
    comfy.run(sd2_graph(unet, seed, "mut_node", safesage={}))
    before = comfy.safesage_stats()
    again = comfy.run(sd2_graph(unet, seed + 1, "mut_plain"))
    after = comfy.safesage_stats()
    assert stats_delta(before, after, "attention_calls") == 0, (before, after)
    assert torch.isfinite(saved_latents(again)[0]).all()
