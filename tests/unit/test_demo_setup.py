"""tools/demo.py on a machine without torch: it says what it installs (pin, index, size) before it
installs anything, takes the CPU wheel index unless SAFESAGE_TORCH_PIP_ARGS says otherwise, and never
falls back to an unpinned torch. pip is stubbed here (nothing is downloaded); the demo's own output
carries no NumPy warning and no "16-bit" label, and labels each kernel family with who runs it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("tools_demo", os.path.join(ROOT, "tools", "demo.py"))
demo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(demo)


@pytest.fixture
def bare(monkeypatch, tmp_path):
    """This Python 'has no torch'; venv creation and pip are recorded, in order with what is printed."""
    events = []
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(demo.importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real_find_spec(name, *a))
    monkeypatch.setattr(demo.subprocess, "call", lambda cmd, **kw: events.append(("call", cmd)) or 1)

    def check_call(cmd, **kw):
        events.append(("check_call", cmd))
        if getattr(check_call, "fail", False) and "pip" in cmd:
            raise subprocess.CalledProcessError(1, cmd)
        return 0
    monkeypatch.setattr(demo.subprocess, "check_call", check_call)
    real_print = print

    def printed(*args, **kw):
        events.append(("print", " ".join(str(a) for a in args)))
        real_print(*args, **kw)
    monkeypatch.setattr(demo, "print", printed, raising=False)
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    return events, env, check_call


def _pip_calls(events):
    return [cmd for kind, cmd in events if kind == "check_call" and "pip" in cmd]


def test_default_announces_pin_cpu_index_and_size_before_installing_from_the_cpu_index(bare):
    events, env, _ = bare
    py = demo.demo_python(env)
    assert py == os.path.join(env["XDG_CACHE_HOME"], "safesage", "demo-venv", "bin", "python")
    (pip,) = _pip_calls(events)
    assert pip == [py, "-m", "pip", "install", "-q", "--index-url", "https://download.pytorch.org/whl/cpu",
                   "torch==2.13.0"]
    first_install = next(i for i, (kind, _c) in enumerate(events) if kind == "check_call")
    said = " ".join(text for kind, text in events[:first_install] if kind == "print")
    for needed in ("torch==2.13.0", "https://download.pytorch.org/whl/cpu", "about 200 MB to download",
                   "0.9 GB installed", "SAFESAGE_TORCH_PIP_ARGS", "CPU build"):
        assert needed in said, (needed, said)


def test_pip_args_from_the_environment_replace_the_index(bare):
    events, env, _ = bare
    env["SAFESAGE_TORCH_PIP_ARGS"] = "--find-links /opt/wheels --no-index"
    demo.demo_python(env)
    (pip,) = _pip_calls(events)
    assert pip[-4:] == ["--find-links", "/opt/wheels", "--no-index", "torch==2.13.0"]
    assert "--index-url" not in pip
    said = " ".join(text for kind, text in events if kind == "print")
    assert "SAFESAGE_TORCH_PIP_ARGS='--find-links /opt/wheels --no-index'" in said


def test_empty_pip_args_leave_the_index_to_pips_configuration(bare):
    events, env, _ = bare
    env["SAFESAGE_TORCH_PIP_ARGS"] = ""
    demo.demo_python(env)
    (pip,) = _pip_calls(events)
    assert pip[-2:] == ["-q", "torch==2.13.0"]
    assert "pip's own configuration" in " ".join(text for kind, text in events if kind == "print")


def test_a_failed_install_stops_with_what_to_do_and_never_installs_an_unpinned_torch(bare):
    events, env, check_call = bare
    check_call.fail = True
    with pytest.raises(SystemExit) as e:
        demo.demo_python(env)
    assert "SAFESAGE_TORCH_PIP_ARGS" in str(e.value) and "-m safe_ops.demo" in str(e.value)
    assert len(_pip_calls(events)) == 1


def test_demo_output_has_no_numpy_warning_and_no_16_bit_label():
    """A torch without NumPy (the demo venv's) warns at import; the demo's label names the index width."""
    code = ("import runpy, sys; sys.modules['numpy'] = None; sys.argv = ['demo', '--device', 'cpu'];"
            "runpy.run_module('safe_ops.demo', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "all checks passed" in r.stdout
    assert "NumPy" not in r.stderr, r.stderr
    assert "16-bit" not in r.stdout and "int16" in r.stdout, r.stdout
    assert "quality guard is off" not in r.stdout + r.stderr, r.stdout + r.stderr
    # every kernel family row of the reporter's graph is labelled with the GPUs and versions that run it,
    # in Preflight's words (registry.family_users)
    from safe_ops.families.registry import family_users
    lines = r.stdout.splitlines()
    rows = [i for i, line in enumerate(lines) if line.startswith("- ")]
    assert len(rows) >= 9, r.stdout
    for i in rows:
        fam = lines[i][2:].split(":")[0]
        assert lines[i + 1] == "    used by: " + family_users(fam), (lines[i], lines[i + 1])
