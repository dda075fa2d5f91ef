"""SafeSage core: check -> plan -> run. Pure torch; never imports ComfyUI at import time.

Modules (docs/DESIGN.md has the map): runtime (what is here, per GPU), sage_dispatch (which sage
family runs where, and how it is called), versions, h3 (MiniMax H3's facts), envelope* /
envelope_rules / sage2_temp_bytes (kernel index arithmetic and temporaries as data), planner (call -> Plan), budget (free memory -> bytes a plan
may use), kernels (adapters), comfy_call (ComfyUI's call, and what ComfyUI would run), executor
(runs a Plan), streams (the legacy-stream hop), probe (first-call verification), attention (the
ComfyUI override), compiler (ComfyUI's allocation compiler), mlp / mlp_plan / mlp_comfy /
mlp_patch (H3's MLP in token chunks), patch (apply to a ModelPatcher), preflight (a size ->
verdicts), preflight_text (verdicts -> the Preflight node's report), status (the nodes' status
lines), report (the one store of run statistics).
"""
__version__ = "0.1.0"
