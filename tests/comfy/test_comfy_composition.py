"""SafeSage composed with other model patches in a real headless ComfyUI (CPU, tiny SD2 UNet).

Without sageattention no call goes to a guarded kernel, so every composition must give exactly the
latent of the same graph without SafeSage:
* two SafeSage nodes in a row (the second replaces the first, keeping what it chained);
* another attention override -- core's ModelAttentionBackend where the tree has it (783545f6 and
  later), and always the test pack's own (another pack's closure running attention_pytorch) --
  before SafeSage: it is chained, so the calls SafeSage does not guard run it; after SafeSage: it
  replaces SafeSage's override, as it replaces any other -- the latent is then that override's.
The chain is also checked through SafeSage's counters: attention calls go through SafeSage only
where it is the override on the model.
* a chaining override modelled on core's BlockSparseAttention (SafeSageTestChainingOverride: it
  chains ``previous`` and puts itself back on top at ON_PREPARE_STATE) before SafeSage, after it,
  and between two SafeSage nodes (the second with kernel="sdpa"): the prompt completes with the
  latent of the graph without any of them, each attention call counted once, and the inner
  SafeSage only passes calls through (``nested_calls``).
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from tools.harness.comfy_graphs import SAFESAGE_DEFAULTS, SAFESAGE_NODE as SAFESAGE, saved_latents, stats_delta, sd2_chain


def test_two_safesage_nodes_in_a_row(comfy, tiny_sd2, seed_counter):
    unet = os.path.basename(tiny_sd2["path"])
    seed = seed_counter()
    (plain,) = saved_latents(comfy.run(sd2_chain(unet, seed, "two_plain", [])))
    before = comfy.safesage_stats()
    (twice,) = saved_latents(comfy.run(sd2_chain(unet, seed, "two_safesage", [SAFESAGE, SAFESAGE])))
    after = comfy.safesage_stats()
    assert torch.equal(twice, plain)
    # one override on the model: each attention call counted once, not twice
    assert stats_delta(before, after, "attention_calls") == tiny_sd2["attention_calls_per_forward"]


def _other_overrides(comfy):
    info = comfy.object_info()
    out = [("SafeSageTestAttentionOverride", {})]
    if "ModelAttentionBackend" in info:            # core's, 783545f6 and later
        out.append(("ModelAttentionBackend", {"attention": "pytorch attention"}))
    return out


def test_another_attention_override_before_and_after_safesage(comfy, tiny_sd2, seed_counter):
    unet = os.path.basename(tiny_sd2["path"])
    for backend in _other_overrides(comfy):
        _before_and_after(comfy, unet, backend, seed_counter(), tiny_sd2["attention_calls_per_forward"])


def _before_and_after(comfy, unet, backend, seed, per_forward):
    tag = backend[0]
    (alone,) = saved_latents(comfy.run(sd2_chain(unet, seed, f"{tag}_alone", [backend])))
    before = comfy.safesage_stats()
    (chained,) = saved_latents(comfy.run(sd2_chain(unet, seed, f"{tag}_then_safesage", [backend, SAFESAGE])))
    mid = comfy.safesage_stats()
    (replaced,) = saved_latents(comfy.run(sd2_chain(unet, seed, f"safesage_then_{tag}", [SAFESAGE, backend])))
    after = comfy.safesage_stats()
    assert torch.equal(chained, alone) and torch.equal(replaced, alone), tag
    assert stats_delta(before, mid, "attention_calls") == per_forward, tag
    assert stats_delta(mid, after, "attention_calls") == 0, f"{tag} after SafeSage replaces its override"


def test_nested_override_chaining_override_around_safesage(comfy, tiny_sd2, seed_counter):
    unet = os.path.basename(tiny_sd2["path"])
    per_forward = tiny_sd2["attention_calls_per_forward"]
    chaining = ("SafeSageTestChainingOverride", {"name": "sparse_like"})
    sdpa = ("SafeSageAttention", {**SAFESAGE_DEFAULTS, "kernel": "sdpa"})
    seed = seed_counter()
    (plain,) = saved_latents(comfy.run(sd2_chain(unet, seed, "chaining_plain", [])))
    (alone,) = saved_latents(comfy.run(sd2_chain(unet, seed, "chaining_alone", [chaining])))
    assert torch.equal(alone, plain)
    for tag, nodes, nested in (("chaining_then_safesage", [chaining, SAFESAGE], 0),
                               ("safesage_then_chaining", [SAFESAGE, chaining], 0),
                               ("safesage_chaining_safesage", [SAFESAGE, chaining, sdpa], per_forward)):
        before = comfy.safesage_stats()
        (latent,) = saved_latents(comfy.run(sd2_chain(unet, seed, tag, nodes)))
        after = comfy.safesage_stats()
        assert torch.equal(latent, plain), tag
        assert stats_delta(before, after, "attention_calls") == per_forward, tag
        assert stats_delta(before, after, "nested_calls") == nested, tag
        assert stats_delta(before, after, "fallbacks") == 0, tag
