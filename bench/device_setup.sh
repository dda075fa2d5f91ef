#!/usr/bin/env bash
# Set up the GPU box (the device tool's H200) for bench/ runs. Not used by CI or by the pack.
# Source it from the repo root:   source bench/device_setup.sh
# Inputs, all git-ignored and carried by the device call (never committed):
#   .whl/*.whl                  comfy-aimdo 0.4.13, torchsde 0.2.6, trampoline 0.1.2 (pip download, cp312)
#   .gpu/ck226.tar.xz           comfy-kitchen 0.2.26 (ComfyUI 0dd9b154's pin) minus its HIP backend
#   .gpu/ck240.tar.xz           comfy-kitchen 0.2.40 (has int8_attention), same trim
#   .gpu/ck235.tar.xz           comfy-kitchen 0.2.35 (the last with #178's int32 batch-stride checks), same trim
#   .gpu/ck239.tar.xz           comfy-kitchen 0.2.39 (64-bit batch bases since 0.2.36), same trim
#   .gpu/ComfyUI-0dd9b154.tgz   ../shared/comfyui's tarball (unpacks to c0dd/)
#   .gpu/SageAttention-2.2.0-src.tgz  ../shared/sageattention's tarball (unpacks to sage22/)
#   .gpu/sage22-*.tar.xz        a finished sage 2.2.0 build (from ss_pack_sage), if carried
# Making them here (nothing in .whl/ or .gpu/ outlives a session's checkout), from the repo root:
#   mkdir -p .whl .gpu && (cd .whl && python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any \
#     --implementation cp --abi cp312 --abi none --abi abi3 comfy-aimdo==0.4.13 torchsde==0.2.6 trampoline==0.1.2 \
#     sageattention==1.0.6 SQLAlchemy==2.0.44 greenlet blake3 pydantic==2.11.9 pydantic-core==2.33.2 annotated-types \
#     typing-inspection simpleeval)          # the last eight: what a ComfyUI server (bench/repro) needs there
#   comfy-kitchen X.Y.Z: pip download the same way into a temp dir, unzip, rm -rf comfy_kitchen/backends/hip,
#     tar -cf - comfy_kitchen comfy_kitchen-*.dist-info | xz -T8 -6 > .gpu/ckXYZ.tar.xz   (0.2.26: 22 MB)
#   cp ../shared/comfyui/ComfyUI-0dd9b154.tgz ../shared/sageattention/SageAttention-2.2.0-src.tgz .gpu/
#   and carry ".whl" and ".gpu" (run's carry argument; 64 MiB in all).
# A script that imports ComfyUI outside a server (bench/common/synth_h3.py, --comfy options, bench/kernels/gpu_compile.py,
# bench/quality/gpu_quality*.py with COMFYUI_PATH=$SS_COMFY) needs PYTHONPATH=$PYTHONPATH:$SS_COMFY as well: nothing
# under bench/ or tools/ puts ComfyUI on sys.path itself (ss_base leaves it off PYTHONPATH for the servers).
# Functions:
#   ss_base                 wheels -> /tmp/site (PYTHONPATH), ComfyUI -> /tmp/comfy/c0dd ($SS_COMFY)
#   ss_kitchen 226|235|239|240 that comfy-kitchen into /tmp/ck<ver> and on PYTHONPATH (before /tmp/site)
#   ss_build_sage ARCH TAG  background build of sage 2.2.0 for TORCH_CUDA_ARCH_LIST=ARCH into
#                           /tmp/sage-TAG (log /tmp/sage-TAG.log, done marker /tmp/sage-TAG.ok)
#   ss_sage TAG             put /tmp/sage-TAG (built here or unpacked from .gpu/sage22-TAG.tar.xz) first
#                           on PYTHONPATH
#   ss_pack_sage TAG DEST   tar.xz the build (compiled extensions + Python files) to DEST
set -u
SS_ROOT="$(pwd)"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# An "8.9+PTX" sage build carries sm_89 SASS and compute_89 PTX (setup.py:159-161). The H200 is sm_90,
# which cannot run sm_89 SASS, so the driver JIT-compiles each kernel's PTX on its first use (lazy module
# loading): the first call of every kernel variant (per family, return_lse or not) is slow, on a fresh
# machine each time. Measured (session 4): the sm80 kv_chunks GPU test took 54.9 s while the cache grew
# 10 -> 41 MB and 5.3 s in the next process (bench/results/logs/gputests_sm80_jit_cold.log, _warm.log);
# that cut two earlier GPU-test runs. Benches time after a warm-up call; a large JIT cache keeps what was
# compiled across the processes of one call (and calls, while the machine stays warm).
export CUDA_CACHE_MAXSIZE=${CUDA_CACHE_MAXSIZE:-4294967296}

ss_base() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$SS_ROOT"/.whl/*.whl || return 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    if [ ! -d /tmp/comfy/c0dd ] && [ -f "$SS_ROOT/.gpu/ComfyUI-0dd9b154.tgz" ]; then
        mkdir -p /tmp/comfy && tar -C /tmp/comfy -xzf "$SS_ROOT/.gpu/ComfyUI-0dd9b154.tgz" || return 1
    fi
    export SS_COMFY=/tmp/comfy/c0dd
}

ss_kitchen() {
    local v=$1
    if [ ! -d /tmp/ck$v/comfy_kitchen ]; then
        mkdir -p /tmp/ck$v && tar -C /tmp/ck$v -xJf "$SS_ROOT/.gpu/ck$v.tar.xz" || return 1
    fi
    export PYTHONPATH=/tmp/ck$v:$PYTHONPATH
}

ss_build_sage() {
    local arch=$1 tag=$2 src=/tmp/sage-src-$2
    rm -rf "$src" /tmp/sage-$tag /tmp/sage-$tag.ok && mkdir -p "$src"
    tar -C "$src" -xzf "$SS_ROOT/.gpu/SageAttention-2.2.0-src.tgz" || return 1
    ( cd "$src/sage22" && TORCH_CUDA_ARCH_LIST="$arch" EXT_PARALLEL=${SS_EXT_PARALLEL:-4} MAX_JOBS=${SS_MAX_JOBS:-4} \
        setsid nohup bash -c "python3 -m pip install --no-build-isolation --no-deps --no-cache-dir --target /tmp/sage-$tag . \
        > /tmp/sage-$tag.log 2>&1 && touch /tmp/sage-$tag.ok" >/dev/null 2>&1 & )
}

ss_sage() {
    local tag=$1
    if [ ! -d /tmp/sage-$tag/sageattention ] && [ -f "$SS_ROOT/.gpu/sage22-$tag.tar.xz" ]; then
        mkdir -p /tmp/sage-$tag && tar -C /tmp/sage-$tag -xJf "$SS_ROOT/.gpu/sage22-$tag.tar.xz" || return 1
    fi
    [ -d /tmp/sage-$tag/sageattention ] || { echo "no sage build $tag" >&2; return 1; }
    export PYTHONPATH=/tmp/sage-$tag:$PYTHONPATH
}

ss_pack_sage() {
    tar -C /tmp/sage-$1 -cf - . | xz -T8 -6 > "$2"
}
