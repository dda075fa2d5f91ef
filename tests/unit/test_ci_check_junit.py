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
