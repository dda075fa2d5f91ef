"""bench/repro on the CPU: the driver runs two rows of the GPU reproduction, each in a fresh real
ComfyUI server (main.py --cpu, launched by comfy_process.py as every test server here), on the tiny
fp8 H3 (tiny_models.py), and its JSON reads as the GPU runs' do.

What it checks: the graph a row queues runs through ComfyUI's own loader, latent, guider, sampler
and scheduler nodes (and SafeSageAttention at the defaults the running node declares); the probe
pack's findings reach the row (steps timed, the packed sequence measured on the latent the sampler
got, which is the latent SaveLatent wrote); the --emulate-arch start-up hook reaches SafeSage inside
the server (its status line names sm_120 on this CPU); /safesage/stats counts the row's forwards
(and its re-plans: replans_per_run);
the guarded row matches the PyTorch row within the tolerance test_comfy_h3.py uses; and a prompt
that fails in ComfyUI becomes a "Python error" row with ComfyUI's exception line.
"""

from __future__ import annotations

import argparse

import pytest

torch = pytest.importorskip("torch")

from tools.harness.comfy_server import comfy_root  # noqa: E402

STEPS = 2
# fp8-dequantized weights are identical on both paths; the chunked MLP and the attention override
# only change summation order in fp32 on the CPU (the tolerance of test_comfy_h3.py)
REL_TOL = 1e-3


def _args(tmp_path, ckpt, plan, **kw):
    a = dict(comfy=str(comfy_root()), ckpt=str(ckpt), steps=STEPS, seed=77, cpu=True, debug=False,
             emulate_arch="sm120", comfy_flag=[], sizes=[], arms=[], out=str(tmp_path / "repro.json"),
             copy_to=None, work=str(tmp_path / "work"), ballast_free_gib=0.0, arm_timeout=240.0,
             deadline=1e9, min_left=0.0, plan=plan, fail_fast=False, repo_rev=None, keep_latents=None,
             synth_info=None)
    a.update(kw)
    return argparse.Namespace(**a)


@pytest.fixture(scope="module")
def driver_run(tiny_h3, tmp_path_factory):
    from bench.repro import driver
    tmp = tmp_path_factory.mktemp("repro_cpu")
    a = _args(tmp, tiny_h3["path"], ["tiny:pytorch", "tiny:safesage"], keep_latents=str(tmp / "lat"))
    doc = driver.driver(a, ["all", "--cpu", "--emulate-arch", "sm120"])
    return doc, tmp


def test_both_rows_complete_in_their_own_server(driver_run, tiny_h3):
    doc, tmp = driver_run
    runs = {r["arm"]: r for r in doc["runs"]}
    assert sorted(runs) == ["pytorch", "safesage"]
    for arm, r in runs.items():
        assert r["outcome"] == "completed", (arm, r.get("error"), r.get("log_tail"))
        w = r["worker"]
        assert "main.py" in r["command"] and "--cpu" in r["command"].split()
        assert w["phase"] == "done" and w["finite"] is True
        assert len(w["s_per_step"]) == STEPS and all(s > 0 for s in w["s_per_step"])
        assert w["blocks"] == tiny_h3["blocks"] and w["refiner_blocks"] == tiny_h3["refiner_blocks"]
        # what the sampler got (the probe's wrapper) is what SaveLatent wrote
        lat = torch.load(tmp / "lat" / f"tiny_{arm}.pt")
        assert [list(lat["video"].shape), list(lat["audio"].shape)] == [w["video_latent"], w["audio_latent"]]
    assert runs["pytorch"]["rel_l2_vs_pytorch"] == 0.0
    assert runs["safesage"]["rel_l2_vs_pytorch"] <= REL_TOL, runs["safesage"]["rel_l2_vs_pytorch"]
    # the unguarded arm's server had no SafeSage pack, the guarded one ran its node
    assert "safesage_report" not in runs["pytorch"]["worker"]
    assert runs["safesage"]["worker"]["graph"]["10"]["class_type"] == "SafeSageAttention"


def test_emulated_arch_reaches_safesage_in_the_server(driver_run, tiny_h3):
    w = {r["arm"]: r for r in driver_run[0]["runs"]}["safesage"]["worker"]
    assert w["emulated_arch"] == "sm120"
    assert "(sm_120)" in w["safesage_summary"], w["safesage_summary"]
    assert any(m.endswith("safe_ops.patch") for m in w["safesage_emulated_in"]), w["safesage_emulated_in"]
    rep = w["safesage_report"]
    assert rep["forwards"] == STEPS
    assert rep["attention_calls"] == tiny_h3["blocks"] * STEPS
    # the run's re-plans (bench/repro/replans.py): none on the CPU, where no memory budget moves
    assert (w["replans_per_run"], w["replan_stall_ms"]) == (0, 0.0)
    assert driver_run[0]["replans"] == {"tiny:safesage": {"replans_per_run": 0, "replan_stall_ms": 0.0}}


def test_a_prompt_error_is_a_python_error_row(tmp_path, tiny_h3):
    from bench.repro import worker
    bad = tmp_path / "broken.safetensors"
    bad.write_bytes(b"\0" * 64)            # not a safetensors file: UNETLoader raises in the server
    row = worker.run_row(comfy=comfy_root(), ckpt=bad, arm="pytorch", size="tiny", work=tmp_path / "w",
                         steps=1, cpu=True, timeout=240)
    assert row["rc"] == "execution_error" and row["outcome"].startswith("Python error"), row
    assert row["worker"]["phase"] == "queued"        # the probe after the loader never ran
    assert row["error"] and row["latent"] is None
    assert row["error"].split(":")[0] in open(row["log"], errors="replace").read()


def test_soak_one_server_many_prompts_interrupt_and_reload(tmp_path, tiny_h3):
    """bench/repro soak on the CPU (its GPU run measures memory; here the sequence itself): three
    prompts in one server, a fourth interrupted after two of its steps, every model unloaded, one
    more prompt that loads it again -- all through SafeSage, none falling back."""
    from bench.repro import soak
    doc = soak.run_soak(comfy=comfy_root(), ckpt=tiny_h3["path"], arm="safesage", size="tiny", work=tmp_path / "w",
                        prompts=3, steps=STEPS, cpu=True, interrupt_steps=5000, timeout=240)
    assert doc["errors"] == [], (doc["errors"], doc.get("log_tail"))
    whats = [s["what"] for s in doc["samples"]]
    assert whats == ["server up", "after prompt 1", "after prompt 2", "after prompt 3", "after interrupted prompt",
                     "after /free (models unloaded)", "after reload prompt"]
    by = {s["what"]: s for s in doc["samples"]}
    assert [by[f"after prompt {i}"]["status"] for i in (1, 2, 3)] == ["success"] * 3
    intr = by["after interrupted prompt"]
    assert intr["reached_step_2"] and intr["interrupted"] and intr["status"] == "error"
    assert by["after reload prompt"]["status"] == "success"
    calls = [by[w]["safesage"]["attention_calls"] for w in ("after prompt 1", "after prompt 2", "after prompt 3")]
    per_prompt = tiny_h3["blocks"] * STEPS
    assert calls == [per_prompt, 2 * per_prompt, 3 * per_prompt]
    assert by["after reload prompt"]["safesage"]["fallbacks"] == 0
    assert by["after prompt 1"]["device"] == "cpu" and doc["verdict"]["memory_measured"] is False


def test_later_prompts_run_in_the_same_server_and_keep_the_first_prompts_row(tiny_h3, tmp_path):
    """--prompts 2: the graph runs again in the same server with its own noise seed (ComfyUI's cache
    would otherwise skip the sampler); the row (steps, latent, comparison) stays the first prompt's,
    the second prompt's step times come apart, and the guard measured each run (2 x the forwards)."""
    from bench.repro import driver
    a = _args(tmp_path, tiny_h3["path"], ["tiny:safesage"], keep_latents=str(tmp_path / "lat"), prompts=2)
    doc = driver.driver(a, ["all", "--cpu", "--prompts", "2"])
    r = doc["runs"][0]
    assert r["outcome"] == "completed", (r.get("error"), r.get("log_tail"))
    w = r["worker"]
    later = w["later_prompts"]
    assert [p["prompt"] for p in later] == [2] and later[0]["outcome"] == "completed", later
    assert len(later[0]["s_per_step"]) == STEPS and len(w["s_per_step"]) == STEPS
    assert w["safesage_report"]["forwards"] == 2 * STEPS
    assert (tmp_path / "lat" / "tiny_safesage.pt").exists()
