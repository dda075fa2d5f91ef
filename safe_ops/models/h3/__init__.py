"""MiniMax H3: its dimensions and attention call, the token-chunked MLP forward, its chunk plan,
ComfyUI's cast memoised for one chunked call, and the patch that puts it on a model."""
