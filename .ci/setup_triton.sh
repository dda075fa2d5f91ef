#!/usr/bin/env bash
# Triton for the CPU test of the fused key-chunk merge (tests/unit/test_lse_merge.py runs the Triton
# kernel under TRITON_INTERPRET=1 in a child process). Installed with --target into the cache, NOT into
# the pass's venv: ComfyUI and the rest of the suite run without triton, as on a CPU-only user's machine.
#
#   bash .ci/setup_triton.sh PYTHON     prints `export SAFESAGE_TRITON_PATH=<dir>` on stdout
#
# triton 3.6.0 is the version on the GPU machine (torch 2.11). Idempotent; a failure exits non-zero with
# the reason on stderr (the test then skips, saying why).
set -euo pipefail
py=${1:?usage: setup_triton.sh PYTHON}
dest="$(bash "$(dirname "${BASH_SOURCE[0]}")/pip_target.sh" "$py" triton 3.6.0 --per-python)"
printf 'export SAFESAGE_TRITON_PATH=%q\n' "$dest"
