"""The final latent's error per arm and prompt of bench.repro results, for a cost JSON (issue 46 goal 8:
"the final latent's error vs SDPA's and the probe's cost per prompt").

    python3 -m bench.quality.latent_errors RESULT.json [RESULT.json ...] --into bench/results/quality_guard_cost_<...>.json \\
        [--before OLD.json --before-source TEXT] [--note TEXT ...]

Per arm of each RESULT (one ``python -m bench.repro all`` run) and per prompt of its server (prompt 1,
then ``worker.later_prompts``): ``rel_l2_vs_pytorch`` (the latent against the PyTorch arm's same prompt,
same seeds: ComfyUI's own SDPA attention), ``rel_l2_vs_unguarded`` where the arm has an unguarded twin,
seconds per step, and for SafeSage rows the guard's cumulative probe and recalled-block counts after
the prompt (``probes`` unchanged from the previous prompt: that prompt ran from remembered errors).
Each arm names the ComfyUI tree and result it came from. ``--into`` adds them to a JSON under
``final_latent_error``; ``--before`` keeps an earlier JSON whole under ``before`` (the figures this run
replaces), with ``--before-source`` saying where it came from.
"""
from __future__ import annotations

import argparse
import json

from bench.common.cmdline import command


def _counts(q: dict | None) -> dict:
    q = (q or {}).get("quality") or {}
    return {"probes": q.get("probes"), "recalled_blocks": q.get("recalled_blocks"), "blocks_moved": q.get("blocks_moved")}


def arm_rows(doc: dict, source: str) -> dict:
    """{"<size>:<arm>": {"source", "comfy", "prompts": [...]}} of one bench.repro result."""
    comfy = next((t for t in doc.get("command", "").split("--comfy ")[1:2]), "").split(" ")[0] or None
    out = {}
    for r in doc.get("runs", []):
        w = r.get("worker") or {}
        first = {"prompt": 1, "outcome": r.get("outcome"), "s_per_step": w.get("s_per_step"),
                 "rel_l2_vs_pytorch": r.get("rel_l2_vs_pytorch"), "rel_l2_vs_unguarded": r.get("rel_l2_vs_unguarded")}
        if "safesage_quality_first_prompt" in w:
            first.update(_counts(w["safesage_quality_first_prompt"]))
        prompts = [first]
        for p in w.get("later_prompts") or []:
            row = {"prompt": p.get("prompt"), "outcome": p.get("outcome"), "s_per_step": p.get("s_per_step"),
                   "rel_l2_vs_pytorch": p.get("rel_l2_vs_pytorch"), "rel_l2_vs_unguarded": p.get("rel_l2_vs_unguarded")}
            if "safesage_quality" in p:
                row.update(_counts(p["safesage_quality"]))
            prompts.append(row)
        out[f"{r.get('size')}:{r.get('arm')}"] = {"source": source, "comfy": comfy, "prompts": prompts}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="bench.repro all JSONs")
    ap.add_argument("--into", required=True, help="the JSON to add final_latent_error (and before) to")
    ap.add_argument("--before", default=None, help="an earlier JSON, kept whole under 'before'")
    ap.add_argument("--before-source", default=None, help="where --before came from (e.g. FILE at REV)")
    ap.add_argument("--note", action="append", default=[])
    a = ap.parse_args(argv)
    arms: dict = {}
    for path in a.results:
        with open(path) as f:
            arms.update(arm_rows(json.load(f), path))
    with open(a.into) as f:
        doc = json.load(f)
    doc["final_latent_error"] = {"command": command("quality.latent_errors"), "vs": "the PyTorch arm's latent of the same "
                                 "prompt (same seeds): ComfyUI's own SDPA attention", "notes": a.note, "arms": arms}
    if a.before:
        with open(a.before) as f:
            doc["before"] = {"source": a.before_source or a.before, "doc": json.load(f)}
    with open(a.into, "w") as fh:
        json.dump(doc, fh, indent=1)
    print(json.dumps({k: [(p["prompt"], p["rel_l2_vs_pytorch"], p.get("probes")) for p in v["prompts"]]
                      for k, v in arms.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
