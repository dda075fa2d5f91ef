"""The SafeSage Preflight node's report (safe_ops.ui.preflight's verdicts, worded by safe_ops.ui.preflight_text)
and the nodes' status lines (safe_ops.ui.status) on given runtimes: this GPU, no GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from safe_ops.models.h3 import dims
from safe_ops.ui import status
from safe_ops.ui import preflight as pf
from safe_ops.policy import Policy
from safe_ops.ui.preflight_text import preflight_report
from safe_ops.facts.devices import Runtime

REPO = Path(__file__).resolve().parents[2]
H200_SAGE22 = Runtime("2.13", "13.0", "NVIDIA H200", (9, 0), "2.2.0", "sage2_sm90", None, "native", True, "0.30.0")
RTX5090_NO_SAGE = Runtime("2.13", "13.0", "NVIDIA GeForce RTX 5090", (12, 0), None, None,
                          "package not installed", "native", True, "0.30.0")
CPU = Runtime("2.13", None, None, None, None, None, "package not installed", None, None, None)
GiB = 2 ** 30


def _report(rt, **kw):
    return preflight_report(1664, 960, 362, ref_images=3, rt=rt, comfy_wants_sage=True, **kw)


def test_this_gpu_with_sage22():
    r = _report(H200_SAGE22, free_bytes=80 * GiB, policy=Policy(kernel="sage"))
    (v,) = r["verdicts"]
    # the reporter's graph: video 107 latent frames x 1,560 + audio 1,206 + 3 refs x 1,560 + text 256
    # (worked out in test_patch_preflight.test_h3_token_arithmetic)
    assert v.scenario.label == "this GPU: NVIDIA H200 (sm_90)" and v.S == 173_062
    assert v.violations and v.safe_up_to == 99_865
    assert v.plan.kernel == "sage2_sm90" and v.plan.kind != "direct"
    assert "runs: " + v.plan.describe(reasons=False) in r["text"]      # the planner's own words
    assert any(w.startswith("173,062 tokens: SageAttention 2.2.0 -> sage2_sm90 on sm_90") for w in r["warnings"])
    assert v.mlp_chunk < v.S and v.mlp_bytes < v.mlp_unchunked_bytes


def test_budget_and_memory_warning_follow_free_memory():
    tight = _report(H200_SAGE22, free_bytes=2 * GiB, policy=Policy(kernel="sage"))
    assert any("exceed the 2.00 GiB free now" in w for w in tight["warnings"])
    (v,) = tight["verdicts"]
    from safe_ops.facts.budget import plan_budget_bytes
    assert v.scenario.budget_bytes == plan_budget_bytes(2 * GiB)      # the runtime's own budget rule
    assert v.plan.peak_bytes <= v.scenario.budget_bytes


def test_gpu_without_sage_also_shows_sage22():
    r = _report(RTX5090_NO_SAGE, free_bytes=24 * GiB)
    labels = [v.scenario.label for v in r["verdicts"]]
    assert labels == ["this GPU: NVIDIA GeForce RTX 5090 (sm_120)",
                      "this GPU: NVIDIA GeForce RTX 5090 (sm_120) with sageattention 2.2 installed"]
    assert r["verdicts"][0].plan.kernel == "sdpa" and "sageattention not usable" in r["text"]
    v = r["verdicts"][1]
    assert v.safe_up_to == 149_999 and v.violations[0].rule == "length"     # the sm_120 fp8 length rule
    assert v.plan.kind != "direct"                                          # whatever the planner returns
    assert any(w.startswith("173,062 tokens: SageAttention 2.2.0 -> sage2_sm120_fp8pv on sm_120 would cross "
                            "its limits (length, safe up to 149,999)") and w.endswith(v.plan.describe(reasons=False))
               for w in r["warnings"]), r["warnings"]


def test_cpu_reports_common_gpus_and_sage_versions():
    r = _report(CPU)
    got = {(v.scenario.arch, v.scenario.sage_version, v.scenario.family) for v in r["verdicts"]}
    assert got == {((8, 9), "2.2.0", "sage2_sm89_fp8pv"), ((8, 9), "1.0.6", "sage1_triton"),
                   ((9, 0), "2.2.0", "sage2_sm90"), ((9, 0), "1.0.6", "sage1_triton"),
                   ((12, 0), "2.2.0", "sage2_sm120_fp8pv"), ((12, 0), "1.0.6", "sage1_triton")}
    assert "no CUDA device here" in r["text"]


def test_policy_changes_the_plan_and_the_mlp_chunk():
    sdpa = _report(H200_SAGE22, free_bytes=80 * GiB, policy=Policy(kernel="sdpa", mlp_chunking="off"))
    (v,) = sdpa["verdicts"]
    assert v.plan.kind == "sdpa" and v.mlp_chunk == v.S and "MLP unchunked" in sdpa["text"]
    fixed = _report(H200_SAGE22, free_bytes=80 * GiB, policy=Policy(mlp_chunking="tokens", mlp_chunk_tokens=4096))
    assert fixed["verdicts"][0].mlp_chunk == 4096


def test_comfy_count_absent_without_comfyui():
    """Outside ComfyUI (a fresh process with only the repository on the path) ComfyUI's own count
    is unavailable and the report falls back to SafeSage's arithmetic, saying so."""
    code = ("from safe_ops.models.h3.dims import comfy_h3_tokens\nfrom safe_ops.ui.preflight_text import preflight_report\n"
            "from safe_ops.facts.devices import Runtime\n"
            "rt = Runtime('t', None, None, None, None, None, 'x', None, None, None)\n"
            "print(comfy_h3_tokens(1664, 960, 362))\n"
            "print(preflight_report(64, 64, 5, rt=rt, comfy_wants_sage=False)['text'].splitlines()[1])\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert r.returncode == 0, r.stderr
    none, line = r.stdout.splitlines()
    assert none == "None" and "counted with SafeSage's copy" in line


def test_token_arithmetic_pads_odd_latents_like_comfyui():
    # 976 / 16 = 61 latent rows, padded to 62 for the 2x2 patch: 31 token rows (not 976 // 32 = 30);
    # 560 / 16 = 35 -> 36: 18. 200 frames snap up to 209 = 17 * 12 + 5 on H3's grid: 12 * 5 + 2 = 62
    # latent frames (ComfyUI 0dd9b154's PackedLayout gives the same 34,596 video tokens).
    t = dims.h3_tokens(976, 560, 200, ref_images=1, text_tokens=0)
    assert t.video == 62 * 31 * 18 == 34_596
    assert t.refs == 30 * 18                     # the reference is rounded to 960x576 first
    assert t.audio == 2 * 348                    # 209 / 24 s at 40 Hz = 348.3, stereo


def test_limits_lines_for_the_attention_node():
    lines = status.limits_lines(H200_SAGE22, Policy())
    assert lines[0].startswith("H3 attention on sage2_sm90: as called it is safe up to 99,865 tokens")
    assert "SafeSage Preflight" in lines[-1]
    assert len(status.limits_lines(CPU, Policy())) == 1
    assert not any("comfy-kitchen" in line for line in lines)          # not installed in H200_SAGE22
    from dataclasses import replace
    ck = status.limits_lines(replace(H200_SAGE22, ck_version="0.2.33", ck_family="ck_int8_pre236"), Policy())
    assert len(ck) == len(lines) + 1
    assert ck[1] == ("[comfy-kitchen 0.2.33 int8_attention -> ck_int8_pre236] limits: none crossed at "
                     "173,062 tokens (safe up to 299,520)")


def test_model_context():
    policy, note = status.model_context(None)
    assert policy == Policy() and "not connected" in note

    class Patcher:
        model_options = {"transformer_options": {}}
        model = type("M", (), {"diffusion_model": object()})()
    policy, note = status.model_context(Patcher())
    assert "NOT MiniMax H3 (object)" in note and "no SafeSage Attention node" in note


def test_demo_without_torch_says_what_to_run():
    code = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = ['demo'];"
            "runpy.run_module('safe_ops.demo', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "python3 tools/demo.py" in r.stderr and "Traceback" not in r.stderr


def test_tools_demo_runs_the_demo_with_this_python():
    r = subprocess.run([sys.executable, "tools/demo.py", "--help"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "usage: python3 -m safe_ops.demo" in r.stdout and "preparing" not in r.stderr


def test_mlp_prediction_against_the_h200_measurement():
    """bench/results/mlp_h200.json (python3 bench/mlp/bench_mlp.py on an H200): chunked predictions
    between 0.90x and 1.30x the measured working memory (per_token_bytes counts the fp8 input
    copies of the scaled_mm path, which the dequantising path does not make), unchunked ones
    never below it."""
    import json

    runs = json.loads((REPO / "bench" / "results" / "mlp_h200.json").read_text())["runs"]
    assert len(runs) == 24, "the committed measurement: 24 runs (3 modes x sizes x variants)"
    for r in runs:
        predicted = pf.mlp_transient_bytes(r["S"], r["chunk_tokens"])
        measured = r["working_bytes"]
        if r["variant"] == "unpatched":
            assert measured <= predicted <= 1.5 * measured, r
        else:
            assert 0.90 * measured <= predicted <= 1.30 * measured, (r["mode"], r["S"], r["chunk_tokens"],
                                                                     predicted / measured)


def test_mlp_prediction_against_comfyuis_own_layers_on_the_h200():
    """bench/results/mlp_comfy_*h200*.json (bench/mlp/gpu_mlp_comfy.py: ComfyUI 0dd9b154's MLP and ops on
    an H200, extra peak memory of one call; the earlier runs of the pack's mirror of ComfyUI's
    layers, and of ComfyUI's own forward per chunk): the prediction is never below the
    measurement; on the quantised paths (fp8 _scaled_mm, int8) it is within 6 %, on bf16 (no
    input copies) it overestimates, by at most 1.6x. (The lowvram arm's peak also holds the
    weights ComfyUI casts to the GPU, which are not the MLP's transients.)"""
    import json

    runs = []
    for path in sorted((REPO / "bench" / "results").glob("mlp_comfy_*h200*.json")):
        runs += [r for r in json.loads(path.read_text())["runs"]
                 if r["mode"] in ("fp8", "bf16", "int8") and r["variant"] != "per_chunk"]
    assert {r["mode"] for r in runs} == {"fp8", "bf16", "int8"} and len(runs) >= 72
    for r in runs:
        ratio = pf.mlp_transient_bytes(r["S"], r.get("chunk_tokens", r["S"])) / r["peak_extra_bytes"]
        top = 1.6 if r["mode"] == "bf16" else 1.06
        assert 1.0 <= ratio <= top, (r["mode"], r["S"], r["variant"], ratio)


def test_gpu_runtime_without_a_readable_free_memory(monkeypatch):
    """free memory unknown (the runtime's reader fails): no budget, no memory warning, still a plan."""
    import safe_ops.facts.budget
    monkeypatch.setattr(safe_ops.facts.budget, "free_device_bytes", lambda device: None)
    r = preflight_report(1664, 960, 362, ref_images=3, rt=H200_SAGE22, comfy_wants_sage=True)
    (v,) = r["verdicts"]
    assert v.scenario.budget_bytes is None and v.plan is not None
    assert not any("free now" in w for w in r["warnings"])


def test_comfy_kitchen_attention_in_the_report():
    """comfy-kitchen's int8_attention (--use-ck-attention): without a GPU both version envelopes;
    on a GPU the installed one, or why it is not usable. 0.2.29-0.2.35's limit is #178's 299,520."""
    from dataclasses import replace
    # 1201 frames snap up to 1212 = 17 * 71 + 5: 71 * 5 + 2 = 357 latent frames of 23 x 40 tokens
    # (720 / 16 = 45 -> 46 / 2, 1280 / 32); audio 2 * round(1212 / 24 * 40) = 4,040; text 256
    # = 332,736, above 0.2.29-0.2.35's limit of 299,520
    S = 357 * 23 * 40 + 4_040 + 256
    r = preflight_report(1280, 720, 1201, rt=CPU, comfy_wants_sage=True)
    text = r["text"]
    assert "[comfy-kitchen 0.2.36-0.2.40 int8_attention -> ck_int8] limits: none crossed at " \
           f"{S:,} tokens (no limit up to 2,000,000)" in text
    old = [line for line in text.splitlines() if line.startswith("[comfy-kitchen 0.2.29-0.2.35")]
    assert len(old) == 1 and "(safe up to 299,520)" in old[0] and "runs it as: head_groups on ck_int8_pre236" in old[0]
    assert any(w.startswith(f"{S:,} tokens: comfy-kitchen 0.2.29-0.2.35 int8_attention") for w in r["warnings"])
    # below the old limit nothing is crossed and nothing is warned about comfy-kitchen
    small = preflight_report(1664, 960, 362, ref_images=3, rt=CPU, comfy_wants_sage=True)
    assert "ck_int8_pre236] limits: none crossed at 173,062 tokens (safe up to 299,520)" in small["text"]
    assert not any("comfy-kitchen" in w for w in small["warnings"])
    # a GPU: only what is installed
    gpu = replace(H200_SAGE22, ck_version="0.2.35", ck_family="ck_int8_pre236")
    g = preflight_report(1280, 720, 1201, rt=gpu, comfy_wants_sage=True, free_bytes=80 * GiB)
    ck = [line for line in g["text"].splitlines() if line.startswith("[comfy-kitchen")]
    assert len(ck) == 1 and ck[0].startswith("[comfy-kitchen 0.2.35 int8_attention -> ck_int8_pre236]")
    assert any("int8_attention on sm_90 would cross" in w for w in g["warnings"])
    none = replace(H200_SAGE22, ck_error="comfy-kitchen 0.2.26 has no int8_attention (needs >= 0.2.29)")
    n = preflight_report(1280, 720, 1201, rt=none, comfy_wants_sage=True, free_bytes=80 * GiB)
    assert "[comfy-kitchen int8_attention] not usable here: comfy-kitchen 0.2.26 has no int8_attention" in n["text"]


def test_preflight_lists_the_quality_guards_candidates_here(monkeypatch):
    """Preflight words the move order the node measures and moves by (move_order.runtime_move_order, not
    the installed families): on the H200 ``auto`` plans ComfyUI's own attention -- nothing moves; an RTX
    5090 with sage 2.2 + comfy-kitchen 0.2.40: tests/unit/test_quality_order.py."""
    import emulated_gpus as E
    E.install_packages(monkeypatch)
    rt = E.runtime(E.H200)
    text = preflight_report(1664, 960, 362, ref_images=3, rt=rt, comfy_wants_sage=True)["text"]
    line = next(ln for ln in text.splitlines() if ln.startswith("quality guard (balanced)"))
    assert line == "quality guard (balanced): nothing to measure or move: ComfyUI's own attention is the plan here"
    sage = preflight_report(1664, 960, 362, ref_images=3, rt=rt, comfy_wants_sage=True, policy=Policy(kernel="sage"))
    line = next(ln for ln in sage["text"].splitlines() if ln.startswith("quality guard (balanced)"))
    assert line.startswith("quality guard (balanced): blocks run sage2_sm90; a block over its target moves to "
                           "ck_int8, else sage2_sm80, else ComfyUI's own attention"), line
    off = preflight_report(1664, 960, 362, rt=H200_SAGE22, policy=Policy(quality="faults only"))["text"]
    assert "quality guard: faults only" in off and "quality guard (" not in off


def test_preflight_states_the_speed_budget_and_its_sources(monkeypatch):
    """Issue #46 goal 1: Preflight shows the quality setting's speed budget and the speeds it prices with
    (their cards and versions); under kernel=sage there is none."""
    import emulated_gpus as E
    E.install_packages(monkeypatch)
    rt = E.runtime(E.RTX5090)
    text = preflight_report(1664, 960, 362, rt=rt, comfy_wants_sage=True)["text"]
    line = next(ln for ln in text.splitlines() if ln.startswith("quality guard (balanced): speed budget"))
    assert "1.05x" in line and "ck_int8 536 TFLOP/s" in line and "sage2_sm120_fp8pv 560 TFLOP/s" in line, line
    strict = preflight_report(1664, 960, 362, rt=rt, comfy_wants_sage=True, policy=Policy(quality="strict"))["text"]
    assert "quality guard (strict): speed budget 1.50x" in strict
    sage = preflight_report(1664, 960, 362, rt=rt, comfy_wants_sage=True, policy=Policy(kernel="sage"))["text"]
    assert "quality guard (balanced): speed budget: none under kernel 'sage'" in sage
