"""Reproduce the reporter's abort (seed-bug-report.md) with a real ComfyUI 0dd9b154 server, and
SafeSage's fix (docs/REPRODUCTION.md; results in bench/results/repro_*.json).

  python -m bench.repro all --comfy COMFY --ckpt CKPT --out bench/results/repro_h200.json [...]
      the driver (driver.py): every (size, arm) of the plan in a fresh ComfyUI server (worker.py),
      JSON written after every row.
  python -m bench.repro worker --comfy COMFY --ckpt CKPT --arm ARM --size NAME [--result R.json]
      one row only (worker.py), its fields printed (and written to R.json).
  python -m bench.repro soak --comfy COMFY --ckpt CKPT --arm ARM --size NAME [--prompts 20] [--out J]
      one server, many prompts, an interrupted one, unload and reload; GPU memory after each (soak.py)
  python -m bench.repro enrich JSON LOGDIR
      re-reads the server logs of a finished run (LOGDIR = the driver's --work) into the JSON.
  python -m bench.repro --table [JSON ...]
      the markdown tables of docs/REPRODUCTION.md (verdict.py).

Modules, one job each: arms (sizes and configurations), workflow (the graph a row queues),
worker (one server per row), probe_pack (the harness's node pack inside that server: timings,
residency, memory, OOM attribution, the --emulate-arch start-up hook), memory (NVML peak and the
OOM attribution), replans (a row's re-plans and their stall, from /safesage/stats), av_stub
(PyAV's stand-in where it is missing), logs (what a server log says), soak (one server, many
prompts), driver (the plan, ballast, latents, rel. L2),
verdict (the tables and the silently-wrong call).

Run from the repository root (``python -m bench.repro``); the package imports no torch at import time.
"""
