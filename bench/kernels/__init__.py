"""Which attention kernel is right and how fast, per family and shape (device benches)?

- ``gpu_attention`` (sections in ``attention_sections``): stress, bench, probe and host runs of the guarded
  call against raw sageattention -> bench/results/stress_*.json, attention_h200.json, probe_*.json,
  host_overhead_h200.json (docs/BENCHMARKS.md and the kernel table, via bench.common.tables; docs/MEASURED.md
  "sageattention 1.0.6 (PyPI), one attention call"). ``sanitizer_call``: one call for compute-sanitizer
  (sanitizer_memcheck_h200.log).
- ``gpu_kvchunks`` (sections in ``kvchunks_common``, ``kvchunks_ck_probe``, ``kvchunks_merge``): every
  sage-2 family and comfy-kitchen at H3 shapes, kv_chunks -> kvchunks_h200.json, kvchunks_families_h200.json,
  kv_anatomy_h200.json, ck2*_probe/families_h200.json, kvmerge_h100.json (docs/BENCHMARKS.md, kernel table;
  docs/MEASURED.md "SageAttention 2.2.0 ...", "The fused key-chunk merge and 169k").
- ``ck_align_probe``: comfy-kitchen's int8_attention on aligned/misaligned views -> ck240_align_h100.json
  (docs/MEASURED.md "comfy-kitchen's alignment rule").
- ``gpu_streams``: legacy-stream hop negative controls (HAZARDS.md H-3) -> streams_negative_controls*_h200.json,
  kernel_streams_*_h200.json (docs/DEVELOPING.md "Defect → test that catches it").
- ``gpu_compile``: graph breaks per attention call under torch.compile -> torch_compile_*_h200.json
  (docs/DEVELOPING.md "Defect → test that catches it").
"""
