"""Preflight's longest length (issue #47 item 3): the length model (safe_ops/ui/length_model.py) with the
constants bench.length.fit_lengths fitted from committed GPU runs (safe_ops/facts/length_model.json).

The facts file is the fit of its committed sources; the model reproduces the lengths it was fitted on
(and the plans the probes logged); its longest length lands within 15 % of bench/results/
max_length_h100.json's measured longest per arm, and the measured failing length does not fit -- which
a model without the per-token term (Preflight's old one: SafeSage's temporaries only) cannot do; 32 GiB
is predicted and marked unverified; SafeSage's own temporaries shrink with free memory."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from safe_ops.models.h3.dims import h3_tokens
from safe_ops.ui import length_model as lm

REPO = Path(__file__).resolve().parents[2]
GiB = 2 ** 30
FACT = json.loads((REPO / "safe_ops" / "facts" / "length_model.json").read_text())
ML = json.loads((REPO / "bench" / "results" / "max_length_h100.json").read_text())
MEASURED = ML["budgets"]["24"]["arms"]


@pytest.fixture(scope="module")
def refit():
    from bench.length import fit_lengths
    return fit_lengths.fit(*fit_lengths.load())


def test_the_facts_file_is_the_fit_of_its_committed_sources(refit):
    assert json.loads(json.dumps(refit)) == FACT
    src = FACT["sources"]
    assert src["max_length"] == "bench/results/max_length_h100.json"
    for arm, a in FACT["arms"].items():
        assert len(a["per_token_on"]) >= 2, arm                   # at least two completed lengths per arm
        for p in a["per_token_on"] + a["overhead_on"]:
            assert (REPO / p["source"]).exists() and p["field"], (arm, p)


def test_the_model_reproduces_the_lengths_it_was_fitted_on():
    for arm, rows in FACT["points"].items():
        for r in rows:
            if "measured_torch_alloc_gib" not in r:
                continue
            pk = lm.step_peak(arm, r["tokens"], 24 * GiB)
            own = lm.own_attention_bytes(r["tokens"], pk.planned) if arm == "safesage" else pk.own
            model = (pk.activations + own) / GiB
            assert model == pytest.approx(r["model_torch_alloc_gib"], abs=1e-3)
            # a line through the unguarded arms' points; SafeSage's through the origin after its plan
            tol = 0.025 if arm == "safesage" else 0.002
            if r["fitted_on"] or arm != "safesage":
                assert model == pytest.approx(r["measured_torch_alloc_gib"], rel=tol), (arm, r)
            else:                       # SafeSage's held-out 753 frames: within 5 %
                assert model == pytest.approx(r["measured_torch_alloc_gib"], rel=0.05), (arm, r)


def test_safesages_plan_at_each_probe_is_the_plan_it_logged():
    # the planner, under the budget its rule takes from the free memory the model predicts, makes the
    # plan each SafeSage probe of the 24 GiB search logged -- the failed 804 frames too
    rows = FACT["points"]["safesage"]
    assert {r["where"].split()[1] for r in rows} >= {"651", "719", "753", "804"}
    for r in rows:
        pk = lm.step_peak("safesage", r["tokens"], 24 * GiB)
        assert pk.planned.describe(reasons=False) == r["plan_logged"], r["where"]


@pytest.mark.parametrize("arm", lm.ARMS)
def test_the_longest_length_is_within_15_percent_of_the_measured_one(arm):
    m = MEASURED[arm]
    got = lm.longest(arm, 24 * GiB, ML["width"], ML["height"], text_tokens=ML["text_tokens"])
    ratio = got.tokens / m["max_tokens"]
    assert 0.85 <= ratio <= 1.15, (arm, got.frames, m["max_frames"], ratio)
    # the measured longest fits, the measured failure does not
    assert lm.step_peak(arm, m["max_tokens"], 24 * GiB).fits
    assert not lm.step_peak(arm, m["fail_above_tokens"], 24 * GiB).fits
    row = FACT["budgets"]["24"]["arms"][arm]
    assert (row["predicted_frames"], row["preflight_over_measured"]) == (got.frames, round(ratio, 3))
    assert row["within_15pct"] and row["fail_predicted"]


def test_safesages_check_is_on_a_length_it_was_not_fitted_on():
    fitted = {p["frames"] for p in FACT["arms"]["safesage"]["per_token_on"] + FACT["arms"]["safesage"]["overhead_on"]}
    assert MEASURED["safesage"]["max_frames"] not in fitted
    assert FACT["budgets"]["24"]["arms"]["safesage"]["measured_longest_fitted_on"] is False


def test_without_the_per_token_term_the_prediction_is_far_off():
    # Preflight's model before issue 47 priced SafeSage's temporaries only: 3,592 frames at 24 GiB (4.8x).
    # The same model without its per-token terms lands at the grid's top, far outside 15 %.
    f = copy.deepcopy(FACT)
    for a in f["arms"].values():
        a["per_token_bytes"] = 0.0
    f["mlp_phase"]["per_token_bytes"] = 0.0
    for arm in lm.ARMS:
        got = lm.longest(arm, 24 * GiB, ML["width"], ML["height"], text_tokens=ML["text_tokens"], f=f)
        assert got.tokens / MEASURED[arm]["max_tokens"] > 1.15, arm


def test_32_gib_is_predicted_and_marked_unverified():
    assert "32" not in ML["budgets"]                    # never measured
    b = FACT["budgets"]["32"]
    assert b["measured"] is False and "unverified" in b["note"]
    for arm, row in b["arms"].items():
        assert "preflight_over_measured" not in row and "measured_max_frames" not in row
        assert row["predicted_frames"] == lm.longest(arm, 32 * GiB, ML["width"], ML["height"],
                                                     text_tokens=ML["text_tokens"]).frames
        assert row["predicted_frames"] > FACT["budgets"]["24"]["arms"][arm]["predicted_frames"]
    assert lm.measured_budget(32 * GiB)["measured"] is False and lm.measured_budget(24 * GiB)["measured"] is True


def test_safesages_temporaries_shrink_with_free_memory():
    S = h3_tokens(1280, 720, 651).total
    own = [lm.step_peak("safesage", S, int(g * GiB)).planned.peak_bytes for g in (40, 32, 26, 24, 22)]
    assert own == sorted(own, reverse=True) and own[0] > own[-1]
    # where the plan its budget rule makes would not fit with the result and its copy, a smaller one does
    # (719 frames at 24 GiB: the 14-head plan it ran is priced 0.3 GiB over; the step completed)
    pk = lm.step_peak("safesage", h3_tokens(1280, 720, 719).total, 24 * GiB)
    assert pk.fits and pk.plan.peak_bytes < pk.planned.peak_bytes


def test_the_peak_grows_with_the_length_so_bisection_finds_the_longest():
    for arm in lm.ARMS:
        lg = lm.longest(arm, 24 * GiB, 1280, 720, max_length=1200)
        from safe_ops.ui.preflight import grid_lengths
        fits = [n for n in grid_lengths(1200) if lm.step_peak(arm, h3_tokens(1280, 720, n).total, 24 * GiB).fits]
        assert fits == [n for n in grid_lengths(1200) if n <= lg.frames] and lg.next_frames == \
            min(n for n in grid_lengths(1200) if n > lg.frames)
        assert lg.peak.fits and not lg.next_peak.fits


def test_nothing_fits_and_the_grid_top():
    lg = lm.longest("safesage", 2 * GiB, 1280, 720)
    assert lg.frames is None and lg.next_frames == 5 and not lg.next_peak.fits
    lg = lm.longest("safesage", 400 * GiB, 1280, 720, max_length=600)
    assert lg.frames == 600 and lg.capped and lg.next_frames is None


# ------------------------------------------------------------------------------------ Preflight's text
def _cpu():
    from safe_ops.facts.devices import Runtime
    return Runtime("2.13", None, None, None, None, None, "package not installed", None, None, None)


def test_preflight_shows_the_predicted_longest_length_and_its_assumptions():
    from safe_ops.ui.preflight_text import preflight_report
    text = preflight_report(1280, 720, 362, rt=_cpu(), comfy_wants_sage=True)["text"]
    lines = text.splitlines()
    # without a GPU: the facts file's budgets, 24 GiB against the measured longest, 32 GiB unverified
    l24 = next(ln for ln in lines if ln.startswith("longest length predicted at 1280x720") and "24.0 GiB free" in ln)
    l32 = next(ln for ln in lines if ln.startswith("longest length predicted at 1280x720") and "32.0 GiB free" in ln)
    for line, gib in ((l24, 24), (l32, 32)):
        for arm in lm.ARMS:
            g = lm.longest(arm, gib * GiB, 1280, 720)
            assert f"{lm.ARM_LABELS[arm]} {g.frames} frames ({g.tokens:,} tokens)" in line, (arm, line)
    assert "measured there: prediction / measured longest SafeSage 1.00" in l24
    assert "(never measured: unverified)" in l32 and "measured there" not in l32
    model = next(ln for ln in lines if ln.startswith("length model (safe_ops/facts/length_model.json"))
    assert "held to 24 GiB free" in model and f"{FACT['arms']['safesage']['per_token_bytes']:,.0f} bytes" in model
    missing = next(ln for ln in lines if ln.startswith("length model does not model: "))
    for what in ("guider", "50-block", "8-block", "emulated on an H100", "other sizes than 1280x720", "0dd9b154"):
        assert what in missing, what
    assert "your 362 frames with SafeSage: predicted peak" in text and "WARNING: 362 frames" not in text


def test_preflight_on_a_gpu_assumes_its_free_memory_now_and_warns_past_the_longest():
    from safe_ops.facts.devices import Runtime
    from safe_ops.ui.preflight_text import preflight_report
    rtx = Runtime("2.13", "13.0", "NVIDIA GeForce RTX 5090", (12, 0), "2.2.0", "sage2_sm120_fp8pv", None,
                  "native", True, "0.30.0")
    r = preflight_report(1664, 960, 600, rt=rtx, free_bytes=28 * GiB, comfy_wants_sage=True)
    line = next(ln for ln in r["text"].splitlines() if ln.startswith("longest length predicted at 1664x960"))
    assert "for 28.0 GiB free (this GPU's free memory now)" in line and "32.0 GiB" not in r["text"]
    g = lm.longest("safesage", 28 * GiB, 1664, 960, scenario=r["verdicts"][0].scenario)
    assert g.frames < 600 and f"SafeSage {g.frames} frames" in line
    assert any(w.startswith("600 frames at 1664x960: SafeSage's step is predicted to need") and
               f"the longest predicted to fit is {g.frames} frames" in w for w in r["warnings"])
