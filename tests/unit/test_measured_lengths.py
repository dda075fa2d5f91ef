"""The Preflight node quotes the measured longest lengths (issue #40): safe_ops/facts/measured_lengths.json
must say what its committed source measured, and the report must carry it."""
import json
from pathlib import Path

from safe_ops.ui import preflight_text

REPO = Path(__file__).resolve().parents[2]
FACT = REPO / "safe_ops" / "facts" / "measured_lengths.json"


def test_the_fact_file_is_its_source():
    fact = json.loads(FACT.read_text())
    src = json.loads((REPO / fact["source"]).read_text())
    assert (fact["gpu"], fact["width"], fact["height"], fact["blocks"], fact["steps"]) == \
        (src["gpu"], src["width"], src["height"], src["blocks"], src["steps"])
    assert set(fact["budgets"]) == set(src["budgets"])
    for gib, arms in fact["budgets"].items():
        measured = src["budgets"][gib]["arms"]
        for arm, v in arms.items():
            assert measured[arm]["verified"] is True, (gib, arm)
            assert (v["max_frames"], v["max_tokens"]) == (measured[arm]["max_frames"], measured[arm]["max_tokens"])


def test_the_preflight_report_quotes_the_measured_table():
    fact = json.loads(FACT.read_text())
    lines = preflight_text.measured_length_lines()
    assert len(lines) == len(fact["budgets"])
    for gib, arms in fact["budgets"].items():
        line = next(ln for ln in lines if ln.startswith(f"measured longest at {gib} GiB free"))
        assert fact["gpu"] in line and fact["source"] in line
        for arm, label in preflight_text.MEASURED_ARMS:
            assert f"{label} {arms[arm]['max_frames']} frames" in line
