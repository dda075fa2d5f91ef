"""SafeSage core: check -> plan -> run, fenced. Pure torch; never imports ComfyUI at import time.

Modules: runtime (what is here), envelope (kernel index arithmetic as data),
planner (call -> Plan), fences (event-gated keep-alive), probe (first-call
verification), attention (the ComfyUI override), mlp (chunked H3 SwiGLU),
patch (apply to a ModelPatcher), report (counters).
"""
__version__ = "0.1.0"
