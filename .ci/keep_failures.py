"""After a failed `.ci/run`: keep in its work folder only what a failure needs.

    python3 .ci/keep_failures.py WORK

WORK holds, per pass NAME, junit-NAME.xml, result-NAME and tmp-NAME/ (pytest's --basetemp: one folder
per test that asked for tmp_path, one per tmp_path_factory.mktemp of a fixture, with the tiny models,
ComfyUI base folders and outputs -- about 0.6 GiB a pass). Kept: the junit and result files, the whole
folder of every failing test (pytest names it after the test: non-word characters -> "_", the first 30
characters, a number), and every *.log file elsewhere (the headless servers' logs live in fixture
folders). Everything else is deleted. Prints one line: what is kept and its size.
"""
from __future__ import annotations

import os
import re
import sys
import xml.etree.ElementTree as ET

MAXVAL = 30   # pytest's tmp_path: request.node.name, non-word characters replaced, cut to 30


def failing_names(junit: str) -> set[str]:
    """The node names (``test_x[param]``) of the failed and errored test cases of one junit file."""
    names = set()
    for case in ET.parse(junit).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            names.add(case.get("name", ""))
    return names


def tmp_prefix(node_name: str) -> str:
    """The folder name pytest gives a test's tmp_path, less its number."""
    return re.sub(r"[\W]", "_", node_name)[:MAXVAL]


def is_failing_folder(folder: str, prefixes: set[str]) -> bool:
    m = re.fullmatch(r"(.*?)(\d+)", folder)
    return bool(m) and m.group(1) in prefixes


def _size(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            if not os.path.islink(p):
                total += os.path.getsize(p)
    return total


def _prune_keeping_logs(path: str) -> None:
    """Delete every file under ``path`` but *.log ones, then the folders left empty."""
    for root, dirs, files in os.walk(path, topdown=False):
        for f in files:
            p = os.path.join(root, f)
            if os.path.islink(p) or not f.endswith(".log"):
                os.remove(p)
        for d in dirs:
            p = os.path.join(root, d)
            if os.path.islink(p):
                os.remove(p)
            elif not os.listdir(p):
                os.rmdir(p)
    if os.path.isdir(path) and not os.listdir(path):
        os.rmdir(path)


def prune(work: str) -> dict:
    """Prune WORK in place; returns {"kept_bytes", "failing_folders"}."""
    kept_folders = []
    for entry in sorted(os.listdir(work)):
        m = re.fullmatch(r"tmp-(.+)", entry)
        base = os.path.join(work, entry)
        if not m or not os.path.isdir(base) or os.path.islink(base):
            continue
        junit = os.path.join(work, "junit-%s.xml" % m.group(1))
        prefixes = {tmp_prefix(n) for n in failing_names(junit)} if os.path.isfile(junit) else set()
        for folder in sorted(os.listdir(base)):
            p = os.path.join(base, folder)
            if os.path.islink(p):              # pytest's "<name>current" links
                os.remove(p)
            elif os.path.isdir(p) and is_failing_folder(folder, prefixes):
                kept_folders.append(os.path.join(entry, folder))
            elif os.path.isdir(p):
                _prune_keeping_logs(p)
            elif not folder.endswith(".log"):
                os.remove(p)
    return {"kept_bytes": _size(work), "failing_folders": kept_folders}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not os.path.isdir(argv[0]):
        print("usage: keep_failures.py WORK", file=sys.stderr)
        return 2
    r = prune(argv[0])
    print("[.ci/run] kept in %s: %.1f MiB (junit files, %d failing tests' folders, the server logs)"
          % (argv[0], r["kept_bytes"] / 2 ** 20, len(r["failing_folders"])), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
