""".ci/check_junit.py on synthetic junit files: what each CI pass accepts and rejects."""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("check_junit", os.path.join(ROOT, ".ci", "check_junit.py"))
cj = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cj)

H3_SKIP = "COMFYUI_PATH=/x has no MiniMax H3 (comfy/ldm/minimax/model.py)"


def _case(cls, name, outcome="passed", reason=""):
    body = {"passed": "", "failed": '<failure message="boom"/>',
            "skipped": '<skipped type="pytest.skip" message="%s"/>' % reason}[outcome]
    return '<testcase classname="%s" name="%s">%s</testcase>' % (cls, name, body)


def _junit(tmp_path, cases, name="j.xml"):
    p = tmp_path / name
    p.write_text('<?xml version="1.0"?><testsuites><testsuite name="t">%s</testsuite></testsuites>'
                 % "".join(cases))
    return str(p)


def _comfy_ok(n=5):
    return [_case("tests.comfy.test_comfy_node", "test_%d" % i) for i in range(n)]


def _h3(outcome, reason=""):
    """As many cases of every required H3 module as check_junit asks for."""
    return [_case(module, "test_%d" % i, outcome, reason)
            for module, least in cj.H3_MODULES.items() for i in range(least)]


def test_0375_pass_accepts_h3_skips_only(tmp_path):
    ok = _junit(tmp_path, _comfy_ok() + _h3("skipped", H3_SKIP))
    assert cj.check(ok, require_h3=False) == []
    other = _junit(tmp_path, _comfy_ok() + [_case("tests.comfy.test_comfy_node", "t", "skipped", "no server")], "o.xml")
    (problem,) = cj.check(other, require_h3=False)
    assert "no server" in problem


def test_0dd9_pass_rejects_any_h3_skip(tmp_path):
    skipped = _junit(tmp_path, _comfy_ok() + _h3("skipped", H3_SKIP))
    problems = cj.check(skipped, require_h3=True)
    assert any("test_comfy_h3" in p and "MiniMax H3" in p for p in problems)
    assert any("only 0 tests of tests.unit.test_mlp_comfy passed" in p for p in problems)
    ran = _junit(tmp_path, _comfy_ok() + _h3("passed"), "r.xml")
    assert cj.check(ran, require_h3=True) == []


def test_module_level_skip_of_the_mlp_tests_is_caught(tmp_path):
    # pytest reports a module-level skip as one case with an empty classname
    cases = _comfy_ok() + [c for c in _h3("passed") if "test_mlp_comfy" not in c] \
        + [_case("", "tests.unit.test_mlp_comfy", "skipped", "no comfy")]
    problems = cj.check(_junit(tmp_path, cases), require_h3=True)
    assert any("tests.unit.test_mlp_comfy skipped: no comfy" in p for p in problems)


def test_too_few_comfy_tests(tmp_path):
    (problem,) = cj.check(_junit(tmp_path, _comfy_ok(2)), require_h3=False)
    assert "only 2 headless ComfyUI tests passed" in problem


def test_counts_and_total_line(tmp_path, capsys):
    a = _junit(tmp_path, _comfy_ok(3) + [_case("tests.unit.x", "f", "failed")], "a.xml")
    b = _junit(tmp_path, [_case("tests.gpu.g", "s", "skipped", "no CUDA")], "b.xml")
    assert cj.counts([a]) == {"passed": 3, "failed": 1, "skipped": 0}
    assert cj.main(["--total", a, b]) == 0
    assert capsys.readouterr().out.strip() == "total: 3 passed, 1 failed, 1 skipped"
    assert cj.main(["--pass", "x", "--counts-only", a]) == 0
    assert cj.main(["--pass", "x", a]) == 1


@pytest.mark.parametrize("require_h3", [False, True])
def test_failed_h3_tests_do_not_count_as_run(tmp_path, require_h3):
    cases = _comfy_ok() + _h3("failed")
    problems = cj.check(_junit(tmp_path, cases), require_h3=require_h3)
    assert bool(problems) == require_h3


# ------------------------------------------------------------------ browser tests with CI=true
NO_CHROMIUM = "no chromium at /usr/bin/chromium: install it with bash .ci/setup_browser.sh (Debian package chromium)"
H3_BROWSER_SKIP = "COMFYUI_PATH=/x has no MiniMax H3: the quality guard's browser test needs a ComfyUI with H3"


def _browser(outcome, reason="", n=2):
    return [_case("tests.browser.test_browser_frontend", "test_%d" % i, outcome, reason) for i in range(n)]


def test_browser_skip_fails_with_require_browser_and_names_the_reason(tmp_path):
    path = _junit(tmp_path, _comfy_ok() + _browser("skipped", NO_CHROMIUM))
    assert cj.check(path, require_h3=False) == []                       # a developer's machine: allowed
    problems = cj.check(path, require_h3=False, require_browser=True)
    assert sum("tests.browser.test_browser_frontend.test_" in p and "no chromium" in p for p in problems) == 2
    assert any("only 0 browser tests (tests/browser) passed" in p for p in problems)


def test_browser_module_skipped_or_absent_fails_with_require_browser(tmp_path):
    module_skip = _junit(tmp_path, _comfy_ok() + [_case("", "tests.browser.test_browser_quality", "skipped", NO_CHROMIUM)]
                         + _browser("passed"), "m.xml")
    assert any("tests.browser.test_browser_quality skipped: no chromium" in p
               for p in cj.check(module_skip, require_h3=False, require_browser=True))
    none_ran = _junit(tmp_path, _comfy_ok(), "n.xml")
    assert cj.check(none_ran, require_h3=False, require_browser=True) == [
        "only 0 browser tests (tests/browser) passed (need %d)" % cj.MIN_BROWSER_PASSED]


def test_browser_h3_skip_is_allowed_only_on_a_tree_without_h3(tmp_path):
    path = _junit(tmp_path, _comfy_ok() + _h3("passed") + _browser("passed")
                  + [_case("tests.browser.test_browser_quality", "test_q", "skipped", H3_BROWSER_SKIP)])
    assert cj.check(path, require_h3=False, require_browser=True) == []
    (problem,) = cj.check(path, require_h3=True, require_browser=True)
    assert problem.startswith("tests.browser.test_browser_quality.test_q skipped: ")
    ok = _junit(tmp_path, _comfy_ok() + _h3("passed") + _browser("passed"), "ok.xml")
    assert cj.check(ok, require_h3=True, require_browser=True) == []


def test_ci_true_makes_browser_skips_fail_the_pass_locally_they_are_listed(tmp_path, monkeypatch, capsys):
    """What .ci/run runs after each pass: `check_junit.py --pass NAME [--require-h3] JUNIT`, with CI
    from the environment -- CI=true fails on a skipped browser test, else the skip is listed with its reason."""
    path = _junit(tmp_path, _comfy_ok() + _browser("skipped", NO_CHROMIUM))
    monkeypatch.delenv("CI", raising=False)
    assert cj.main(["--pass", "0.3.75", path]) == 0
    err = capsys.readouterr().err
    assert "2 browser tests skipped (allowed here; with CI=true this fails the run)" in err and "no chromium" in err
    monkeypatch.setenv("CI", "true")
    assert cj.main(["--pass", "0.3.75", path]) == 1
    err = capsys.readouterr().err
    assert "FAILED (pass 0.3.75)" in err and "no chromium" in err
    ran = _junit(tmp_path, _comfy_ok() + _browser("passed"), "ran.xml")
    assert cj.main(["--pass", "0.3.75", ran]) == 0
