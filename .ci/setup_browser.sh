#!/usr/bin/env bash
# Browser-test prerequisites for tests/browser (idempotent; safe to run on every CI run).
#
#   bash .ci/setup_browser.sh "$SAFESAGE_PYTHON"
#
# 1. Debian's chromium (/usr/bin/chromium), if absent: apt-get update + apt-get install.
#    Playwright never downloads a browser here: the tests launch this executable.
# 2. playwright (Python package only) and comfyui-frontend-package into the given venv,
#    constrained to the venv's torch pin ($venv/constraints.txt, written by setup_env.sh).
#    The frontend version is the one the ComfyUI tree under test pins in its requirements.txt
#    ($COMFYUI_PATH), else 1.48.6 (what ComfyUI 0dd9b154 pins).
#
# Exit status 0 when everything is in place. A failure here must not fail the whole CI run:
# the browser tests skip with the reason printed when chromium or playwright is missing, so
# the caller may ignore a non-zero exit (it prints why).
set -uo pipefail

py="${1:-${SAFESAGE_PYTHON:-}}"
[[ -n "$py" && -x "$py" ]] || { echo "[setup_browser] usage: bash .ci/setup_browser.sh <venv python>" >&2; exit 2; }
venv="$(cd "$(dirname "$py")/.." && pwd)"
PLAYWRIGHT_VERSION=1.65.2
FRONTEND_DEFAULT=1.48.6
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_PROGRESS_BAR=off
log() { printf '[setup_browser %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
t0=$SECONDS
rc=0

# ------------------------------------------------------------------ chromium (Debian)
if [[ -x /usr/bin/chromium ]]; then
    log "chromium present: $(/usr/bin/chromium --version 2>/dev/null | head -1)"
elif command -v apt-get >/dev/null 2>&1 && [[ "$(id -u)" == 0 ]]; then
    log "installing chromium from Debian (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt_log="$(mktemp "${TMPDIR:-/tmp}/setup_browser_apt.XXXXXX")"
    if apt-get update -qq >"$apt_log" 2>&1 \
            && apt-get install -y -qq --no-install-recommends chromium >>"$apt_log" 2>&1; then
        log "chromium installed: $(/usr/bin/chromium --version 2>/dev/null | head -1)"
    else
        tail -n 20 "$apt_log" >&2
        log "WARNING: apt-get could not install chromium; the browser tests will skip"
        rc=1
    fi
    rm -f "$apt_log"
else
    log "WARNING: no /usr/bin/chromium and no root apt-get; the browser tests will skip"
    rc=1
fi

# ------------------------------------------------------------------ python packages
frontend="$FRONTEND_DEFAULT"
if [[ -n "${COMFYUI_PATH:-}" && -f "$COMFYUI_PATH/requirements.txt" ]]; then
    pinned="$(sed -n 's/^comfyui-frontend-package==\([0-9.]*\).*/\1/p' "$COMFYUI_PATH/requirements.txt" | head -1)"
    [[ -n "$pinned" ]] && frontend="$pinned"
fi
have() {
    "$py" - "$1" "$2" <<'EOF' 2>/dev/null
import importlib.metadata as m, sys
sys.exit(0 if m.version(sys.argv[1]) == sys.argv[2] else 1)
EOF
}
want=()
have playwright "$PLAYWRIGHT_VERSION" || want+=("playwright==$PLAYWRIGHT_VERSION")
have comfyui-frontend-package "$frontend" || want+=("comfyui-frontend-package==$frontend")
if [[ ${#want[@]} -eq 0 ]]; then
    log "venv already has playwright $PLAYWRIGHT_VERSION and comfyui-frontend-package $frontend"
else
    cons=()
    [[ -f "$venv/constraints.txt" ]] && cons=(-c "$venv/constraints.txt")
    log "pip install ${want[*]} into $venv"
    if ! "$py" -m pip install -q "${cons[@]}" "${want[@]}" 2>&1 \
            | { grep -v "is neither a file nor a directory" || true; } >&2; then
        log "WARNING: pip install failed; the browser tests will skip"
        rc=1
    fi
    "$py" -c "import playwright.sync_api, comfyui_frontend_package" 2>/dev/null \
        || { log "WARNING: playwright / comfyui_frontend_package do not import"; rc=1; }
fi
log "done in $((SECONDS - t0)) s (exit $rc)"
exit $rc
