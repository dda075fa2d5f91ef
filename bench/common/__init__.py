"""What the benches share, and the docs generator.

- ``cmdline``: the command a bench records in its JSON (``python3 -m bench.<package>.<module> ARGS``)
  and writing that JSON; ``benchutil``: timing, profiling and the ``env`` block of a bench JSON.
- ``standin_families``, ``live_storage``: CPU stand-ins for the GPU kernels and the live-storage census
  that the memory benches (bench/length) use; ``synth_h3``: a synthetic MiniMax-H3-shaped fp8_scaled
  checkpoint for bench/repro (docs/REPRODUCTION.md).
- ``tables`` (with ``tables_comfy``): writes docs/BENCHMARKS.md and safe_ops/facts/kernel_table.json from
  the committed bench/results/*.json (``python -m bench.common.tables``); writes no result of its own.
"""
