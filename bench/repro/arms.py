"""Which configurations the reproduction runs: sizes (latent width, height, frames, text tokens)
and arms (ComfyUI flags, environment, and whether the graph has a SafeSageAttention node)."""
from __future__ import annotations

# name -> (width, height, length in frames, text tokens); packed S = text + 2*audio_t + video tokens
SIZES = {
    "38k": (1344, 768, 124, 256),     # the reporter's clean size (1344x768 / 124 frames)
    "100k": (1024, 1024, 328, 256),   # just past S = 99,866 (row * 21504 > 2^31 in int32)
    "169k": (1664, 960, 362, 256),    # the reporter's failing size (1664x960 / 362 frames)
    # CPU smoke sizes (tiny model)
    "tiny": (64, 64, 22, 16),
    "tiny2": (96, 64, 39, 16),
}

# flags: ComfyUI command-line flags; env: set for the server process; safesage: None (no node) or
# the SafeSageAttention node inputs that differ from the node's own defaults
ARMS = {
    "pytorch": {"flags": [], "env": {}, "safesage": None},
    "sage": {"flags": ["--use-sage-attention"], "env": {}, "safesage": None},
    "safesage": {"flags": ["--use-sage-attention"], "env": {}, "safesage": {}},
    "safesage_sage": {"flags": ["--use-sage-attention"], "env": {}, "safesage": {"kernel": "sage"}},
    # the quality guard off (fault checks only): SafeSage's own cost, apart from the blocks the guard moves
    "safesage_faults": {"flags": ["--use-sage-attention"], "env": {}, "safesage": {"quality": "faults only"}},
    # faults only, step 1 measured without candidates (the report step): the probe's reference alone, so the
    # candidates' share of the guard's step-1 cost separates (issue #37 point 4)
    "safesage_refonly": {"flags": ["--use-sage-attention"], "env": {},
                         "safesage": {"quality": "faults only", "quality_probe_step": 1}},
    "sage_blocking": {"flags": ["--use-sage-attention"], "env": {"CUDA_LAUNCH_BLOCKING": "1"}, "safesage": None},
    "sage_nodyn": {"flags": ["--use-sage-attention", "--disable-dynamic-vram"], "env": {}, "safesage": None},
    # the comparison cases with SafeSage inserted (each matched with its own unguarded arm)
    "safesage_blocking": {"flags": ["--use-sage-attention"], "env": {"CUDA_LAUNCH_BLOCKING": "1"}, "safesage": {}},
    "safesage_nodyn": {"flags": ["--use-sage-attention", "--disable-dynamic-vram"], "env": {}, "safesage": {}},
    "safesage_pytorch": {"flags": [], "env": {}, "safesage": {}},
    # single-kernel arms (issue 46 goal 8), unguarded: comfy-kitchen's int8_attention as ComfyUI's own
    # attention (--use-ck-attention: ComfyUI 783545f6 and later; on a tree without the flag, 0dd9b154 among
    # them, the row is skipped, worker.missing_flags), and sage 2.2's int8-QK + fp16-PV kernel alone
    # (sage2_sm80: sageattn dispatching as on sm_80 through the probe pack's start-up hook, whatever the
    # run's --emulate-arch)
    "ck": {"flags": ["--use-ck-attention"], "env": {}, "safesage": None},
    "sage_sm80": {"flags": ["--use-sage-attention"], "env": {"SAFESAGE_REPRO_EMULATE_ARCH": "sm80"}, "safesage": None},
}
DEFAULT_ARMS = ["pytorch", "sage", "safesage", "safesage_sage", "sage_blocking", "sage_nodyn"]
# guarded arm -> the same configuration without SafeSage
UNGUARDED = {"safesage": "sage", "safesage_sage": "sage", "safesage_faults": "sage",
             "safesage_refonly": "sage",
             "safesage_blocking": "sage_blocking", "safesage_nodyn": "sage_nodyn", "safesage_pytorch": "pytorch"}
ARM_LABEL = {
    "pytorch": "PyTorch attention + dynamic VRAM",
    "sage": "--use-sage-attention + dynamic VRAM (unguarded)",
    "safesage": "SafeSageAttention (node defaults) + dynamic VRAM",
    "safesage_sage": "SafeSageAttention kernel=sage + dynamic VRAM",
    "safesage_faults": "SafeSageAttention quality='faults only' + dynamic VRAM",
    "safesage_refonly": "SafeSageAttention quality='faults only', quality_probe_step=1 (reference only) + dynamic VRAM",
    "sage_blocking": "--use-sage-attention + dynamic VRAM + CUDA_LAUNCH_BLOCKING=1",
    "sage_nodyn": "--use-sage-attention --disable-dynamic-vram",
    "safesage_blocking": "SafeSageAttention + CUDA_LAUNCH_BLOCKING=1",
    "safesage_nodyn": "SafeSageAttention + --disable-dynamic-vram",
    "safesage_pytorch": "SafeSageAttention, no --use-sage-attention (PyTorch attention)",
    "ck": "--use-ck-attention (comfy-kitchen int8_attention only, unguarded; ComfyUI 783545f6 and later)",
    "sage_sm80": "--use-sage-attention, sageattn dispatching as on sm_80 (sage2_sm80 only, unguarded)",
}


DEFAULT_TEXT_LEN = 256


def parse_size(size: str) -> tuple[int, int, int, int]:
    """(width, height, length, text tokens) of a size: a name of SIZES, or ``WxHxL`` (256 text tokens,
    e.g. ``1280x720x243``) or ``WxHxLxT``. The length is passed to EmptyMiniMaxH3LatentAV as given
    (it snaps it up to H3's 17k+5 frame grid)."""
    if size in SIZES:
        return SIZES[size]
    parts = size.split("x")
    if len(parts) not in (3, 4) or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"size {size!r}: one of {', '.join(SIZES)}, or WxHxL[xT] (e.g. 1280x720x243)")
    w, h, n = (int(p) for p in parts[:3])
    return (w, h, n, int(parts[3]) if len(parts) == 4 else DEFAULT_TEXT_LEN)


def is_size(size: str) -> bool:
    try:
        parse_size(size)
    except ValueError:
        return False
    return True


def size_name(width: int, height: int, length: int, text_len: int = DEFAULT_TEXT_LEN) -> str:
    """The ``WxHxL[xT]`` name :func:`parse_size` reads back."""
    return f"{width}x{height}x{length}" + (f"x{text_len}" if text_len != DEFAULT_TEXT_LEN else "")


def size_arg(size: str) -> str:
    """argparse ``type`` for a size (a name of SIZES or WxHxL[xT])."""
    import argparse
    try:
        parse_size(size)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return size


def size_dict(size: str) -> dict:
    return dict(zip(("width", "height", "length", "text_len"), parse_size(size)))


def comfy_flags(arm: str, cpu: bool = False, extra=()) -> list[str]:
    """The arm's ComfyUI flags; a CPU smoke run drops --use-sage-attention (no sage there) and
    adds --cpu, keeping the rest of the path."""
    flags = list(ARMS[arm]["flags"]) + list(extra)
    if cpu:
        flags = [f for f in flags if f != "--use-sage-attention"] + ["--cpu"]
    return flags
