""".ci/keep_failures.py on a synthetic failed run: what a failed `.ci/run` leaves in its work folder."""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("keep_failures", os.path.join(ROOT, ".ci", "keep_failures.py"))
kf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kf)


def _write(path, data=b"x" * 1000):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def _junit(path, failed, passed):
    cases = ['<testcase classname="tests.m" name="%s"><failure message="boom"/></testcase>' % n for n in failed]
    cases += ['<testcase classname="tests.m" name="%s"/>' % n for n in passed]
    _write(path, ('<?xml version="1.0"?><testsuites><testsuite name="t">%s</testsuite></testsuites>'
                  % "".join(cases)).encode())


def _failed_run(tmp_path):
    work = str(tmp_path / "safesage-pytest.X")
    long_name = "test_verdicts_per_arch_a_failure_on_one_does_not_switch[build]"
    _junit(os.path.join(work, "junit-0dd9b154.xml"), failed=["test_pack_loaded_cleanly", long_name],
           passed=["test_ok"])
    _write(os.path.join(work, "result-0dd9b154"), b"failed\n")
    t = os.path.join(work, "tmp-0dd9b154")
    _write(os.path.join(t, "comfy_base0", "models", "tiny.safetensors"), b"m" * 100_000)
    _write(os.path.join(t, "comfy_base0", "comfy-server.log"), b"log line\n")
    _write(os.path.join(t, "test_ok0", "out.bin"), b"o" * 50_000)
    _write(os.path.join(t, "test_pack_loaded_cleanly0", "evidence.txt"), b"e" * 10)
    # pytest cuts the folder name to 30 characters of the node name, non-word characters -> "_"
    _write(os.path.join(t, kf.tmp_prefix(long_name) + "1", "a.bin"), b"a" * 20)
    os.symlink(os.path.join(t, "test_ok0"), os.path.join(t, "test_okcurrent"))
    # a pass that passed keeps only its junit and logs
    _junit(os.path.join(work, "junit-0.3.75.xml"), failed=[], passed=["test_ok"])
    _write(os.path.join(work, "tmp-0.3.75", "test_ok0", "big.bin"), b"b" * 100_000)
    return work, long_name


def _files(work):
    return sorted(os.path.relpath(os.path.join(r, f), work) for r, _d, fs in os.walk(work) for f in fs)


def test_a_failed_run_keeps_junits_failing_tests_folders_and_logs_only(tmp_path):
    work, long_name = _failed_run(tmp_path)
    r = kf.prune(work)
    assert _files(work) == sorted([
        "junit-0.3.75.xml", "junit-0dd9b154.xml", "result-0dd9b154",
        "tmp-0dd9b154/comfy_base0/comfy-server.log",
        "tmp-0dd9b154/test_pack_loaded_cleanly0/evidence.txt",
        "tmp-0dd9b154/%s1/a.bin" % kf.tmp_prefix(long_name),
    ])
    assert not os.path.lexists(os.path.join(work, "tmp-0dd9b154", "test_okcurrent"))
    assert r["kept_bytes"] == sum(os.path.getsize(os.path.join(work, f)) for f in _files(work))
    assert r["kept_bytes"] < 5_000
    assert len(r["failing_folders"]) == 2


def test_the_folder_name_is_pytests():
    assert kf.tmp_prefix("test_x[arch-1]") == "test_x_arch_1_"
    assert len(kf.tmp_prefix("t" * 80)) == 30
    # a passing test whose name starts like a failing one's is not kept
    assert not kf.is_failing_folder("test_pack_loaded_cleanly_more0", {"test_pack_loaded_cleanly"})
    assert kf.is_failing_folder("test_pack_loaded_cleanly12", {"test_pack_loaded_cleanly"})
