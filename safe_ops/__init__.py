"""SafeSage core: check -> plan -> run. Pure torch; never imports ComfyUI at import time.

Subpackages by job (docs/DESIGN.md has the map): facts (what is here: devices, versions, memory
budget, ComfyUI's allocation compiler, the measured kernel table), families (the envelope framework
and one module per kernel family, listed by families.registry), attention (the override: call forms,
what ComfyUI would run, kernel choice, planner, executor, errors, streams, verification), models/h3
(MiniMax H3: dims, the chunked MLP, its plan, the cast memo, the patch), ui (run statistics, status
lines, Preflight). Beside them: policy (the node's inputs), patch (apply to a ModelPatcher), demo.
"""
__version__ = "0.1.0"
