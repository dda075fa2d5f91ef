"""What the user asked for on the node, as one immutable value."""
from __future__ import annotations

from dataclasses import dataclass

KERNELS = ("auto", "sage", "sdpa")
MLP_CHUNKING = ("auto", "off", "tokens")
VERIFY = ("first", "every", "off")
QUALITY = ("faults only", "balanced", "strict")      # quality.targets.QUALITY (pinned by a test)


@dataclass(frozen=True)
class Policy:
    kernel: str = "auto"              # auto: fastest kernel verified safe on this GPU; sage; sdpa
    mlp_chunking: str = "auto"        # auto: chunk from the memory budget; off; tokens
    mlp_chunk_tokens: int = 16384     # used when mlp_chunking == "tokens"
    verify: str = "first"             # first call per class / every call / off
    debug_sync: bool = False          # synchronise after each guarded call (fault attribution)
    max_extra_bytes: int | None = None  # None: derive from free memory at plan time
    quality: str = "balanced"         # per-block error target (quality/targets.py); "faults only": none
    probe_step: int = 0               # also measure (report only) at this sampling step; 0: no
    exact_steps: int = 0              # the first and last N steps run ComfyUI's own attention

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise ValueError(f"SafeSage: kernel must be one of {KERNELS}, got {self.kernel!r}")
        if self.mlp_chunking not in MLP_CHUNKING:
            raise ValueError(f"SafeSage: mlp_chunking must be one of {MLP_CHUNKING}, got {self.mlp_chunking!r}")
        if self.verify not in VERIFY:
            raise ValueError(f"SafeSage: verify must be one of {VERIFY}, got {self.verify!r}")
        if self.quality not in QUALITY:
            raise ValueError(f"SafeSage: quality must be one of {QUALITY}, got {self.quality!r}")
        if int(self.probe_step) < 0 or int(self.exact_steps) < 0:
            raise ValueError("SafeSage: quality_probe_step and exact_steps must be >= 0")
        if int(self.mlp_chunk_tokens) < 1:
            raise ValueError("SafeSage: mlp_chunk_tokens must be >= 1")
