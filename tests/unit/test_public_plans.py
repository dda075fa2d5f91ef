"""The public read of SafeAttention's plans (PlanChoice.prepared_plans / prepared_for / plan_now) that
bench/ and tools/ use instead of its private caches, and a scan that they read no private state."""
import re
from pathlib import Path

from test_attention import h3_like, make_attn, raw

ROOT = Path(__file__).resolve().parents[2]
PRIVATE = re.compile(r"\.(_prepared|_within_budget|_budget_reader|_key_alignment)\b")


def test_prepared_for_finds_the_plan_a_call_ran_and_plan_now_is_it():
    att, kern = make_attn()
    q, k, v = h3_like(300)
    assert att.prepared_plans() == [] and att.prepared_for(raw, q, k, v, 4, skip_reshape=True) is None
    att(raw, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    (p,) = att.prepared_plans()
    assert att.prepared_for(raw, q, k, v, 4, skip_reshape=True, skip_output_reshape=True) is p
    assert att.prepared_for(raw, q[:, :, :100], k, v, 4, skip_reshape=True, skip_output_reshape=True) is None
    assert att.plan_now(p) == p.plan and p.plan.kind != "sdpa" and kern.launches


def test_bench_and_tools_read_no_private_state_of_the_override():
    hits = [f"{f.relative_to(ROOT)}:{i}: {line.strip()}"
            for d in ("bench", "tools") for f in sorted((ROOT / d).rglob("*.py"))
            for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1) if PRIVATE.search(line)]
    assert len(list((ROOT / "bench").rglob("*.py"))) > 10          # the scan reads the files
    assert not hits, "\n".join(hits)
