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
version=0.6.4
cache_root="${SAFESAGE_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/safesage}"
dest="$cache_root/yunchang-$version"
mkdir -p "$cache_root"
exec 8>"$cache_root/.lock-yunchang"
if ! flock -n 8; then
    echo "[setup_yunchang] waiting for $cache_root/.lock-yunchang: another run is installing yunchang there" >&2
    flock 8
fi
if [[ ! -f "$dest/.safesage-complete" ]] || [[ ! -d "$dest/yunchang" ]]; then
    echo "[setup_yunchang] installing yunchang==$version (--no-deps) into $dest" >&2
    rm -rf "$dest"
    PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 "$py" -m pip install -q --no-deps --no-compile \
        --target "$dest" "yunchang==$version" 2>&1 | { grep -v "is neither a file nor a directory" || true; } >&2
    [[ -d "$dest/yunchang" ]] || { echo "[setup_yunchang] pip did not install yunchang into $dest" >&2; exit 1; }
    touch "$dest/.safesage-complete"
fi
printf 'export SAFESAGE_YUNCHANG_PATH=%q\n' "$dest"
