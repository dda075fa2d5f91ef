"""Developer tools (not shipped): the demo bootstrap, and the headless-ComfyUI harness the tests and the
benches share (tools/harness)."""
