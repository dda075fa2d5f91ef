"""With no sageattention, the node changes no bit of the result, whatever attention ComfyUI runs.

Each ComfyUI attention setting gets its own headless server (--cpu): the default (sub-quadratic
on the CPU), --use-split-cross-attention and --use-pytorch-cross-attention (what NVIDIA users
run). The tiny SD2 graph is sampled with and without SafeSageAttention (auto, and kernel='sdpa');
every attention call goes through the override, none is given to a guarded kernel (there is
none here), so each runs ComfyUI's own function with the caller's arguments: the latents must be
equal to the last bit, and the attention function ComfyUI reports must be the one the flag set.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from tools.harness.comfy_graphs import saved_latents, sd2_graph, stats_delta
from tools.harness.comfy_server import running_pack_server

FLAGS = {
    "default": (),
    "split": ("--use-split-cross-attention",),
    "pytorch": ("--use-pytorch-cross-attention",),
}


@pytest.mark.parametrize("setting", sorted(FLAGS))
def test_sd2_latent_bit_identical_with_the_node(comfy, tmp_path, setting, seed_counter):
    tiny = comfy.make_model("sd2", "safesage_tiny_sd2_flags.safetensors", seed=99)
    unet = os.path.basename(tiny["path"])
    with running_pack_server(tmp_path / setting, name=setting, extra_args=FLAGS[setting]) as server:
        (server.models_dir / unet).symlink_to(tiny["path"])
        seed = seed_counter()
        (plain,) = saved_latents(server.run(sd2_graph(unet, seed, f"{setting}_plain", steps=2)))
        before = server.safesage_stats()
        for kernel in ("auto", "sdpa"):
            (patched,) = saved_latents(server.run(sd2_graph(unet, seed, f"{setting}_{kernel}",
                                                            safesage={"kernel": kernel}, steps=2)))
            assert torch.equal(patched, plain), (setting, kernel, (patched - plain).abs().max())
        after = server.safesage_stats()
        calls = stats_delta(before, after, "attention_calls")
        assert calls == 2 * 2 * tiny["attention_calls_per_forward"], (calls, after)
        assert stats_delta(before, after, "plan:sdpa") == calls, after
        log = server.start_logs()
    # ComfyUI's own start-up line names the attention function it hands the override
    expect = {"default": "Using sub quadratic optimization for attention", "split": "Using split optimization for "
              "attention", "pytorch": "Using pytorch attention"}[setting]
    assert expect in log, log[-3000:]
