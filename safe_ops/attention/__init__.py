"""The attention override: ComfyUI's call forms, the planner, the executor, the legacy-stream hop,
first-call verification, and ``SafeAttention`` itself."""
