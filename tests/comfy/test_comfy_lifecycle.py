"""SafeSage through a model's life in a real headless ComfyUI (CPU, tiny SD2 UNet): a LoRA applied
after the node, torch.compile after the node, a prompt interrupted mid-sampling, the model unloaded
and loaded again. Without sageattention no call goes to a guarded kernel, so wherever ComfyUI's own
computation is unchanged the latent must be exactly that of the same graph without SafeSage; the
counters show SafeSage's override stayed on the model. (The GPU side of these -- memory back to
its level after each prompt -- is bench/soak, results in bench/results/.)
"""

from __future__ import annotations

import os
import time

import pytest

torch = pytest.importorskip("torch")

from tools.harness.comfy_graphs import SAFESAGE_NODE as SAFESAGE, max_rel_diff, saved_latents, stats_delta, sd2_chain
from tools.harness.comfy_server import execution_error


@pytest.fixture(scope="module")
def tiny_lora(comfy, tiny_sd2):
    """A LoRA on every attention projection of the tiny UNet, in ComfyUI's own key format
    (``diffusion_model.<layer>.lora_up/lora_down.weight``), strong enough to move the latent."""
    import safetensors.torch

    sd = safetensors.torch.load_file(tiny_sd2["path"])
    g = torch.Generator().manual_seed(7)
    lora = {}
    for k, w in sd.items():
        if w.dim() == 2 and any(f".{p}.weight" in k for p in ("to_q", "to_k", "to_v")):
            base = "diffusion_model." + k[:-len(".weight")]
            rank = 4
            lora[base + ".lora_up.weight"] = torch.randn(w.shape[0], rank, generator=g) * 0.5
            lora[base + ".lora_down.weight"] = torch.randn(rank, w.shape[1], generator=g) * w.shape[1] ** -0.5
    assert lora, "the tiny UNet has no attention projections to put a LoRA on"
    d = comfy.base / "models" / "loras"
    d.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(lora, str(d / "safesage_tiny_lora.safetensors"))
    return {"name": "safesage_tiny_lora.safetensors", "layers": len(lora) // 2}


def test_lora_after_safesage(comfy, tiny_sd2, tiny_lora, seed_counter):
    """LoraLoaderModelOnly clones the model SafeSage patched: the LoRA is applied and SafeSage's
    override stays on the clone -- the same latent as the LoRA alone, and as LoRA before SafeSage."""
    unet = os.path.basename(tiny_sd2["path"])
    lora = ("LoraLoaderModelOnly", {"lora_name": tiny_lora["name"], "strength_model": 1.0})
    seed = seed_counter()
    (plain,) = saved_latents(comfy.run(sd2_chain(unet, seed, "lora_none", [])))
    (lora_only,) = saved_latents(comfy.run(sd2_chain(unet, seed, "lora_only", [lora])))
    before = comfy.safesage_stats()
    (after_ss,) = saved_latents(comfy.run(sd2_chain(unet, seed, "safesage_then_lora", [SAFESAGE, lora])))
    mid = comfy.safesage_stats()
    (before_ss,) = saved_latents(comfy.run(sd2_chain(unet, seed, "lora_then_safesage", [lora, SAFESAGE])))
    after = comfy.safesage_stats()
    assert max_rel_diff(lora_only, plain) > 1e-3, "the LoRA must change the latent, or this test shows nothing"
    assert torch.equal(after_ss, lora_only) and torch.equal(before_ss, lora_only)
    per_forward = tiny_sd2["attention_calls_per_forward"]
    assert stats_delta(before, mid, "attention_calls") == per_forward, "SafeSage's override is on the LoRA's clone"
    assert stats_delta(mid, after, "attention_calls") == per_forward


def test_torch_compile_after_safesage(comfy, tiny_sd2, seed_counter):
    """TorchCompileModel (inductor) after SafeSage: the prompt completes and the latent is that of
    compiling ComfyUI's own graph. No guarded kernel here, so under torch.compile SafeSage hands
    every call to ComfyUI's function inside the traced graph (issue 26 point 1: no graph break,
    nothing of SafeSage's eager path -- no counter -- runs in it): ``attention_calls`` does not
    move, while SafeSage's forward wrapper shows its patched model ran."""
    info = comfy.object_info()
    if "TorchCompileModel" not in info:
        pytest.skip(f"this ComfyUI ({os.environ.get('COMFYUI_PATH')}) has no TorchCompileModel node")
    unet = os.path.basename(tiny_sd2["path"])
    compile_ = ("TorchCompileModel", {"backend": "inductor"})
    seed = seed_counter()
    (plain,) = saved_latents(comfy.run(sd2_chain(unet, seed, "compile_none", [])))
    (compiled,) = saved_latents(comfy.run(sd2_chain(unet, seed, "compile_only", [compile_]), timeout=900))
    before = comfy.safesage_stats()
    (both,) = saved_latents(comfy.run(sd2_chain(unet, seed, "safesage_then_compile", [SAFESAGE, compile_]),
                                      timeout=900))
    after = comfy.safesage_stats()
    # compiling alone moves the latent by inductor's fusions; SafeSage under compile must stay as close
    tol = max(10 * max_rel_diff(compiled, plain), 1e-5)
    assert max_rel_diff(both, plain) <= tol, (max_rel_diff(both, plain), tol)
    assert torch.equal(both, compiled)
    assert stats_delta(before, after, "forwards") == 1
    assert stats_delta(before, after, "attention_calls") == 0
    assert stats_delta(before, after, "fallbacks") == 0


def _wait_counter(comfy, key, above, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if int(comfy.safesage_stats().get(key, 0)) > above:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{key} did not pass {above} in {timeout}s; log tail:\n{comfy.log_tail()}")


def test_interrupted_prompt_then_the_next_is_fine(comfy, tiny_sd2, seed_counter):
    """Interrupting mid-sampling ends the prompt as ComfyUI's interrupt does (not a SafeSage error),
    and the next prompt runs normally, with the latent of the same graph without SafeSage."""
    unet = os.path.basename(tiny_sd2["path"])
    seed = seed_counter()
    (ref,) = saved_latents(comfy.run(sd2_chain(unet, seed, "after_interrupt_ref", [], steps=3)))
    start = comfy.safesage_stats()
    pid = comfy.post_prompt(sd2_chain(unet, seed_counter(), "interrupted", [SAFESAGE], steps=5000))
    assert isinstance(pid, str), pid
    _wait_counter(comfy, "forwards", int(start.get("forwards", 0)) + 2)   # sampling is under way
    comfy.post_json("/interrupt")
    entry = comfy.wait_history(pid, timeout=300)
    kinds = [m[0] for m in entry["status"]["messages"]]
    assert entry["status"]["status_str"] == "error" and "execution_interrupted" in kinds, kinds
    assert execution_error(entry) is None, "an interrupt, not an exception"
    mid = comfy.safesage_stats()
    assert stats_delta(start, mid, "forwards") < 5000
    assert stats_delta(start, mid, "fallbacks") == 0 and stats_delta(start, mid, "kernel_errors") == 0

    (after,) = saved_latents(comfy.run(sd2_chain(unet, seed, "after_interrupt", [SAFESAGE], steps=3)))
    end = comfy.safesage_stats()
    assert torch.equal(after, ref)
    assert stats_delta(mid, end, "forwards") == 3
    assert stats_delta(mid, end, "attention_calls") == 3 * tiny_sd2["attention_calls_per_forward"]


def _cached_nodes(entry):
    return {n for kind, data in entry["status"]["messages"] if kind == "execution_cached"
            for n in data.get("nodes", [])}


def test_model_unloaded_and_loaded_again(comfy, tiny_sd2, seed_counter):
    """After ComfyUI unloads every model and drops its caches (POST /free), the same prompt loads
    the model again and SafeSage patches it again: same latent, every attention call through SafeSage."""
    unet = os.path.basename(tiny_sd2["path"])
    seed = seed_counter()
    g = sd2_chain(unet, seed, "reload", [SAFESAGE])
    s0 = comfy.safesage_stats()
    (first,) = saved_latents(comfy.run(g))
    s1 = comfy.safesage_stats()
    comfy.free()
    g["6"]["inputs"]["name"] = "reload_again"
    entry = comfy.run(g)
    (second,) = saved_latents(entry)
    s2 = comfy.safesage_stats()
    assert not {"1", "30"} & _cached_nodes(entry), "the loader and SafeSage ran again (not cached)"
    assert torch.equal(second, first)
    per_forward = tiny_sd2["attention_calls_per_forward"]
    assert stats_delta(s0, s1, "attention_calls") == per_forward
    assert stats_delta(s1, s2, "attention_calls") == per_forward
    assert stats_delta(s0, s2, "fallbacks") == 0
