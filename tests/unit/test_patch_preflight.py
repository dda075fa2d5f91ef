"""apply_safesage on a stand-in ModelPatcher, the H3 preflight arithmetic, and the demo."""
import copy

import pytest
import torch

from safe_ops import patch as patch_mod
from safe_ops.ui import run_stats
from safe_ops.attention.override import SafeAttention
from safe_ops.policy import Policy
from safe_ops.models.h3.dims import h3_attention_call, h3_tokens
from safe_ops.ui.preflight import preflight
from safe_ops.facts.devices import Runtime


class FakePatcher:
    """The part of comfy.model_patcher.ModelPatcher that apply_safesage uses."""

    def __init__(self):
        self.model_options = {"transformer_options": {}}
        self.wrappers = {}
        self.object_patches = {}
        import torch
        self.model = type("M", (), {"diffusion_model": torch.nn.Linear(2, 2)})()  # not an H3 model
        self.clones = 0

    def clone(self):
        n = FakePatcher()
        n.model_options = copy.deepcopy(self.model_options)
        n.wrappers = copy.deepcopy(self.wrappers)
        n.object_patches = dict(self.object_patches)
        n.model = self.model
        self.clones += 1
        return n

    def add_wrapper_with_key(self, wtype, key, fn):
        self.wrappers.setdefault(wtype, {}).setdefault(key, []).append(fn)

    def remove_wrappers_with_key(self, wtype, key):
        self.wrappers.get(wtype, {}).pop(key, None)

    def add_object_patch(self, name, obj):
        self.object_patches[name] = obj


NO_SAGE = Runtime("t", None, None, None, None, None, "package not installed", None, None, None)


@pytest.fixture(autouse=True)
def _rt(monkeypatch):
    import sys
    import types
    monkeypatch.setattr(patch_mod, "runtime", lambda: NO_SAGE)
    if "comfy.patcher_extension" not in sys.modules:   # ComfyUI's WrappersMP, as at 0.3.75/0dd9b154
        ext = types.ModuleType("comfy.patcher_extension")
        ext.WrappersMP = type("WrappersMP", (), {"APPLY_MODEL": "apply_model", "DIFFUSION_MODEL": "diffusion_model",
                                                 "OUTER_SAMPLE": "outer_sample"})
        monkeypatch.setitem(sys.modules, "comfy", sys.modules.get("comfy") or types.ModuleType("comfy"))
        monkeypatch.setitem(sys.modules, "comfy.patcher_extension", ext)
    run_stats.reset()


def test_clone_not_mutated_and_override_installed():
    m = FakePatcher()
    out, summary = patch_mod.apply_safesage(m, Policy(kernel="auto"))
    assert out is not m and m.clones == 1
    assert "optimized_attention_override" not in m.model_options["transformer_options"]
    assert isinstance(out.model_options["transformer_options"]["optimized_attention_override"], SafeAttention)
    assert "SageAttention not used: package not installed" in summary["text"]
    assert "auto picked ComfyUI's own attention because no sage-family kernel is usable" in summary["text"]
    assert summary["mlp"]["patched"] == 0 and summary["mlp"]["skipped"]


def test_idempotent_on_a_patched_model():
    m, _ = patch_mod.apply_safesage(FakePatcher())
    m2, s2 = patch_mod.apply_safesage(m)
    to = m2.model_options["transformer_options"]
    assert isinstance(to["optimized_attention_override"], SafeAttention)
    assert not s2["warnings"]
    assert [len(w) for w in m2.wrappers["apply_model"].values()] == [1]


def test_a_sampling_run_ends_even_if_it_raises():
    """The OUTER_SAMPLE wrapper ends the run for ComfyUI's compiler (plans chosen again next run),
    also when sampling raised; the per-forward wrapper only counts."""
    from safe_ops.facts import compiler
    m, _ = patch_mod.apply_safesage(FakePatcher())
    (outer,), = m.wrappers["outer_sample"].values()
    run = compiler.run_id()

    def sampling(*a, **k):
        raise KeyboardInterrupt("user pressed cancel")

    with pytest.raises(KeyboardInterrupt):
        outer(sampling, 1, 2)
    assert compiler.run_id() == run + 1
    assert outer(lambda x: x * 2, 21) == 42 and compiler.run_id() == run + 2
    (fwd,), = m.wrappers["apply_model"].values()
    forwards = run_stats.value("forwards")
    assert fwd(lambda: "out") == "out" and compiler.run_id() == run + 2
    assert run_stats.value("forwards") == forwards + 1


def test_an_override_already_on_the_model_is_chained_not_replaced():
    m = FakePatcher()
    seen = []

    def someone_elses(func, *a, **k):
        seen.append(func)
        return "theirs"

    m.model_options["transformer_options"]["optimized_attention_override"] = someone_elses
    p, s = patch_mod.apply_safesage(m)
    att = p.model_options["transformer_options"]["optimized_attention_override"]
    assert isinstance(att, SafeAttention) and att.previous is someone_elses and att.previous_kind is None
    assert "chained after the attention override already on the model" in s["text"] and "someone_elses" in s["text"]
    # a call no guarded kernel takes (no sage here) goes to it, with ComfyUI's func
    q = torch.randn(1, 2, 8, 16)
    func = lambda *a, **k: "comfy's"      # noqa: E731
    assert att(func, q, q, q, 2, skip_reshape=True) == "theirs" and seen == [func]
    # a second SafeSage node replaces the first, and keeps what the first had chained
    p2, _ = patch_mod.apply_safesage(p)
    att2 = p2.model_options["transformer_options"]["optimized_attention_override"]
    assert att2 is not att and att2.previous is someone_elses


def test_explicit_sage_without_sage_is_a_clear_error():
    with pytest.raises(patch_mod.SafeSageError, match="kernel='sage'.*package not installed.*auto"):
        patch_mod.apply_safesage(FakePatcher(), Policy(kernel="sage"))


def test_policy_rejects_bad_values():
    for bad in (dict(kernel="flash"), dict(mlp_chunking="x"), dict(verify="sometimes"), dict(mlp_chunk_tokens=0)):
        with pytest.raises(ValueError, match="SafeSage"):
            Policy(**bad)


def test_h3_token_arithmetic():
    """Worked by hand from H3's layout (video latent /16, 2x2 patches; 17k+5 frame grid, 5 frames
    per latent step; stereo audio at 40 Hz); ComfyUI 0dd9b154's own PackedLayout agrees."""
    t = h3_tokens(1664, 960, 362, ref_images=3, text_tokens=0)
    # 362 = 17 * 21 + 5 is on the grid: 21 * 5 + 2 = 107 latent frames of (960/32) x (1664/32) tokens
    assert t.video == 107 * 30 * 52 == 166_920
    assert t.audio == 2 * 603                # 362/24 s at 40 Hz = 603.3, stereo
    assert t.refs == 3 * 1560                # each reference one frame of the target's own size
    assert t.total == 172_806
    small = h3_tokens(1344, 768, 124, text_tokens=0)
    # 124 = 17 * 7 + 5: 37 latent frames of 24 x 42 tokens; audio 2 * round(124 / 24 * 40) = 414
    assert (small.video, small.audio, small.total) == (37 * 24 * 42, 414, 37_710)   # the reporter's clean size


def test_preflight_plans_the_reporters_graph():
    S = h3_tokens(1664, 960, 362, ref_images=3).total
    rows = {r["family"]: r for r in preflight(S, ["sage1_triton"], budget_bytes=8 << 30)}
    r = rows["sage1_triton"]
    assert r["violations"] and "repack" in r["plan"]
    assert h3_attention_call(99_865).q.stride[2] == 21_504


def test_demo_runs_on_cpu(capsys):
    from safe_ops import demo
    assert demo.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out and "173,062" in out and "head_groups" in out


def test_v_layout_per_tree_changes_which_limits_h3_crosses():
    """783545f6 copies V (token stride 7,168): sage 2.2's u32 V terms then wrap 3x later than for
    0dd9b154's view (21,504), so at 199,730 tokens only the strided V crosses them."""
    from safe_ops.families import registry  # noqa: F401  (registers every family)
    from safe_ops.families.envelope import FAMILIES, check
    strided = h3_attention_call(199_730)
    copied = h3_attention_call(199_730, v_layout="contiguous")
    assert copied.q == strided.q and copied.k == strided.k
    assert copied.v.shape == strided.v.shape and copied.v.stride == (199_730 * 7168, 128, 7168, 1)
    env = FAMILIES["sage2_fp8pv_perwarp"]
    on_v = lambda call: [x.tensor for x in check(call, env) if x.tensor.startswith("v")]  # noqa: E731
    assert on_v(strided) and not on_v(copied)
    assert check(copied, env), "q and k are still views: their limits stay"
    with pytest.raises(ValueError):
        h3_attention_call(10, v_layout="nhd")
