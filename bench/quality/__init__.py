"""How accurate is a guarded run, and what does the quality guard cost?

- ``gpu_quality``: the guard on an H3-shaped 50-block stack -> bench/results/quality_guard_sage106_h200.json,
  quality_guard_sage22_h200.json (docs/MEASURED.md "The quality guard: per-block error held to a target").
- ``gpu_quality_profiles``: the node's defaults on drift profiles -> quality_guard_profiles_h100.json
  (docs/MEASURED.md "The node's defaults on five drift layouts").
- ``gpu_quality_compiled``: the guard under torch.compile -> quality_compiled_sage106_h100.json,
  quality_compiled_sage22_h100.json (docs/MEASURED.md "The guard under torch.compile").
- ``quality_budget``: the guard's speed budget per drift layout -> quality_budget_h100.json
  (docs/MEASURED.md "Accuracy within the speed budget").
- ``quality_cost`` and ``latent_errors``: step-1 cost and final-latent error, annotated onto bench.repro
  results -> quality_guard_cost_*.json (docs/MEASURED.md, README "Use").
- ``quality_decisions``: the guard's decision retaken offline on committed measurements ->
  quality_decisions_offline.json (docs/MEASURED.md, docs/HAZARDS.md H-9; tests/unit/test_quality_targets.py).
"""
