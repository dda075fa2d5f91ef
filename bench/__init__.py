"""GPU stress, bench, probe and MLP scripts, and the reporter's-graph reproduction (bench/repro).

Each entry point runs as a module from the repository root, e.g. ``python -m bench.kernels.gpu_attention
bench --out ...``; results go to bench/results/*.json (each records the command that made it) and
``python -m bench.common.tables`` regenerates docs/BENCHMARKS.md. Nothing here edits ``sys.path``: a process
that needs ComfyUI or this repository on its path gets it through ``PYTHONPATH`` from whoever
starts it. Development only: not in the registry archive (.comfyignore).
"""
