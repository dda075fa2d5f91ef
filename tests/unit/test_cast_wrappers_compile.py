"""The MLP's cast wrappers (safe_ops/models/h3/cast_memo.py) cost a compiled model nothing (issue 26 point 1).

Once SafeSage has patched a MiniMax H3 model, its wrappers sit in ``comfy.ops`` (and observe
``comfy.model_management``'s cast buffers) for the life of the process, so every model compiled
later runs through them. Here a real ComfyUI model -- SD's ``BasicTransformerBlock`` built with
ComfyUI's ``manual_cast`` ops, fp32 weights cast to the bf16 input on every call through
``comfy.ops.cast_bias_weight`` -- is traced by ``torch._dynamo.explain`` without SafeSage, then
after SafeSage's node path (``apply_safesage``) patched a tiny MiniMaxH3Model in the same process
and ran one chunked MLP call: the graph-break count is the same. On a ComfyUI without H3
(0.3.75) the node never installs the wrappers.

Needs COMFYUI_PATH (``bash .ci/run`` sets it in every pass); skipped with the reason otherwise.
"""
import os
import sys

import pytest
import torch

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
if not COMFYUI_PATH or not os.path.isfile(os.path.join(COMFYUI_PATH, "comfy", "ops.py")):
    _reason = "COMFYUI_PATH not set (point it at a ComfyUI tree)"
    print(f"\n[test_cast_wrappers_compile] skipped: {_reason}")
    pytest.skip(_reason, allow_module_level=True)
if COMFYUI_PATH not in sys.path:
    sys.path.insert(0, COMFYUI_PATH)
import comfy.cli_args

comfy.cli_args.args.cpu = True  # before comfy.model_management is imported
import comfy.model_management  # noqa: E402
import comfy.model_patcher  # noqa: E402
import comfy.ops  # noqa: E402
from comfy.ldm.modules.attention import BasicTransformerBlock  # noqa: E402

from safe_ops.models.h3 import mlp, cast_memo
from safe_ops.ui import run_stats  # noqa: E402
from safe_ops.patch import apply_safesage  # noqa: E402
from safe_ops.policy import Policy  # noqa: E402

try:
    import comfy.ldm.minimax.model as h3
except Exception as e:  # noqa: BLE001 - 0.3.75 has no H3
    h3 = None
    H3_MISSING = f"{type(e).__name__}: {e}"

WRAPPED = ((comfy.ops, "cast_bias_weight"), (comfy.ops, "uncast_bias_weight"),
           (comfy.model_management, "get_cast_buffer"), (comfy.model_management, "get_aimdo_cast_buffer"))


@pytest.fixture(autouse=True)
def _comfys_own_functions(monkeypatch):
    """Start from ComfyUI's own functions (another test module may have installed the wrappers
    earlier in this process); whatever this test installs is undone after it."""
    for owner, name in WRAPPED:
        fn = getattr(owner, name, None)
        if fn is None:
            continue
        while getattr(fn, cast_memo._MARK, False):
            fn = fn.__wrapped__
        monkeypatch.setattr(owner, name, fn)
    run_stats.reset()
    yield
    run_stats.reset()


def _patcher(dm):
    base = torch.nn.Module()
    base.diffusion_model = dm
    return comfy.model_patcher.ModelPatcher(base, torch.device("cpu"), torch.device("cpu"))


def _comfy_model():
    """SD's transformer block with ComfyUI's manual_cast ops: every Linear casts its fp32 weight
    to the bf16 input through comfy.ops.cast_bias_weight, at call time."""
    torch.manual_seed(0)
    blk = BasicTransformerBlock(64, 2, 32, context_dim=64, dtype=torch.float32, operations=comfy.ops.manual_cast)
    return blk.eval()


def _breaks(model, *args):
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch._dynamo.explain(model)(*args)
    torch._dynamo.reset()
    return out.graph_break_count, [str(b.reason).splitlines()[0] for b in out.break_reasons]


def _inputs():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(1, 16, 64, generator=g).to(torch.bfloat16),
            torch.randn(1, 8, 64, generator=g).to(torch.bfloat16))


H3_CONFIG = dict(
    hidden_size=64, num_layers=1, token_refiner_num_layers=1, num_attention_heads=2,
    attention_head_dim=32, ffn_hidden_size=128, latents_dim=24, audio_latents_dim=32,
    text_dim=1024, timestep_input_dim=256, time_embed_hidden_size=64, time_embed_dim=64,
    rope_inv_freq_len=16,
)


def _patch_an_h3_model():
    """SafeSage's node path on a tiny MiniMaxH3Model; one chunked MLP call through the patch."""
    dm = h3.MiniMaxH3Model(**H3_CONFIG, dtype=torch.bfloat16, device="cpu", operations=comfy.ops.manual_cast)
    mp, summary = apply_safesage(_patcher(dm), Policy(kernel="sdpa", mlp_chunking="tokens", mlp_chunk_tokens=16))
    assert summary["mlp"]["patched"] == 2 and summary["mlp"]["cast_once"], summary["mlp"]
    mp.patch_model()
    try:
        chunks0 = mlp.MLP_STATS.chunks
        with torch.no_grad():
            dm.blocks[0].mlp(torch.randn(40, 64).to(torch.bfloat16))
        assert mlp.MLP_STATS.chunks == chunks0 + 3, "the chunked forward ran (a cast scope was opened)"
    finally:
        mp.unpatch_model()


@pytest.mark.skipif(h3 is None, reason="this ComfyUI has no MiniMax H3 (0.3.75): see the test below")
def test_graph_breaks_of_a_comfy_model_unchanged_after_safesage_patched_h3():
    model, args = _comfy_model(), _inputs()
    assert not cast_memo.installed()
    before = _breaks(model, *args)
    _patch_an_h3_model()
    assert cast_memo.installed(), "SafeSage's cast wrappers now sit in comfy.ops for the process"
    after = _breaks(model, *args)
    assert after == before, f"graph breaks without SafeSage {before}, after it patched an H3 model {after}"
    # the compiled model's casts went through the wrappers' compile branch: no memo, no scope
    assert mlp.MLP_STATS.cast_faults == 0


@pytest.mark.skipif(h3 is not None, reason="this ComfyUI has MiniMax H3: the test above runs instead")
def test_graph_breaks_without_h3_the_wrappers_are_never_installed():
    print(f"\n[test_cast_wrappers_compile] no H3 in this ComfyUI ({H3_MISSING})")
    model, args = _comfy_model(), _inputs()
    before = _breaks(model, *args)
    mp, summary = apply_safesage(_patcher(model), Policy(kernel="sdpa"))
    assert summary["mlp"]["patched"] == 0 and not summary["mlp"]["cast_once"]
    assert not cast_memo.installed(), "no H3 model patched: ComfyUI's cast functions untouched"
    for owner, name in WRAPPED:
        assert not getattr(getattr(owner, name, None), cast_memo._MARK, False), name
    assert _breaks(model, *args) == before
