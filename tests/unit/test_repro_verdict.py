"""bench/repro: which reproduction rows are called silently wrong (docs/REPRODUCTION.md's tables come
from verdict.py), the latent store that lets a run's arms be split over several device calls, and the
OOM attribution the probe pack records inside the server."""
import argparse
import json
from pathlib import Path

from bench.repro import arms, driver, memory, verdict  # no torch at import time

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"

CK = {"blocks": 50, "bytes": 21361189160}


def _doc(runs, ck=CK, steps=1, arch="sm120"):
    cmd = "python -m bench.repro all --steps %d" % steps + (f" --emulate-arch {arch}" if arch else "")
    return {"checkpoint": dict(ck), "steps": steps, "seed": 77, "command": cmd,
            "runs": [dict(size=s, arm=a, outcome="completed", rel_l2_vs_pytorch=r, worker={}) for s, a, r in runs]}


def _wrong_arms(text):
    return [ln.split("|")[2].strip() for ln in text.splitlines() if "silently wrong" in ln]


def test_deep_model_error_is_not_called_wrong_but_a_broken_kernel_is():
    # 50 blocks of sage 2.2 FP8-PV: 0.058 vs PyTorch even inside every limit; 0.125 is a wrapped index
    d = _doc([("38k", "pytorch", 0.0), ("38k", "sage", 0.0578), ("169k", "pytorch", 0.0),
              ("169k", "safesage", 0.0565), ("169k", "sage_nodyn", 0.125)])
    assert _wrong_arms(verdict.table(d)) == [arms.ARM_LABEL["sage_nodyn"]]


def test_reference_comes_from_another_run_of_the_same_checkpoint_only():
    big = _doc([("169k", "pytorch", 0.0), ("169k", "sage", 0.0561)])
    ref = _doc([("38k", "pytorch", 0.0), ("38k", "sage", 0.0231)])
    assert _wrong_arms(verdict.table(big, [ref])) == [arms.ARM_LABEL["sage"]]
    other_ckpt = _doc([("38k", "sage", 0.0231)], ck={"blocks": 2, "bytes": 1})
    other_steps = _doc([("38k", "sage", 0.0231)], steps=2)
    other_arch = _doc([("38k", "sage", 0.0231)], arch=None)
    for d in (other_ckpt, other_steps, other_arch):
        text = verdict.table(big, [d])
        assert _wrong_arms(text) == [] and "no row is judged" in text


def test_without_an_in_limit_run_nothing_is_judged():
    text = verdict.table(_doc([("169k", "pytorch", 0.0), ("169k", "safesage", 0.9)]))
    assert _wrong_arms(text) == [] and "no row is judged" in text


def _store_args(tmp_path, ckpt, seed=77):
    return argparse.Namespace(keep_latents=str(tmp_path / "lat"), ckpt=str(ckpt), steps=1, seed=seed,
                              emulate_arch="sm120", cpu=False)


def test_latent_store_keeps_arms_of_the_same_setup_and_empties_for_another(tmp_path):
    ckpt = tmp_path / "h3.safetensors"
    ckpt.write_bytes(b"x" * 10)
    doc = {}
    assert driver._latent_store(_store_args(tmp_path, ckpt), doc) == {}
    for n in ("169k_pytorch.pt", "169k_sage_nodyn.pt", "notes.txt"):
        (tmp_path / "lat" / n).write_bytes(b"0")
    found = driver._latent_store(_store_args(tmp_path, ckpt), doc)
    assert sorted(found) == [("169k", "pytorch", 1), ("169k", "sage_nodyn", 1)]      # (size, arm, prompt)
    assert doc["earlier_latents"] == ["169k:pytorch", "169k:sage_nodyn"]
    # another seed (or checkpoint) must not be compared with these latents: the store is emptied
    assert driver._latent_store(_store_args(tmp_path, ckpt, seed=1), {}) == {}
    assert not (tmp_path / "lat" / "169k_pytorch.pt").exists()
    ckpt.write_bytes(b"y" * 11)
    (tmp_path / "lat" / "169k_pytorch.pt").write_bytes(b"0")
    assert driver._latent_store(_store_args(tmp_path, ckpt, seed=1), {}) == {}


class _FakeCuda:
    @staticmethod
    def memory_stats():
        return {"allocated_bytes.all.current": 14.81 * 2 ** 30, "reserved_bytes.all.current": 26 * 2 ** 30,
                "allocated_bytes.all.peak": 22 * 2 ** 30, "reserved_bytes.all.peak": 26.5 * 2 ** 30}

    @staticmethod
    def mem_get_info():
        return 25 << 20, 140 << 30


class _FakeModel:
    def __init__(self, resident=None):
        self.resident = resident

    def loaded_size(self):
        if self.resident is None:
            raise RuntimeError("no VBAR")
        return self.resident << 20


class _FakeNv:
    def info(self):
        return {"nvml_peak_process_gib": 27.4}


def test_oom_evidence_separates_live_tensors_pool_and_weights():
    ev = memory.memory_at_oom(argparse.Namespace(cuda=_FakeCuda), _FakeModel(1377), _FakeNv())
    assert (ev["torch_allocated_gib"], ev["torch_reserved_gib"], ev["cuda_free_mib"]) == (14.81, 26.0, 25)
    assert ev["weights_resident_mib"] == 1377 and ev["nvml_peak_process_gib"] == 27.4
    # evidence only: a failing probe is recorded, never raised over the OOM it describes
    ev = memory.memory_at_oom(argparse.Namespace(cuda=None), _FakeModel(None), _FakeNv())
    assert "torch_error" in ev and "weights_error" in ev
    row = _doc([("169k", "sage", None)])
    row["runs"][0].update(outcome="Python error, exit 1 (phase: sampling)", error="torch.OutOfMemoryError: x",
                          worker={"memory_at_oom": memory.memory_at_oom(argparse.Namespace(cuda=_FakeCuda),
                                                                        _FakeModel(1377), _FakeNv())})
    assert "CUDA free 25 MiB, torch allocated 14.81 / reserved 26.0 GiB, weights resident 1377 MiB" in verdict.table(row)
    # inside the server the worker's NVML reading is added afterwards: none of it comes from there
    ev = memory.memory_at_oom(argparse.Namespace(cuda=_FakeCuda), _FakeModel(1377))
    assert not any(k.startswith("nvml") for k in ev) and ev["weights_resident_mib"] == 1377


def test_worker_outcomes_read_as_the_verdict_expects():
    from bench.repro import worker  # imports no torch
    abort = worker.outcome(-6, {"phase": "sampling"}, 100)
    assert abort == "process abort: SIGABRT (phase: sampling)"
    row = _doc([("169k", "sage", None)])
    row["runs"][0].update(outcome=abort, key_lines=["  what():  CUDA error: an illegal memory access"],
                          python_stack_at_abort=['File "/c/comfy/ldm/modules/attention.py", line 581 in attention_sage'])
    assert "`CUDA error: an illegal memory access`; Python was at `modules/attention.py:581 attention_sage`" \
        in verdict.table(row)
    # ComfyUI reports a Python error and lives on: the row carries the error line (and OOM evidence)
    assert worker.outcome("execution_error", {"phase": "sampling"}, 100).startswith("Python error")
    assert worker.outcome("timeout", {"phase": "step 1/2 done"}, 100) == "timeout after 100 s (phase: step 1/2 done)"
    assert worker.outcome(0, {"phase": "done", "completed": True}, 100) == "completed"
    assert worker.outcome(0, {"phase": "sampled"}, 100) != "completed"   # the latent was never saved


def test_committed_first_run_still_reads_as_docs_reproduction_states():
    # docs/REPRODUCTION.md: at 100,678 tokens both workarounds complete with wrong output; the unguarded
    # sage arm aborts at 100k and 169k, and so do both workarounds at 169k
    doc = json.loads((RESULTS / "repro_h200.json").read_text())
    text = verdict.table(doc)
    assert _wrong_arms(text) == [arms.ARM_LABEL["sage_blocking"], arms.ARM_LABEL["sage_nodyn"]]
    aborts = [ln.split("|")[1].strip().split()[0] + " " + ln.split("|")[2].strip()
              for ln in text.splitlines() if "process abort: SIGABRT" in ln]
    assert aborts == ["100k " + arms.ARM_LABEL["sage"], "169k " + arms.ARM_LABEL["sage"],
                      "169k " + arms.ARM_LABEL["sage_blocking"], "169k " + arms.ARM_LABEL["sage_nodyn"]]


def test_replans_per_run_and_stall_read_from_the_stats_route():
    """bench/repro/replans.py: what a row's /safesage/stats says about re-planning (issue 29 point 2)."""
    from bench.repro.replans import per_prompt, replan_fields
    assert replan_fields(None) == {"replans_per_run": None, "replan_stall_ms": None}
    assert replan_fields({"plans": {"k": "direct"}}) == {"replans_per_run": 0, "replan_stall_ms": 0.0}
    assert replan_fields({"plans": {}, "replans": 2, "replan_us": 140_250}) == \
        {"replans_per_run": 2, "replan_stall_ms": 140.25}
    assert replan_fields({"plans": {}, "replans": 1}) == {"replans_per_run": 1, "replan_stall_ms": None}
    soak = [{"what": "after prompt 1", "safesage": {"replans": 1, "replan_us": 16_000}},
            {"what": "after prompt 2", "safesage": {"replans": 1, "replan_us": 16_000}},
            {"what": "after prompt 3", "safesage": {"replans": 3, "replan_us": 100_000}}]
    assert [(r["replans"], r["replan_stall_ms"]) for r in per_prompt(soak)] == [(1, 16.0), (0, 0.0), (2, 84.0)]
