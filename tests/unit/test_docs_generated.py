"""docs/BENCHMARKS.md is what bench/common/tables.py makes of the committed JSON, and every source the
kernel table cites is a committed result file: a number in the docs always points to a JSON."""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_benchmarks_doc_is_generated_from_the_results(bench_tables):
    want = bench_tables.render()
    got = (REPO / "docs" / "BENCHMARKS.md").read_text()
    assert got == want, "docs/BENCHMARKS.md is stale: run `python -m bench.common.tables` and commit it"


def test_every_result_section_has_its_json_and_command(bench_tables):
    t = bench_tables
    for name, _ in t.SECTIONS:
        path = REPO / "bench" / "results" / name
        assert path.exists(), f"tables.py renders {name}, which is not committed"
        d = json.loads(path.read_text())
        command = d.get("command") or d.get("env", {}).get("command")
        # a script (python bench/x.py) or a package (python -m bench.repro)
        assert command and re.search(r"\bbench[/.]\w", command), f"{name} does not record the command that made it"


def test_kernel_table_sources_are_committed_results():
    table = json.loads((REPO / "safe_ops" / "facts" / "kernel_table.json").read_text())
    for arch, entry in table["archs"].items():
        cited = re.findall(r"(bench/results/[\w.-]+\.json)", entry["source"])
        assert cited, f"{arch}: the kernel table names no result file"
        for c in cited:
            assert (REPO / c).exists(), f"{arch}: {c} is cited but not committed"
        # every family's number comes from a file that measured it
        measured = set()
        for c in cited:
            d = json.loads((REPO / c).read_text())
            fam = d.get("sections", {}).get("families", {}).get("kernel_table_tflops", {})
            measured |= set(fam)
            for row in d.get("rows", []):
                measured |= set(row.get("tflops", {}))
        assert set(entry["tflops"]) <= measured, (arch, set(entry["tflops"]) - measured)
