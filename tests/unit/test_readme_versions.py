"""README's Install states the versions as the code and CI have them (issue 48 items 2 and 3): the
declared minimum ComfyUI is pyproject.toml's, the versions table has a row for every ComfyUI CI tests
(its commits named), and the sageattention / comfy-kitchen versions are the ones the pack read."""
from __future__ import annotations

import re
from pathlib import Path

from safe_ops.families.ck_int8 import VERSION_RANGES
from safe_ops.families.sage_dispatch import SAGE_VERSIONS

REPO = Path(__file__).resolve().parents[2]


def _readme() -> str:
    return re.sub(r"\s+", " ", (REPO / "README.md").read_text())


def _install() -> str:
    text = (REPO / "README.md").read_text()
    return text[text.index("## Install"):text.index("\n## ", text.index("## Install") + 1)]


def declared_minimum() -> str:
    m = re.search(r'^"requires-comfyui" = ">=([0-9.]+)"$', (REPO / "pyproject.toml").read_text(), re.M)
    assert m, "pyproject.toml declares no requires-comfyui minimum"
    return m.group(1)


def ci_passes() -> tuple[str, list[str]]:
    """(the PyPI ComfyUI version of the first pass, the commits of the tree passes) from .ci/setup_env.sh."""
    env = (REPO / ".ci" / "setup_env.sh").read_text()
    version = re.search(r"^COMFY_VERSION=([0-9.]+)$", env, re.M).group(1)
    trees = re.search(r"^TREE_PASSES=\((.*?)^\)", env, re.M | re.S).group(1)
    return version, re.findall(r'^\s*"([0-9a-f]{8}) ', trees, re.M)


def test_readme_and_pyproject_declare_the_same_minimum():
    minimum = declared_minimum()
    assert minimum == "0.30.0"          # the first tested ComfyUI that runs the quick start (0dd9b154)
    assert f"**Needs ComfyUI {minimum} or later**" in _readme()
    assert "0.3.75 or later" not in _readme()


def test_the_versions_table_has_a_row_per_ci_pass():
    version, commits = ci_passes()
    assert commits == ["0dd9b154", "783545f6"], commits
    rows = [line for line in _install().splitlines() if line.startswith("| ")]
    header = rows[0]
    for column in ("attention guarded", "H3 MLP chunked", "`--use-ck-attention`", "templates that run",
                   "how it is tested"):
        assert column in header, column
    first = [r.split("|")[1] for r in rows[2:]]
    assert any(c.strip().startswith(version) for c in first), first
    for commit in commits:
        (row,) = [r for r in rows if f"`{commit}`" in r.split("|")[1]]
        assert "CI, every change" in row, row
    assert any("read only" in r for r in rows)


def test_install_names_the_read_sage_and_kitchen_versions():
    install = re.sub(r"\s+", " ", _install())
    for ver in SAGE_VERSIONS:
        assert ver in install, ver
    for rng in VERSION_RANGES.values():
        assert rng in install, rng
    assert "**Without sageattention**" in install and "**Without it**" in install
    assert "Without it every attention call runs ComfyUI's own attention" not in install
