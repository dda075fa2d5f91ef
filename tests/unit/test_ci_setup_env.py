""".ci/setup_env.sh --torch-source: where the test venv's torch comes from (nothing is built)."""
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _source(**env_over):
    env = {k: v for k, v in os.environ.items() if k != "SAFESAGE_TORCH_PIP_ARGS"}
    env.update(env_over)
    r = subprocess.run(["bash", os.path.join(ROOT, ".ci", "setup_env.sh"), "--torch-source"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    return lines[0], lines[1:]


def test_torch_comes_from_pytorchs_cpu_index_by_default():
    # on plain PyPI torch==2.13.0 is the multi-GB CUDA build (issue 48 item 6)
    said, args = _source()
    assert args[:2] == ["--index-url", CPU_INDEX], args
    assert said.startswith("PyTorch's CPU wheel index " + CPU_INDEX), said
    # unreachable (a machine with a local mirror): no back-off on it, pip's configuration supplies torch
    assert args[2:] in ([], ["--retries", "0"]), args


def test_the_torch_source_is_overridable_as_the_demos():
    said, args = _source(SAFESAGE_TORCH_PIP_ARGS="--find-links /wheels --no-index")
    assert args == ["--find-links", "/wheels", "--no-index"]
    assert "SAFESAGE_TORCH_PIP_ARGS" in said
    # set empty: pip's own configuration decides
    said, args = _source(SAFESAGE_TORCH_PIP_ARGS="")
    assert args == []


def test_the_demo_and_the_ci_name_the_same_index():
    with open(os.path.join(ROOT, "tools", "demo.py")) as f:
        assert 'CPU_INDEX = "%s"' % CPU_INDEX in f.read()
