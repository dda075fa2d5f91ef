"""One guarded mid-size call for compute-sanitizer (H200):

    compute-sanitizer --tool memcheck python3 -m bench.kernels.sanitizer_call --S 99866

Runs SafeSage's guarded sageattention on MiniMax H3 strided views just past the
int32 boundary (a repack plan), synchronises, and prints the plan and error vs SDPA.
"""
import argparse

import torch

from bench.kernels import gpu_attention as ga

from safe_ops.ui import run_stats

ap = argparse.ArgumentParser()
ap.add_argument("--S", type=int, default=99_866)
a = ap.parse_args()
q, k, v = ga.h3_qkv(a.S, "strided")
o = ga.guarded()(ga.noop, q, k, v, 56, skip_reshape=True, skip_output_reshape=True)
torch.cuda.synchronize()
print("plan:", next(iter(run_stats.PLANS.values())))
print("rel_err_vs_sdpa:", ga.rel_l2(o, ga.sdpa(q, k, v)))
