"""SafeSage's override captured in a CUDA graph and replayed (H200; skipped without CUDA + sage).

    python -m pytest tests/gpu/test_gpu_capture.py -v -rs
    SAFESAGE_BENCH_FAMILY=sage2_fp8pv_perwarp python -m pytest tests/gpu/test_gpu_capture.py -v -rs

After an eager warm-up call (plans the signature and verifies its class), a block that calls
the override is captured with ``torch.cuda.graph`` and replayed. A family that launches on the
caller's stream (sage 1.0.6's Triton kernel) runs its plan inside the graph: the replay is
BITWISE the eager call (same kernel, same inputs), also after new values are copied into the
inputs. A family that launches on the legacy stream (sage 2.x CUDA, e.g. the sm_120 per_warp
path) would need a stream hop, illegal under capture: the call runs ComfyUI's function (here
the benches' stand-in, PyTorch SDPA) inside the graph, bitwise that function's eager output.
"""

import pytest
import torch

from safe_ops.ui import run_stats
from safe_ops.attention.override import SafeAttention
from safe_ops.policy import Policy

from bench.kernels import gpu_attention as ga

pytestmark = pytest.mark.gpu
HEADS = 56


def test_capture_replays_the_override_bitwise():
    run_stats.reset()
    kern = ga.sage_kern()
    att = SafeAttention(Policy(kernel="sage", verify="first"), kernels=[kern], rt=ga.bench_runtime())
    q, k, v = ga.h3_qkv(4096, "strided")

    def block():
        return att(ga.noop, q, k, v, HEADS, skip_reshape=True, skip_output_reshape=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                 # warm-up: plan, verify, compile the kernel
        eager = block().clone()
        # and ComfyUI's own function, which runs a legacy-stream family's calls under capture:
        # every op a graph captures is warmed up on a side stream first (torch.cuda.graph's
        # contract; cuDNN's SDPA allocates its workspace at its first call)
        ga.noop(q, k, v, HEADS, skip_reshape=True, skip_output_reshape=True)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert run_stats.value("probes") == 1 and run_stats.value("probe_failures") == 0
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block()
    graph.replay()
    torch.cuda.synchronize()
    assert run_stats.value("captured_calls") == 1
    same_stream = not kern.envelope.launches_on_legacy_stream
    assert run_stats.value("captured_guarded") == (1 if same_stream else 0), kern.family
    reference = eager if same_stream else ga.noop(q, k, v, HEADS, skip_reshape=True, skip_output_reshape=True)
    assert torch.equal(out, reference), (kern.family, ga.rel_l2(out, reference))
    # new values in the same memory: the replay recomputes them
    g = torch.Generator(device="cuda").manual_seed(5)
    for t in (q, k, v):
        t.copy_(torch.randn(t.shape, device="cuda", dtype=t.dtype, generator=g))
    graph.replay()
    torch.cuda.synchronize()
    again = block() if same_stream else ga.noop(q, k, v, HEADS, skip_reshape=True, skip_output_reshape=True)
    torch.cuda.synchronize()
    assert torch.equal(out, again), (kern.family, ga.rel_l2(out, again))
    assert run_stats.value("captured_errors") == 0 and run_stats.value("internal_errors") == 0
