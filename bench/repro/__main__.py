"""Command line of bench/repro (see __init__.py)."""
from __future__ import annotations

import argparse
import json
import os
import sys

from . import __doc__ as DOC
from . import arms, driver, logs, soak, verdict, worker

SIZE_HELP = "a name (" + ", ".join(arms.SIZES) + ") or WxHxL[xT], e.g. 1280x720x243 (256 text tokens unless xT)"
RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")


def _enrich(path, logdir):
    """Re-read a run's server logs into its JSON (fills key_lines / python_stack_at_abort)."""
    with open(path) as f:
        doc = json.load(f)
    for r in doc["runs"]:
        log = os.path.join(logdir, f"{r['size']}_{r['arm']}.log")
        if os.path.exists(log):
            r.update(logs.log_excerpt(log))
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def _table(paths):
    """One table per JSON; each is judged against the in-limit run of any JSON given with it."""
    docs = []
    for path in paths or [os.path.join(RESULTS, "repro_h200.json")]:
        with open(path) as f:
            docs.append(json.load(f))
    return "\n\n".join(verdict.table(d, docs) for d in docs)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.repro", description=DOC.split("\n\n")[0],
                                 epilog="Also: python -m bench.repro --table [RESULT_JSON ...]; python -m bench.repro enrich "
                                        "RESULT_JSON LOGDIR (each with --help). Arms: "
                                        + "; ".join(f"{k}: {v}" for k, v in arms.ARM_LABEL.items()))
    sub = ap.add_subparsers(dest="mode", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--comfy", required=True, help="ComfyUI 0dd9b154 tree (its main.py is run)")
    common.add_argument("--ckpt", required=True, help="checkpoint from bench/common/synth_h3.py")
    common.add_argument("--steps", type=int, default=2)
    common.add_argument("--seed", type=int, default=77)
    common.add_argument("--cpu", action="store_true", help="CPU smoke run (adds --cpu to ComfyUI's args)")
    common.add_argument("--debug", action="store_true", help="ComfyUI log level DEBUG (--verbose DEBUG)")
    common.add_argument("--emulate-arch", default=None, metavar="smNNN",
                        help="sage 2.2: make sageattn dispatch as on this arch (e.g. sm120: the per_warp "
                             "quantiser + sm89 FP8-PV kernels an RTX 5090 runs) and let SafeSage plan for it "
                             "(a start-up hook in the server: bench/repro/probe_pack)")
    common.add_argument("--comfy-flag", action="append", default=[], help="one more ComfyUI flag (repeatable)")
    w = sub.add_parser("worker", parents=[common])
    w.add_argument("--arm", choices=list(arms.ARMS), required=True)
    w.add_argument("--size", type=arms.size_arg, required=True, help=SIZE_HELP)
    w.add_argument("--work", default="/tmp/repro")
    w.add_argument("--arm-timeout", type=float, default=150.0)
    w.add_argument("--result", default=None, help="also write the row's fields here")
    d = sub.add_parser("all", parents=[common])
    d.add_argument("--sizes", nargs="+", default=["169k", "100k", "38k"], type=arms.size_arg, help=SIZE_HELP)
    d.add_argument("--arms", nargs="+", default=arms.DEFAULT_ARMS, choices=list(arms.ARMS))
    d.add_argument("--out", default=os.path.join(RESULTS, "repro_h200.json"))
    d.add_argument("--copy-to", default=None, help="also copy the JSON here after every arm")
    d.add_argument("--work", default="/tmp/repro")
    d.add_argument("--ballast-free-gib", type=float, default=0.0, help="hold GPU memory in another process so this much stays free")
    d.add_argument("--arm-timeout", type=float, default=150.0, help="seconds per row, server start-up included")
    d.add_argument("--deadline", type=float, default=1e9, help="seconds for the whole driver; later arms are skipped")
    d.add_argument("--min-left", type=float, default=20.0, help="skip an arm when fewer seconds than this are left")
    d.add_argument("--plan", nargs="+", default=None, metavar="SIZE:ARM",
                   help="explicit run order (default: every size x every arm)")
    d.add_argument("--fail-fast", action="store_true", help="stop if the very first arm does not complete")
    d.add_argument("--repo-rev", default=None, help="git revision of this pack (recorded in the JSON)")
    d.add_argument("--keep-latents", default=None, metavar="DIR",
                   help="keep each completed arm's latent here and compare with those an earlier run "
                        "(same checkpoint, steps, seed, arch) left, so arms can be split over calls")
    d.add_argument("--synth-info", default=None, help="synth_h3.py's JSON line, recorded in the results")
    d.add_argument("--prompts", type=int, default=1,
                   help="prompts per row, one server: the 2nd and later (own noise seed, no latent kept) give "
                        "step times without the server's one-time costs (worker.later_prompts)")
    k = sub.add_parser("soak", parents=[common], help="one server, many prompts, memory after each (soak.py)")
    k.add_argument("--arm", choices=list(arms.ARMS), required=True)
    k.add_argument("--size", type=arms.size_arg, required=True, help=SIZE_HELP)
    k.add_argument("--prompts", type=int, default=20)
    k.add_argument("--interrupt-steps", type=int, default=30, help="steps of the prompt that is interrupted")
    k.add_argument("--work", default="/tmp/repro")
    k.add_argument("--arm-timeout", type=float, default=900.0, help="seconds per prompt")
    k.add_argument("--out", default=None)
    k.add_argument("--synth-info", default=None, help="synth_h3.py's JSON line, recorded in the results")
    return ap


#: the two modes outside the argparse tree (their arguments are plain files)
ENRICH_USAGE = ("usage: python -m bench.repro enrich RESULT_JSON LOGDIR\n\n"
                "Re-read a run's server logs (LOGDIR/<size>_<arm>.log) into its JSON (key_lines, python_stack_at_abort).")
TABLE_USAGE = ("usage: python -m bench.repro --table [RESULT_JSON ...]\n\n"
               "Print one table per JSON (default bench/results/repro_h200.json), each judged against the "
               "in-limit run of any JSON given with it (docs/REPRODUCTION.md's tables).")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    for mode, usage, nargs_ok in (("enrich", ENRICH_USAGE, lambda n: n == 2), ("--table", TABLE_USAGE, lambda n: True)):
        if argv and argv[0] == mode:
            if "-h" in argv[1:] or "--help" in argv[1:]:
                print(usage)
                return 0
            if not nargs_ok(len(argv) - 1):
                sys.exit(usage)
            if mode == "enrich":
                return _enrich(argv[1], argv[2])
            print(_table(argv[1:]))
            return 0
    a = parser().parse_args(argv)
    if a.mode == "all":
        driver.driver(a, argv)
        return
    if a.mode == "soak":
        print(json.dumps(soak.main(a, argv)["verdict"], indent=1))
        return
    row = worker.run_row(comfy=a.comfy, ckpt=a.ckpt, arm=a.arm, size=a.size, work=a.work, steps=a.steps,
                         seed=a.seed, cpu=a.cpu, debug=a.debug, emulate_arch=a.emulate_arch,
                         timeout=a.arm_timeout, extra_flags=a.comfy_flag)
    text = json.dumps(row, indent=1, default=str)
    if a.result:
        with open(a.result, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
