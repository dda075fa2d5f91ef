"""How long a video fits on a card of a given size, and what holds the memory?

- ``max_length`` (logic in ``max_length_search``): the longest MiniMax H3 video that completes with correct
  output, per arm -> bench/results/max_length_h100.json (docs/MEASURED.md "How long a video fits in 24 GiB").
- ``fit_lengths``: fits the length model's constants from committed runs -> safe_ops/facts/length_model.json
  (safe_ops/ui/length_model.py; docs/MEASURED.md, same section).
- ``block_memory``: what holds memory at an H3 block's peak, on the CPU -> block_memory_cpu.json
  (docs/MEASURED.md).
- ``compiler_probe``: H3 blocks under ComfyUI's allocation compiler (comfy-aimdo) -> compiler_h200.json,
  compiler_*_h200.json (docs/BENCHMARKS.md via bench.common.tables; docs/MEASURED.md "Under ComfyUI
  0.34+'s allocation compiler").
"""
