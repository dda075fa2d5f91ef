"""One guarded mid-size call for compute-sanitizer (H200):

    compute-sanitizer --tool memcheck python3 bench/sanitizer_call.py --S 99866

Runs SafeSage's guarded sageattention on MiniMax H3 strided views just past the
int32 boundary (a repack plan), synchronises, and prints the plan and error vs SDPA.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_attention as ga  # noqa: E402
import torch  # noqa: E402

from safe_ops.ui import run_stats  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--S", type=int, default=99_866)
a = ap.parse_args()
q, k, v = ga.h3_qkv(a.S, "strided")
o = ga.guarded()(ga.noop, q, k, v, 56, skip_reshape=True, skip_output_reshape=True)
torch.cuda.synchronize()
print("plan:", next(iter(run_stats.PLANS.values())))
print("rel_err_vs_sdpa:", ga.rel_l2(o, ga.sdpa(q, k, v)))
