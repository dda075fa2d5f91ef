"""Every result file that README.md and docs/ cite is committed: a number in the docs must point at a
JSON or log that exists (a renamed or forgotten result would leave a claim without its source)."""
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CITE = re.compile(r"bench/results/[A-Za-z0-9_./*-]*[A-Za-z0-9_/*]")


def _cited():
    out = set()
    for doc in ["README.md", *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]:
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            out |= {(os.path.basename(doc), m) for m in CITE.findall(f.read())}
    return out


def test_docs_cite_results():
    cited = _cited()
    assert len(cited) > 20  # the docs cite their results; an empty match would make this test pass vacuously
    missing = sorted((doc, p) for doc, p in cited if not glob.glob(os.path.join(ROOT, p)))
    assert not missing, f"cited but not committed: {missing}"


def test_readme_numbers_cite_results():
    """The README's measured summary names its result files itself (not only through docs/)."""
    readme = {p for doc, p in _cited() if doc == "README.md"}
    assert len(readme) >= 3, readme
