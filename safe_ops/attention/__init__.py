"""The attention override: ComfyUI's call forms, the planner, the executor, the legacy-stream hop,
first-call verification, and ``SafeAttention`` itself."""

#: ComfyUI's own attention: the family name SafeSage gives it. Here, in a module that imports nothing,
#: so that move_order and the quality guard's torch-free targets module read the one constant.
COMFY = "sdpa"
