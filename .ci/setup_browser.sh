#!/usr/bin/env bash
# Browser-test prerequisites for tests/browser (idempotent; safe to run on every CI run).
#
#   bash .ci/setup_browser.sh "$SAFESAGE_PYTHON"
#
# 1. Debian's chromium (/usr/bin/chromium), if dpkg does not have it installed and working: apt-get
#    update + apt-get install. An installed chromium is found before apt is touched at all.
#    Playwright never downloads a browser here: the tests launch this executable.
# 2. playwright (Python package only) and comfyui-frontend-package into the given venv,
#    constrained to the venv's torch pin ($venv/constraints.txt, written by setup_env.sh).
#    The frontend version is the one the ComfyUI tree under test pins in its requirements.txt
#    ($COMFYUI_PATH), else 1.48.6 (what ComfyUI 0dd9b154 pins).
#
# Busy machines: two runs of this script (two CI runs sharing a machine) take turns on the lock
# $cache/.lock-browser (flock; $cache is ${SAFESAGE_CACHE_DIR:-~/.cache/safesage}) around both
# steps, and the one that waits says so and looks for chromium again once it has the lock (the
# other run has usually installed it). Any other apt/dpkg user (unattended-upgrades, a developer's
# apt-get) is waited for through apt's own lock wait (-o DPkg::Lock::Timeout). Each wait lasts at
# most SAFESAGE_APT_WAIT_S seconds (default 900); after that this script fails, saying which
# lock it waited for and how long.
#
# Exit status 0 when everything is in place. A failure here must not fail the whole CI run:
# the browser tests skip with the reason printed when chromium or playwright is missing, so
# the caller may ignore a non-zero exit (it prints why; with CI=true such a skip fails the pass).
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

# ------------------------------------------------------------------ one run at a time
cache_root="${SAFESAGE_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/safesage}"
wait_s="${SAFESAGE_APT_WAIT_S:-900}"
[[ "$wait_s" =~ ^[0-9]+$ ]] || { log "SAFESAGE_APT_WAIT_S must be a number of seconds, not '$wait_s'"; exit 2; }
lock="$cache_root/.lock-browser"

# chromium as dpkg has it: "ok" (installed and it starts), "absent", or dpkg's state of a package
# another apt/dpkg run is still installing ("unpacked", "half-configured", ...)
chromium_state() {
    local st=""
    if command -v dpkg-query >/dev/null 2>&1; then
        st="$(dpkg-query -W -f='${db:Status-Status}' chromium 2>/dev/null)"
    fi
    if [[ -n "$st" && "$st" != installed && "$st" != not-installed && "$st" != config-files ]]; then
        echo "$st"                   # dpkg is part-way through it
    elif [[ -x /usr/bin/chromium ]] && /usr/bin/chromium --version >/dev/null 2>&1; then
        echo ok                      # installed by dpkg, or put there by hand
    else
        echo absent
    fi
}

# apt's and dpkg's lock files, and the messages apt-get fails with when another process holds one
APT_LOCKS=(/var/lib/dpkg/lock-frontend /var/lib/dpkg/lock /var/lib/apt/lists/lock /var/cache/apt/archives/lock)
APT_LOCK_ERRORS="Could not get lock|Unable to acquire|Unable to lock"

# "PATH held by pid N (command)" for the first of APT_LOCKS another process holds (/proc/locks), if any
apt_lock_holder() {
    local f ino pid
    for f in "${APT_LOCKS[@]}"; do
        ino="$(stat -c %i "$f" 2>/dev/null)" || continue
        pid="$(awk -v ino="$ino" '($2 == "POSIX" || $2 == "OFDLCK") { n = split($6, a, ":"); if (a[n] == ino) { print $5; exit } }' \
               /proc/locks 2>/dev/null)"
        if [[ "$pid" == -1 ]]; then           # an open-file-description lock names no process
            echo "$f held by another process"
            return 0
        elif [[ -n "$pid" && "$pid" != "$$" ]]; then
            echo "$f held by pid $pid ($(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | cut -c1-80))"
            return 0
        fi
    done
    return 1
}

# apt-get "$@" into $apt_log, waiting up to $wait_s s in all for another apt/dpkg process's locks:
# dpkg's through apt's own DPkg::Lock::Timeout, the package lists' (apt-get update has no such
# wait) by trying again every 5 s. Says once that it waits, and for whom.
apt_run() {
    local deadline=$((SECONDS + wait_s)) said=0 left holder
    while :; do
        if holder="$(apt_lock_holder)" && [[ $said == 0 ]]; then
            log "waiting for the package manager's lock for apt-get $1 (up to ${wait_s} s, SAFESAGE_APT_WAIT_S): $holder"
            said=1
        fi
        left=$((deadline - SECONDS)); ((left < 1)) && left=1
        if apt-get -o "DPkg::Lock::Timeout=$left" "$@" >"$apt_log.try" 2>&1; then
            cat "$apt_log.try" >>"$apt_log"
            [[ $said == 1 ]] && log "got the package manager's lock; apt-get $1 done"
            return 0
        fi
        cat "$apt_log.try" >>"$apt_log"
        grep -q -E "$APT_LOCK_ERRORS" "$apt_log.try" && ((SECONDS < deadline)) || return 1
        if [[ $said == 0 ]]; then
            log "waiting for the package manager's lock for apt-get $1 (up to ${wait_s} s, SAFESAGE_APT_WAIT_S): $(grep -m1 -E "$APT_LOCK_ERRORS" "$apt_log.try" | sed 's/^E: //')"
            said=1
        fi
        sleep 5
    done
}

take_lock() {
    mkdir -p "$cache_root" || return 1
    command -v flock >/dev/null 2>&1 || { log "no flock: not waiting for other runs of this script"; return 0; }
    exec 7>>"$lock" || return 1
    if ! flock -n 7; then
        log "waiting for $lock (up to ${wait_s} s): another run is installing chromium or the browser packages ($(cat "$lock.owner" 2>/dev/null || echo "owner unknown"))"
        local t_lock=$SECONDS
        if ! flock -w "$wait_s" 7; then
            log "FAILED: $lock still held after ${wait_s} s (SAFESAGE_APT_WAIT_S); holder: $(cat "$lock.owner" 2>/dev/null || echo unknown)"
            return 1
        fi
        log "got $lock after $((SECONDS - t_lock)) s"
    fi
    echo "pid $$ since $(date +%H:%M:%S)" > "$lock.owner"
    trap 'rm -f "$lock.owner"' EXIT          # runs while this script still holds the lock
}

# ------------------------------------------------------------------ chromium (Debian)
state="$(chromium_state)"
if [[ $state == ok ]]; then
    log "chromium present: $(/usr/bin/chromium --version 2>/dev/null | head -1)"
fi
if ! take_lock; then
    log "WARNING: the browser tests will skip (could not take $lock)"
    exit 1
fi
if [[ $state != ok ]]; then
    state="$(chromium_state)"     # another run may have installed it while this one waited
    [[ $state == ok ]] && log "chromium present now (another run installed it): $(/usr/bin/chromium --version 2>/dev/null | head -1)"
fi
if [[ $state == ok ]]; then
    :
elif command -v apt-get >/dev/null 2>&1 && [[ "$(id -u)" == 0 ]]; then
    if [[ $state == absent ]]; then
        log "installing chromium from Debian (apt-get)"
    else
        log "chromium is '$state' in dpkg (another apt run was part-way through it): apt-get install again"
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt_log="$(mktemp "${TMPDIR:-/tmp}/setup_browser_apt.XXXXXX")"
    t_apt=$SECONDS
    step=update
    if apt_run update -qq && step=install \
            && apt_run install -y -qq --no-install-recommends chromium \
            && [[ "$(chromium_state)" == ok ]]; then
        log "chromium installed in $((SECONDS - t_apt)) s: $(/usr/bin/chromium --version 2>/dev/null | head -1)"
    else
        awk '!seen[$0]++' "$apt_log" | tail -n 20 >&2     # its last lines, each once
        if grep -q -E "$APT_LOCK_ERRORS" "$apt_log.try" 2>/dev/null; then
            log "WARNING: apt-get $step gave up after waiting $((SECONDS - t_apt)) s for the package manager's lock (SAFESAGE_APT_WAIT_S=$wait_s): another apt/dpkg process held it the whole time; the browser tests will skip"
        else
            log "WARNING: apt-get $step could not install chromium (its output above; chromium now: $(chromium_state)); the browser tests will skip"
        fi
        rc=1
    fi
    rm -f "$apt_log" "$apt_log.try"
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
