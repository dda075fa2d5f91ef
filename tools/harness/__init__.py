"""The headless-ComfyUI harness: start a real ComfyUI server (comfy_process), the tests' server and its
HTTP helpers (comfy_server), the graphs the tests and benches queue (comfy_graphs), tiny random-weight
models written with ComfyUI's own classes (tiny_models).

Shared by tests/comfy, tests/browser and bench/repro; importable from the repository root (pytest's
``pythonpath = .``, ``python -m bench....``). Development only: not in the registry archive (.comfyignore).
"""
