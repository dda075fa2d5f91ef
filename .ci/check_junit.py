"""CI guard, run by .ci/run after each pass's pytest: the tests that matter must really have run.

A conftest hook elsewhere, a broken fixture or a missing COMFYUI_PATH can turn every test in
tests/comfy into a skip, and pytest still exits 0. Fail then, printing why they were skipped.

* every pass: the headless-ComfyUI tests (tests/comfy) ran, at least MIN_COMFY_PASSED passed,
  and the only skips there are the MiniMax H3 ones (expected on trees without H3, e.g. 0.3.75);
* --require-h3 (the tree passes 0dd9b154 and 783545f6, or any tree with
  comfy/ldm/minimax/model.py): no skip at all in tests/comfy, and the H3 modules (H3_MODULES)
  each ran and passed at least their minimum -- a skip there, for any reason, fails the run.
* --require-browser (the default when CI=true): the browser tests (tests/browser) ran, at least
  MIN_BROWSER_PASSED passed, and none was skipped except, on a tree without H3, for MiniMax H3 -- so a
  browser that could not be installed or started fails CI instead of leaving it green. Without it
  (a developer's machine) those skips are allowed, and listed with their reasons.

Prints "pass NAME: N passed, N failed, N skipped" for every pass.

usage: python .ci/check_junit.py --pass NAME [--require-h3] [--require-browser] [--counts-only] JUNIT_XML
       python .ci/check_junit.py --total JUNIT_XML...   (prints "total: N passed, N failed, N skipped")
"""

import argparse
import os
import sys
import xml.etree.ElementTree as ET

MIN_COMFY_PASSED = 5
MIN_BROWSER_PASSED = 1
BROWSER = "tests.browser."
#: module -> fewest tests that must pass there with --require-h3
H3_MODULES = {
    "tests.comfy.test_comfy_h3": 3,
    "tests.unit.test_mlp_comfy": 20,
    "tests.unit.test_h3_comfy": 1,
}


def _cases(path):
    for case in ET.parse(path).getroot().iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        # a module-level skip is reported with an empty classname and the module as the name
        test_id = "%s.%s" % (cls, name) if cls else name
        if case.find("failure") is not None or case.find("error") is not None:
            outcome, reason = "failed", ""
        elif case.find("skipped") is not None:
            outcome, reason = "skipped", case.find("skipped").get("message", "")
        else:
            outcome, reason = "passed", ""
        yield test_id, outcome, reason


def counts(paths):
    c = {"passed": 0, "failed": 0, "skipped": 0}
    for path in paths:
        for _id, outcome, _reason in _cases(path):
            c[outcome] += 1
    return c


def _line(c):
    return "%d passed, %d failed, %d skipped" % (c["passed"], c["failed"], c["skipped"])


def browser_skips(path, require_h3):
    """(test id, reason) of the browser tests skipped for another reason than a tree without H3."""
    return [(test_id, reason) for test_id, outcome, reason in _cases(path)
            if outcome == "skipped" and (test_id + ".").startswith(BROWSER)
            and (require_h3 or "MiniMax H3" not in reason)]


def check(path, require_h3, require_browser=False):
    """Problems (strings); empty when the run is acceptable."""
    problems = []
    if require_browser:
        for test_id, reason in browser_skips(path, require_h3):
            problems.append("%s skipped: %s" % (test_id, reason))
        browser_passed = sum(1 for test_id, outcome, _r in _cases(path)
                             if outcome == "passed" and test_id.startswith(BROWSER))
        if browser_passed < MIN_BROWSER_PASSED:
            problems.append("only %d browser tests (tests/browser) passed (need %d)"
                            % (browser_passed, MIN_BROWSER_PASSED))
    comfy_passed = 0
    h3_passed = dict.fromkeys(H3_MODULES, 0)
    for test_id, outcome, reason in _cases(path):
        module = next((m for m in H3_MODULES if test_id == m or test_id.startswith(m + ".")), None)
        if module is not None and outcome == "passed":
            h3_passed[module] += 1
        if outcome == "skipped" and (module is not None and require_h3):
            problems.append("%s skipped: %s" % (test_id, reason))
        elif test_id.startswith("tests.comfy."):
            if outcome == "passed":
                comfy_passed += 1
            elif outcome == "skipped" and (require_h3 or "MiniMax H3" not in reason):
                problems.append("%s skipped: %s" % (test_id, reason))
    if comfy_passed < MIN_COMFY_PASSED:
        problems.append("only %d headless ComfyUI tests passed (need %d)" % (comfy_passed, MIN_COMFY_PASSED))
    if require_h3:
        for module, least in H3_MODULES.items():
            if h3_passed[module] < least:
                problems.append("only %d tests of %s passed (need %d): the MiniMax H3 tests did not run"
                                % (h3_passed[module], module, least))
    return problems


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pass", dest="pass_name", default="?")
    ap.add_argument("--require-h3", action="store_true")
    ap.add_argument("--require-browser", action="store_true", default=os.environ.get("CI") == "true",
                    help="no browser test may skip (default when CI=true)")
    ap.add_argument("--counts-only", action="store_true", help="print the counts, check nothing")
    ap.add_argument("--total", action="store_true", help="sum the counts of several junit files")
    ap.add_argument("junit", nargs="+")
    a = ap.parse_args(argv)
    if a.total:
        print("total: " + _line(counts(a.junit)))
        return 0
    path, = a.junit
    print("[.ci/run] pass %s: %s" % (a.pass_name, _line(counts([path]))), file=sys.stderr)
    if a.counts_only:
        return 0
    problems = check(path, a.require_h3, a.require_browser)
    if not a.require_browser:
        skipped = browser_skips(path, a.require_h3)
        if skipped:
            print("[.ci/run] pass %s: %d browser tests skipped (allowed here; with CI=true this fails the run):"
                  % (a.pass_name, len(skipped)), file=sys.stderr)
            for test_id, reason in skipped[:5]:
                print("  %s: %s" % (test_id, reason), file=sys.stderr)
    if problems:
        print("[.ci/run] FAILED (pass %s): the tests that must run here did not:" % a.pass_name, file=sys.stderr)
        for line in problems[:20]:
            print("  " + line, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
