#!/usr/bin/env bash
# One package installed with `pip --target --no-deps` into the test cache, outside every venv (the
# shared step of .ci/setup_triton.sh and .ci/setup_yunchang.sh). Idempotent, one installer at a time
# (a lock per package); prints the folder on stdout, the reason of a failure on stderr (exit non-zero).
#
#   bash .ci/pip_target.sh PYTHON NAME VERSION [--per-python]
#
# --per-python: the folder is keyed on PYTHON's version and machine too (a package with compiled parts).
set -euo pipefail
py=${1:?usage: pip_target.sh PYTHON NAME VERSION [--per-python]}
name=${2:?usage: pip_target.sh PYTHON NAME VERSION [--per-python]}
version=${3:?usage: pip_target.sh PYTHON NAME VERSION [--per-python]}
cache_root="${SAFESAGE_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/safesage}"
dest="$cache_root/$name-$version"
if [[ "${4:-}" == --per-python ]]; then
    dest="$dest-$("$py" -c 'import sys, platform; print(f"cp{sys.version_info[0]}{sys.version_info[1]}-{platform.machine()}")')"
fi
mkdir -p "$cache_root"
exec 8>"$cache_root/.lock-$name"
if ! flock -n 8; then
    echo "[setup_$name] waiting for $cache_root/.lock-$name: another run is installing $name there" >&2
    flock 8
fi
if [[ ! -f "$dest/.safesage-complete" ]] || [[ ! -d "$dest/$name" ]]; then
    echo "[setup_$name] installing $name==$version (--no-deps) into $dest" >&2
    rm -rf "$dest"
    PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 "$py" -m pip install -q --no-deps --no-compile \
        --target "$dest" "$name==$version" 2>&1 | { grep -v "is neither a file nor a directory" || true; } >&2
    [[ -d "$dest/$name" ]] || { echo "[setup_$name] pip did not install $name into $dest" >&2; exit 1; }
    touch "$dest/.safesage-complete"
fi
echo "$dest"
