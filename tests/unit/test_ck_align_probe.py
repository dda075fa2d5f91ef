"""bench/kernels/ck_align_probe.py (ComfyUI #15494): its cases on the CPU, and every committed result of it
(``bench/results/ck*_align_*.json``, comfy-kitchen on the GPU) held to the ck_int8 envelope."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.kernels import ck_align_probe as probe

REPO = Path(__file__).resolve().parents[2]
RESULTS = sorted((REPO / "bench" / "results").glob("ck*_align_*.json"))


@pytest.mark.parametrize("name", list(probe.CASES))
def test_the_envelope_predicts_each_case_as_derived_from_the_launchers(name):
    """Each case's expected outcome was derived by hand from comfy-kitchen's host checks; the
    envelope (safe_ops/families/ck_int8.py AlignRule) must give the same, from the CPU-built views."""
    c = probe.dry_case(name, "0.2.40")
    assert c["predicted"] == c["expected"], c


def test_the_cases_cover_every_outcome_and_each_tensor():
    expected = [e for _, e in probe.CASES.values()]
    assert {"ok", "qk", "v"} <= set(expected)
    which = {s.get("which") for s, e in probe.CASES.values() if e != "ok"}
    assert {"q", "k", "v"} <= which


def test_dry_run_writes_its_command_and_every_case(tmp_path):
    out = tmp_path / "dry.json"
    # the cases' expected outcomes are 0.2.40's; without --ck-version the dry run predicts for the installed
    # comfy-kitchen (783545f6's venv has 0.2.31, whose envelope also checks size-1 dimensions)
    r = subprocess.run([sys.executable, "-m", "bench.kernels.ck_align_probe", "--dry-run", "--ck-version", "0.2.40",
                        "--out", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(out.read_text())
    assert d["command"].startswith("python3 -m bench.kernels.ck_align_probe --dry-run --ck-version 0.2.40 --out ")
    assert d["ck_version_predicted_for"] == "0.2.40"
    assert d["dry_run"] is True and [c["name"] for c in d["cases"]] == list(probe.CASES)
    bad = [c["name"] for c in d["cases"] if c["predicted"] != c["expected"]]
    assert not bad


def test_the_reference_runs_on_fresh_contiguous_copies(monkeypatch):
    """On the H100 PyTorch's own SDPA failed on two cases' views (no cutlass kernel for an odd token
    stride; a misaligned address for an fp32 view 8 bytes in) and crashed the case. The reference
    is now SDPA on fresh contiguous float32 copies: an SDPA that refuses such views, as the GPU's did,
    still gives it, equal to SDPA on the views; and a reference that raises is recorded, not a crash."""
    import torch
    real = torch.nn.functional.scaled_dot_product_attention

    def picky(q, k, v, *a, **kw):          # the fused GPU kernels' preconditions, on the CPU
        for t in (q, k, v):
            if not t.is_contiguous() or t.data_ptr() % 16:
                raise RuntimeError("cutlassF: no kernel found to launch!")
        return real(q, k, v, *a, **kw)

    for name in ("fp32_offset2", "head1_stride_odd"):
        q, k, v = probe.build(probe.CASES[name][0], "cpu")
        want = real(q.float(), k.float(), v.float())
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", picky)
        got = probe.reference(q, k, v)
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", real)
        assert torch.allclose(got, want, atol=1e-6), name

    monkeypatch.setattr(probe, "reference", lambda q, k, v: (_ for _ in ()).throw(RuntimeError("no kernel")))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    q, k, v = probe.build(probe.CASES["contiguous_hnd"][0], "cpu")
    r = probe.attempt(lambda a, b, c: a.clone(), q, k, v)
    assert r["outcome"] == "ok" and r["finite"] and "rel_l2" not in r and "no kernel" in r["reference_error"]


def test_cases_rerun_into_an_earlier_result(tmp_path, monkeypatch):
    """--cases runs only the named cases; --merge keeps the earlier result's others, in CASES order,
    and says which it kept."""
    names = list(probe.CASES)
    earlier = {"command": "python3 -m bench.kernels.ck_align_probe --out e.json",
               "cases": [{"name": n, "agrees": True, "from": "earlier"} for n in names]}
    (tmp_path / "e.json").write_text(json.dumps(earlier))
    monkeypatch.setattr(probe, "child", lambda n, version, timeout: {"name": n, "agrees": True, "from": "now",
                                                                      "measured": {"outcome": "ok"}})
    out = tmp_path / "o.json"
    probe.main(["--cases", f"{names[3]},{names[1]}", "--merge", str(tmp_path / "e.json"), "--out", str(out)])
    d = json.loads(out.read_text())
    assert [c["name"] for c in d["cases"]] == names
    assert {c["name"] for c in d["cases"] if c["from"] == "now"} == {names[1], names[3]}
    assert d["merged_from"]["cases_kept"] == sorted(set(names) - {names[1], names[3]})
    assert d["summary"] == {"cases": len(names), "agree": len(names), "disagree": []}
    with pytest.raises(SystemExit):
        probe.main(["--cases", "no_such_case", "--out", str(out)])


def test_outcome_reads_kitchens_messages():
    assert probe.outcome(None) == "ok"
    assert probe.outcome("RuntimeError: quant_qk_per_thread_int8: Q/K base pointers and B/H/N strides "
                         "must preserve 4-element alignment") == "qk"
    assert probe.outcome("RuntimeError: quant_v_int8: V base pointer and B/H/N strides must be "
                         "16-byte aligned") == "v"
    assert probe.outcome("OverflowError: sage_sdpa: tensor strides exceed int32 range") == "other"


@pytest.mark.skipif(not RESULTS, reason="no bench/results/ck*_align_*.json committed yet "
                                        "(python3 -m bench.kernels.ck_align_probe on the GPU writes one)")
@pytest.mark.parametrize("path", RESULTS, ids=[p.name for p in RESULTS])
def test_measured_outcomes_are_the_envelopes(path):
    """On the GPU: comfy-kitchen raised exactly where the envelope predicted (and which check),
    nothing crashed or left a CUDA error, and every contiguous copy ran, finite."""
    d = json.loads(path.read_text())
    # recorded under the module's name before issue 49 moved it into bench/kernels/, or after
    recorded = ("python3 -m bench.ck_align_probe", "python3 -m bench.kernels.ck_align_probe")
    assert not d["dry_run"] and d["command"].startswith(recorded)
    for c in d["cases"]:
        assert "crashed" not in c, (c["name"], c.get("crashed"))
        m, r = c["measured"], c["repacked"]
        assert m["cuda_error_after"] is None and r["cuda_error_after"] is None, c["name"]
        assert m["outcome"] == c["predicted"], (c["name"], m.get("error"), c["violations"])
        assert r["outcome"] == "ok" and r["finite"], (c["name"], r)
