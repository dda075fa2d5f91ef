"""What does SafeSage cost on the host, per attention call and end to end?

- ``host_cost`` (sections in ``host_cost_calls``, ``host_cost_e2e``; clock in ``host_cost_timing``): the
  cost as ratios in one process -> bench/results/host_cost_h100.json (docs/MEASURED.md "As ratios in one
  process (issue 39)").
- ``host_path``: SafeSage's own host time per call with null kernels -> host_path_cpu.json,
  host_path_h100.json (docs/MEASURED.md "SafeSage's host time per attention call").
- ``host_frames``: the host Python frames per repeated guarded call (issue 49 item 1) ->
  host_frames_cpu.json (docs/DEVELOPING.md, issue 49's note).
- ``host_profile``: each piece of the guarded hot path timed alone (prints; writes no JSON).
"""
