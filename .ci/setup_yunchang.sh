#!/usr/bin/env bash
# yunchang for the two-rank CPU test of SafeSage's sequence-parallel hook (tests/unit/test_multigpu_ranks.py
# runs yunchang's LongContextAttention over torch.distributed gloo in child processes). Installed with
# --target --no-deps into the cache, NOT into the pass's venv: yunchang needs only torch (the venv's,
# never reinstalled), and ComfyUI and the rest of the suite run without it. yunchang 0.6.4 is one
# 55 kB pure-Python wheel: about 1 s to install here. xFuser is not installed: it imports diffusers
# and friends (~37 MB more) and its long-context classes refuse a machine without CUDA at import.
#
#   bash .ci/setup_yunchang.sh PYTHON     prints `export SAFESAGE_YUNCHANG_PATH=<dir>` on stdout
#
# Idempotent; a failure exits non-zero with the reason on stderr (the test then skips, saying why).
set -euo pipefail
py=${1:?usage: setup_yunchang.sh PYTHON}
dest="$(bash "$(dirname "${BASH_SOURCE[0]}")/pip_target.sh" "$py" yunchang 0.6.4)"
printf 'export SAFESAGE_YUNCHANG_PATH=%q\n' "$dest"
