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

Prompts 1-3 of one server (issue 46 goal 8): ``--prompts 3`` runs each row's graph three times in
its one server. Prompt 1 carries the server's one-time costs; prompts 2 and 3 run with their own noise
and conditioning seeds (seed + 1000 x i: ComfyUI's cache re-runs the sampler, not the loader or the
SafeSage node, as a user re-queuing with a new seed does), the same seeds in every arm, so each later
prompt's latent is compared with the same prompt of the PyTorch arm and of the row's unguarded arm
(``worker.later_prompts[i]``: ``s_per_step``, ``rel_l2_vs_pytorch``, ``rel_l2_vs_unguarded``, and for
SafeSage rows ``safesage_quality``, the guard's counters and last run after that prompt; prompt 1's:
``worker.safesage_quality_first_prompt``). Every arm of a plan runs the same number of prompts. The
reporter's graph at 38k, 2 steps, on a synthetic checkpoint with late-block drift (bench/common/synth_h3.py
``--drift-*``; the checkpoint's settings land in the JSON's ``checkpoint_settings``):

  PYTHONPATH=$PYTHONPATH:$SS_COMFY python3 -m bench.common.synth_h3 /tmp/h3_50d.safetensors --blocks 50 \
      --drift-blocks 8 --drift-channels 4 --drift-factor 16 --reuse > /tmp/synth50d.json
  python -m bench.repro all --comfy $SS_COMFY --ckpt /tmp/h3_50d.safetensors --steps 2 --prompts 3 \
      --emulate-arch sm120 --synth-info /tmp/synth50d.json --ballast-free-gib 30 --out R.json \
      --plan 38k:pytorch 38k:sage 38k:safesage_faults 38k:safesage 38k:sage_sm80 [38k:ck]
  python3 -m bench.quality.quality_cost R.json --path sage22_sm120 --out bench/results/quality_guard_cost_38k_<gpu>.json

Arms for single kernels: ``sage_sm80`` (sage 2.2's int8-QK + fp16-PV kernel alone, unguarded) and ``ck``
(comfy-kitchen's int8_attention as ComfyUI's own attention, ``--use-ck-attention``: only a ComfyUI tree
that has the flag, 783545f6 and later; on 0dd9b154 the row is skipped, saying so).

Modules, one job each: arms (sizes and configurations), workflow (the graph a row queues),
worker (one server per row), probe_pack (the harness's node pack inside that server: timings,
residency, memory, OOM attribution, the --emulate-arch start-up hook), memory (NVML peak and the
OOM attribution), replans (a row's re-plans and their stall, from /safesage/stats), av_stub
(PyAV's stand-in where it is missing), logs (what a server log says), soak (one server, many
prompts), driver (the plan, ballast, latents, rel. L2),
verdict (the tables and the silently-wrong call).

Run from the repository root (``python -m bench.repro``); the package imports no torch at import time.
"""
