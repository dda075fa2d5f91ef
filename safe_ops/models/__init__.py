"""Model-specific code, one folder per model (``h3``: MiniMax H3)."""
