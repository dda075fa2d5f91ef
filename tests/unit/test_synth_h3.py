"""bench/common/synth_h3.py's synthetic late-block drift (issue 46 goal 8): the chosen q_norm/k_norm gain
channels of the chosen blocks are scaled, everything else is bit-identical to the undrifted checkpoint of
the same seed; the settings are recorded in the file's metadata and ``--reuse`` keys on them.

Builds a tiny-dims H3 state dict with ComfyUI's own module (COMFYUI_PATH, a tree with MiniMax H3) on the
CPU generator."""
import json

import pytest


def _needs(module: str, why: str):
    """Import ``module`` (a ComfyUI tree on PYTHONPATH, as .ci/run sets it) or skip this file saying why."""
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as e:
        print(f"\n[test_synth_h3] skipped: {why} ({e})")
        pytest.skip(f"{why} ({e})", allow_module_level=True)


_needs("comfy.cli_args", "no ComfyUI on PYTHONPATH").args.cpu = True     # before comfy.model_management
_needs("comfy.ldm.minimax.model", "this ComfyUI has no MiniMax H3 (needs 0dd9b154 or later)")
import torch  # noqa: E402

from bench.common import synth_h3  # noqa: E402

TINY = dict(synth_h3.REAL, hidden_size=256, num_attention_heads=2, ffn_hidden_size=512, text_dim=512,
            time_embed_hidden_size=256, time_embed_dim=128)
BLOCKS = 4
KW = dict(blocks=BLOCKS, seed=3, device="cpu", dims=TINY, curve_grid=11, weights="bf16")


@pytest.fixture(scope="module")
def pair():
    plain = synth_h3.build(**KW)
    drifted = synth_h3.build(**KW, drift_blocks=2, drift_channels=3, drift_factor=16.0)
    return plain, drifted


def _bits(t):
    return t.contiguous().view(torch.uint8) if t.dim() else t.reshape(1).contiguous().view(torch.uint8)


def test_the_chosen_channels_of_the_last_blocks_are_scaled(pair):
    (plain, _, _), (sd, _, info) = pair
    drift = info["drift"]
    assert drift["synthetic"] is True and drift["blocks"] == [2, 3] and drift["factor"] == 16.0
    for b in (2, 3):
        chans = drift["channels"][str(b)]
        assert len(chans) == 3 and len(set(chans)) == 3 and all(0 <= c < 128 for c in chans)
        for norm in ("q_norm", "k_norm"):
            name = f"blocks.{b}.attn.{norm}.weight"
            ratio = sd[name].float() / plain[name].float()
            want = torch.ones(128)
            want[chans] = 16.0
            assert torch.equal(ratio, want), name


def test_everything_else_is_bit_identical_to_the_undrifted_checkpoint(pair):
    (plain, _, _), (sd, _, info) = pair
    assert set(sd) == set(plain)
    scaled = {f"blocks.{b}.attn.{n}.weight" for b in (2, 3) for n in ("q_norm", "k_norm")}
    for name in sorted(set(sd) - scaled):
        assert sd[name].dtype == plain[name].dtype and torch.equal(_bits(sd[name]), _bits(plain[name])), name
    # the early blocks' and the token refiner's q/k norms are among the untouched ones
    assert "blocks.0.attn.q_norm.weight" in set(sd) - scaled
    assert any(k.startswith("token_refiner.") and k.endswith("attn.k_norm.weight") for k in set(sd) - scaled)


def test_channels_are_drawn_per_block_from_the_seed_alone():
    a = synth_h3.drift_plan(50, 128, 0, 8, 4, 16.0)
    assert a == synth_h3.drift_plan(50, 128, 0, 8, 4, 16.0)
    assert a["blocks"] == list(range(42, 50))
    assert len({tuple(c) for c in a["channels"].values()}) > 1            # not one set for every block
    assert a["channels"] != synth_h3.drift_plan(50, 128, 1, 8, 4, 16.0)["channels"]
    assert synth_h3.drift_plan(50, 128, 0, 0, 4, 16.0) is None
    for bad in ((51, 4, 16.0), (8, 129, 16.0), (8, 4, 0.0)):
        with pytest.raises(ValueError):
            synth_h3.drift_plan(50, 128, 0, *bad)


def test_settings_are_in_the_files_metadata_and_reuse_keys_on_them(tmp_path, pair):
    (_, _, _), (_, meta, info) = pair
    recorded = json.loads(meta[synth_h3.SETTINGS_KEY])
    assert recorded["drift"] == info["drift"] and recorded["seed"] == 3 and recorded["generator_device"] == "cpu"
    out = str(tmp_path / "h3.safetensors")
    kw = dict(KW, drift_blocks=2, drift_channels=3, drift_factor=16.0)
    first = synth_h3.write(out, **kw)
    assert "reused" not in first and synth_h3.read_settings(out) == synth_h3.wanted(**kw)
    again = synth_h3.write(out, reuse=True, **kw)
    assert again["reused"] is True and again["drift"] == first["drift"]
    other = dict(kw, drift_factor=8.0)                     # another drift: written again, not reused
    third = synth_h3.write(out, reuse=True, **other)
    assert "reused" not in third and synth_h3.read_settings(out)["drift"]["factor"] == 8.0
    assert synth_h3.read_settings(str(tmp_path / "missing")) is None
