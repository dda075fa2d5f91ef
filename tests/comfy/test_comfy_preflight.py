"""SafeSage Preflight on a real headless ComfyUI (--cpu), and the preflight lines of the
SafeSage Attention node's status text.

The token count the node reports comes from ComfyUI's own H3 code where the tree has H3
(0dd9b154: temporal_shape + PackedLayout); safe_ops.models.h3.dims.h3_tokens is SafeSage's copy of
that arithmetic for ComfyUI versions without H3. Every pass compares the node's count with
counts worked by hand (HAND_COUNTS); on an H3 tree, where the node counts with ComfyUI's code,
SafeSage's copy is compared with it too (sizes that are and are not multiples of 32, with and
without references).
"""

from __future__ import annotations

import re

from tools.harness.comfy_graphs import SAFESAGE_DEFAULTS
from tools.harness.comfy_server import has_minimax_h3

from safe_ops.models.h3.dims import h3_tokens

PF_DEFAULTS = {"width": 1664, "height": 960, "length": 362, "ref_images": 0, "text_tokens": 256}

# (width, height, length, ref_images, text_tokens) -> packed tokens, worked by hand from H3's layout:
# the length snaps up to 17k+5 frames, k*5+2 latent frames; a latent frame is (H/16 and W/16, each
# padded to even) / 2 x 2 tokens; audio 2 * round(frames / 24 * 40); a reference is one frame of
# the target rounded to 32 px (round half to even); plus text.
HAND_COUNTS = {
    # 362 = 17*21+5: 107 x (30 x 52) = 166,920 + audio 2*603 + 3 refs x 1,560 + 256
    (1664, 960, 362, 3, 256): 166_920 + 1_206 + 4_680 + 256,
    (1664, 960, 362, 3, 77): 166_920 + 1_206 + 4_680 + 77,
    # 124 = 17*7+5: 37 x (24 x 42) = 37,296 + audio 2*207 + 256
    (1344, 768, 124, 0, 256): 37_296 + 414 + 256,
    # 121 -> 124: 37 x (720/16 = 45 -> 46: 23 x 40) = 34,040 + audio 414 + 77
    (1280, 720, 121, 0, 77): 34_040 + 414 + 77,
    # 200 -> 209: 62 x (976/16 = 61 -> 62: 31 x 560/16 = 35 -> 36: 18) = 34,596 + audio 2*348
    # + 1 ref at 960x576: 30 x 18 + 77
    (976, 560, 200, 1, 77): 34_596 + 696 + 540 + 77,
    # 40 -> 56: 17 x (1000/16 = 62: 31 x 31) = 16,337 + audio 2*93 + 2 refs at 992x992: 2 x 31 x 31 + 77
    (1000, 1000, 40, 2, 77): 16_337 + 186 + 1_922 + 77,
    # 5 frames: 2 x (4 -> 2 x 2) = 8 + audio 2*8 + 77
    (64, 64, 5, 0, 77): 8 + 16 + 77,
}


def _preflight_graph(model=None, **inputs):
    g = {"1": {"class_type": "SafeSagePreflight", "inputs": {**PF_DEFAULTS, **inputs}}}
    if model is not None:
        g.update(model)
        g["1"]["inputs"]["model"] = ["10", 0]
    return g


def _text(entry, node_id="1") -> str:
    t = entry["outputs"][node_id]["text"]
    return "\n".join(t) if isinstance(t, list) else str(t)


def _tokens(text: str) -> int:
    line = next(l for l in text.splitlines() if l.startswith("packed tokens: "))
    return int(line.split()[2].replace(",", ""))


def test_preflight_in_object_info(comfy):
    node = comfy.object_info()["SafeSagePreflight"]
    req = node["input"]["required"]
    assert list(req) == ["width", "height", "length", "ref_images", "text_tokens"]
    assert node["input"]["optional"]["model"][0] == "MODEL"
    assert node["output"] == ["STRING", "INT"]
    assert node["output_node"] is True
    for name, spec in {**req, **node["input"]["optional"]}.items():
        assert spec[1].get("tooltip"), "input %r has no tooltip" % name


def test_reporters_size_on_cpu_reports_common_gpus(comfy):
    entry = comfy.run(_preflight_graph(ref_images=3, text_tokens=256))
    text = _text(entry)
    assert _tokens(text) == HAND_COUNTS[(1664, 960, 362, 3, 256)] == 173_062
    assert "no CUDA device here" in text
    for arch in ("sm_89", "sm_90", "sm_120"):
        assert "[%s" % arch in text, arch
    assert "sageattention 2.2.0 -> sage2_sm120_fp8pv" in text and "sageattention 1.0.6 -> sage1_triton" in text
    # the sage 1.x / 2.2 int32 limit of H3's strided views, and the sm_120 length rule
    assert "safe up to 99,865" in text and "safe up to 149,999" in text
    warnings = [l for l in text.splitlines() if l.startswith("WARNING: 173,062 tokens: ")]
    assert any("sage2_sm120_fp8pv on sm_120 would cross its limits (length, safe up to 149,999)" in w
               and "plan: " in w and "plan: direct" not in w for w in warnings), warnings
    assert any("sage1_triton on sm_89" in w and "plan: repack" in w for w in warnings), warnings
    # "auto": at most 16,384 tokens, evened out over the 11 chunks 173,062 tokens need
    chunk = int(re.search(r"MLP ([0-9,]+) tokens per chunk", text).group(1).replace(",", ""))
    assert chunk <= 16_384 and -(-173_062 // chunk) == -(-173_062 // 16_384) == 11 and chunk % 256 == 0, chunk
    assert "predicted peak" in text
    assert "model: not connected" in text


def test_small_size_crosses_nothing(comfy):
    text = _text(comfy.run(_preflight_graph(width=1344, height=768, length=124)))
    assert _tokens(text) == HAND_COUNTS[(1344, 768, 124, 0, 256)]
    assert "limits: none crossed" in text and "WARNING" not in text


def test_token_count_is_comfyuis_own(comfy):
    """On a tree with H3 the node counts with ComfyUI's code, and SafeSage's copy must agree with
    it; without H3 it counts with the copy. Either way the count is the hand-worked one."""
    sizes = [(1664, 960, 362, 3), (1280, 720, 121, 0), (976, 560, 200, 1), (1000, 1000, 40, 2), (64, 64, 5, 0)]
    for w, h, n, refs in sizes:
        text = _text(comfy.run(_preflight_graph(width=w, height=h, length=n, ref_images=refs, text_tokens=77)))
        got = _tokens(text)
        assert got == HAND_COUNTS[(w, h, n, refs, 77)], (w, h, n, refs)
        if has_minimax_h3():
            assert "counted with ComfyUI's own H3 code" in text, text.splitlines()[1]
            assert h3_tokens(w, h, n, ref_images=refs, text_tokens=77).total == got, (w, h, n, refs)
        else:
            assert "counted with SafeSage's copy" in text


def test_preflight_takes_the_safesage_nodes_settings(comfy, tiny_sd2):
    model = {
        "9": {"class_type": "UNETLoader", "inputs": {"unet_name": "safesage_tiny_sd2.safetensors",
                                                    "weight_dtype": "default"}},
        "10": {"class_type": "SafeSageAttention",
               "inputs": {"model": ["9", 0], **SAFESAGE_DEFAULTS, "kernel": "sdpa", "mlp_chunking": "tokens",
                          "mlp_chunk_tokens": 4096}},
    }
    entry = comfy.run(_preflight_graph(model=model, length=363))
    text = _text(entry)
    assert "settings from the SafeSage Attention node" in text
    assert "NOT MiniMax H3 (UNetModel)" in text
    assert "kernel policy: sdpa; mlp_chunking: tokens (4,096 tokens)" in text
    assert "MLP 4,096 tokens per chunk" in text
    runs = [l for l in text.splitlines() if "each attention call" in l]
    assert runs and all("runs: sdpa: ComfyUI's own attention" in l for l in runs), runs
    assert text.count("kernel choice: kernel 'sdpa': ComfyUI's own attention for every call, as asked") == len(runs)
    # the SafeSage Attention node's own status carries the preflight pointer
    status = _text(entry, "10")
    assert status.startswith("SafeSage: ") and "SafeSage Preflight" in status
