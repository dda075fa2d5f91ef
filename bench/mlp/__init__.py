"""What does chunking MiniMax H3's block MLP save and cost (hazard H-4)?

- ``bench_mlp``: one real-size H3 block MLP, token-chunked vs unpatched -> bench/results/mlp_h200.json
  (docs/BENCHMARKS.md via bench.common.tables; docs/MEASURED.md "The H3 MLP in token chunks").
- ``gpu_mlp_comfy``: the MLP through ComfyUI's own ops -> mlp_comfy_*_h200.json (docs/BENCHMARKS.md
  "H3 MLP through ComfyUI's own ops").
- ``mlp_host``: host microseconds the chunked MLP adds per call, on the CPU -> mlp_host_cpu.json
  (cited by no doc table yet).
"""
