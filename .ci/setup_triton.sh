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
version=3.6.0
cache_root="${SAFESAGE_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/safesage}"
tag="$("$py" -c 'import sys, platform; print(f"cp{sys.version_info[0]}{sys.version_info[1]}-{platform.machine()}")')"
dest="$cache_root/triton-$version-$tag"
mkdir -p "$cache_root"
exec 8>"$cache_root/.lock-triton"
if ! flock -n 8; then
    echo "[setup_triton] waiting for $cache_root/.lock-triton: another run is installing triton there" >&2
    flock 8
fi
if [[ ! -f "$dest/.safesage-complete" ]] || [[ ! -d "$dest/triton" ]]; then
    echo "[setup_triton] installing triton==$version into $dest" >&2
    rm -rf "$dest"
    PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 "$py" -m pip install -q --no-deps --no-compile \
        --target "$dest" "triton==$version" >&2
    touch "$dest/.safesage-complete"
fi
printf 'export SAFESAGE_TRITON_PATH=%q\n' "$dest"
