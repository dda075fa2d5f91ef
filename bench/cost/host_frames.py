"""Host Python frames per repeated guarded call (issue #49): how many SafeSage functions one attention
call of a known signature enters, counted with ``sys.setprofile`` (a count, not a timing: it does not
depend on the machine).

The override is the pack's real one around bench/cost/host_path.py's null kernel family, on the CPU, for
H3's 4-d HND views; each row is one setting of the quality guard:

* ``faults only``: no quality guard;
* ``balanced, planned``: ``balanced`` in a started forward whose step is not known (nothing measured,
  every call runs its plan: host_path's "balanced" row);
* ``balanced, block unmoved``: steps 2.. of a run where the guard moved some other block (the call is
  told its block and looks its choice up: host_path's "blocks moved" row);
* ``balanced, block moved``: the same, this call's own block moved to a second null family.

Per row: ``safesage_frames`` (functions under safe_ops/), ``python_frames`` (every Python function,
torch's included), ``is_compiling`` (calls of ``torch.compiler.is_compiling``) per call, and the
SafeSage frames of one call in order.

    python3 -m bench.cost.host_frames --out bench/results/host_frames_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from bench.common.benchutil import env_info
from bench.cost.host_path import null_setup

ROWS = ("faults only", "balanced, planned", "balanced, block unmoved", "balanced, block moved")
BLOCK = 3           # the calls' block_index


def _guarded(row: str):
    """The override of ``row`` and one call of a repeated signature."""
    from safe_ops.attention.override import SafeAttention
    from safe_ops.policy import Policy
    from safe_ops.quality import guard as quality_guard

    su = null_setup("cpu")
    moved_to = null_setup("cpu", family="null_moved")["kernel"]
    quality = "faults only" if row == "faults only" else "balanced"
    att = SafeAttention(Policy(kernel="sage", verify="off", quality=quality), kernels=[su["kernel"], moved_to],
                        rt=su["rt"])
    args, kw, _ = su["forms"]["4d_hnd_views"]
    kw = {**kw, "transformer_options": {"block_index": BLOCK}}

    def call():
        return att(su["null_comfy"], *args, **kw)

    if att.quality.active:
        att.quality.forward_start({})
    call()                                      # the signature's plan, made once
    if row.startswith("balanced, block"):
        st = att.quality.state()
        klass = att.prepared_plans()[0].klass
        block = BLOCK if row.endswith("moved") and not row.endswith("unmoved") else BLOCK + 1
        st.mode, st.choices = quality_guard.CHOSEN, {(block, klass): ("null_moved",)}
    for _ in range(3):
        call()
    return call


def frames(row: str, calls: int = 10) -> dict:
    """Frames per call of ``row`` (see the module docstring)."""
    call = _guarded(row)
    seen: list = []
    here = os.path.abspath(__file__)

    def prof(frame, event, arg):
        if event == "call":
            seen.append(frame.f_code)

    sys.setprofile(prof)
    try:
        for _ in range(calls):
            call()
    finally:
        sys.setprofile(None)
    seen = [c for c in seen if os.path.abspath(c.co_filename) != here]
    ours = [c for c in seen if f"{os.sep}safe_ops{os.sep}" in c.co_filename]
    one = ours[:len(ours) // calls]
    return {"safesage_frames": len(ours) / calls, "python_frames": len(seen) / calls,
            "is_compiling": sum(c.co_name == "is_compiling" for c in seen) / calls,
            "one_call": [f"{os.path.basename(c.co_filename)}:{c.co_qualname if hasattr(c, 'co_qualname') else c.co_name}"
                         for c in one]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows = {row: frames(row) for row in ROWS}
    with open(a.out, "w") as f:
        json.dump({**env_info("cost.host_frames"), "rows": rows}, f, indent=1)
    for row, r in rows.items():
        print(f"{row:26s} safesage {r['safesage_frames']:5.1f}  python {r['python_frames']:5.1f}  "
              f"is_compiling {r['is_compiling']:.0f}")


if __name__ == "__main__":
    main()
