"""GPU negative controls of the legacy-stream hop (HAZARDS.md H-3), and the stream each kernel
family really launches on.

    python3 -m bench.kernels.gpu_streams negative --family sage2_fp8pv_perwarp --out bench/results/streams_negative_controls_h200.json
    python3 -m bench.kernels.gpu_streams kernels --out bench/results/kernel_streams_sage22_h200.json
    python3 -m bench.kernels.gpu_streams negative --dry-run --out /tmp/x.json        (CPU: the arms and patches only)

``negative``: a guarded call of a sage 2.x CUDA family (it launches on the legacy default stream)
made from a side stream while the legacy stream is delayed (``torch.cuda._sleep``). Right after the
call the caller frees its q/k/v and overwrites the memory on its own stream, then reads the output
late (its stream delayed too) and frees it, and the legacy stream allocates and overwrites a buffer
of the output's size. Arms: the pack as is, and each of the three orderings removed by a
monkeypatch (:data:`ARMS`): no ``record_stream`` on the output, never hopping, no ``hop.exit()``.
Expected: every trial of ``pack`` equals the undisturbed call; every other arm corrupts.

``kernels``: each family this environment has (sage 1.x's Triton kernel, the sage 2.2 families
its build carries for this GPU, comfy-kitchen's int8_attention) called directly from a side stream
under ``torch.profiler``: which CUDA stream each of its kernels ran on (told apart by a marker
kernel, ``torch.cuda._sleep``, on the legacy stream and one on the side stream), compared with
the envelope's ``launches_on_legacy_stream``. sage 1.x and 2.2 are both ``sageattention``: run
once per install (e.g. ``ss_base`` alone for 1.0.6, then with ``ss_sage sm89`` for 2.2.0).

Writes JSON that records its own command; ``ok`` says whether the expectation held.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile

import torch

from bench.common import benchutil
from safe_ops.attention import executor, streams

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ARMS = ("pack", "no_record_stream", "never_hop", "no_hop_exit")
CYCLES_PER_MS = 2_000_000        # torch.cuda._sleep cycles per millisecond, about (a ~2 GHz SM clock)
CORRUPT_REL = 1e-2               # rel. L2 off the undisturbed call that counts as corrupted
DTYPE = torch.bfloat16            # inputs, and the junk that reuses their memory (same sizes)
MARKER = "spin_kernel"           # the kernel torch.cuda._sleep launches (ATen's Sleep.cu)


_MISSING = object()


def _noop(self, *a, **k):
    return None


def arm_patches(arm: str) -> list[tuple]:
    """(object, attribute, stand-in) that remove one ordering of the hop, for ``arm``."""
    return {"pack": [],
            "no_record_stream": [(torch.Tensor, "record_stream", _noop)],
            "never_hop": [(executor, "legacy_hop", lambda device: None)],
            "no_hop_exit": [(streams.StreamHop, "exit", _noop)]}[arm]


@contextlib.contextmanager
def arm(name: str):
    """Apply ``name``'s monkeypatches for the block; restore exactly what was there after."""
    saved = [(obj, attr, obj.__dict__.get(attr, _MISSING)) for obj, attr, _ in arm_patches(name)]
    try:
        for obj, attr, new in arm_patches(name):
            setattr(obj, attr, new)
        yield
    finally:
        for obj, attr, old in saved:
            if old is _MISSING:
                delattr(obj, attr)
            else:
                setattr(obj, attr, old)


def env_info() -> dict:
    return benchutil.env_info("kernels.gpu_streams")


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def negative_verdict(arms: dict) -> dict:
    """From {arm: {"corrupted": n, "trials": N, ...}}: the pack never corrupts, every arm with an
    ordering removed corrupts at least once (a control that never fails shows nothing)."""
    pack_clean = arms["pack"]["corrupted"] == 0 and arms["pack"]["trials"] > 0
    removed = {a: arms[a]["corrupted"] > 0 for a in ARMS if a != "pack" and a in arms}
    return {"pack_clean": pack_clean, "each_removed_corrupts": removed,
            "ok": pack_clean and len(removed) == len(ARMS) - 1 and all(removed.values())}


# ------------------------------------------------------------------------- negative controls
def guarded(family: str):
    from safe_ops.attention.override import SafeAttention
    from safe_ops.families.registry import kernel_of as sage2_kernel
    from safe_ops.policy import Policy
    from safe_ops.facts.devices import runtime
    kern = sage2_kernel(family)
    if kern is None:
        raise SystemExit(f"family {family} is not in this sageattention build")
    if not kern.envelope.launches_on_legacy_stream:
        raise SystemExit(f"family {family} launches on the current stream: there is no hop to control")
    rt = dataclasses.replace(runtime(), sage_family=family, sage_error=None)
    # verify off (the check reads back to the host: a stream sync would hide every race); a fixed
    # budget (no free-memory read)
    return SafeAttention(Policy(kernel="sage", verify="off", max_extra_bytes=8 * 2**30), kernels=[kern], rt=rt)


def comfy_attention(q, k, v, heads, skip_reshape=False, skip_output_reshape=False, **kw):
    raise AssertionError("the guarded kernel must run these calls")


def inputs(shape, seed, dtype=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(shape, device="cuda", dtype=dtype or DTYPE, generator=g) for _ in range(3)]


def one_trial(att, shape, seed: int, clean: torch.Tensor, sleep_cycles: int) -> dict:
    legacy = torch.cuda.default_stream()
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        q, k, v = inputs(shape, seed)
    torch.cuda.synchronize()
    with torch.cuda.stream(legacy):
        torch.cuda._sleep(sleep_cycles)                 # the kernel's stream is busy
    with torch.cuda.stream(side):
        o = att(comfy_attention, q, k, v, shape[1], skip_reshape=True, skip_output_reshape=True)
        del q, k, v                                     # the caller frees its inputs...
        junk = [torch.full(shape, 1e4, device="cuda", dtype=DTYPE) for _ in range(3)]   # ...and reuses them
        torch.cuda._sleep(sleep_cycles)                 # the caller reads the output late
        got = o.float()
        del o                                           # and frees it
    with torch.cuda.stream(legacy):
        # the next user of the legacy stream: as many buffers of the output's size as it takes to
        # be handed the output's block if it was released to this stream too early
        junk2 = [torch.full(shape, -1e4, device="cuda", dtype=DTYPE) for _ in range(6)]
    torch.cuda.synchronize()
    err = rel_l2(got, clean)
    del junk, junk2
    return {"rel_l2_vs_undisturbed": err, "finite": bool(torch.isfinite(got).all()),
            "corrupted": not (err <= CORRUPT_REL and bool(torch.isfinite(got).all()))}


def negative(args) -> dict:
    shape = tuple(int(x) for x in args.shape.split(","))
    res = {"env": env_info(), "family": args.family, "shape_HND": shape, "trials_per_arm": args.trials,
           "sleep_ms": args.sleep_ms, "corrupt_rel_l2": CORRUPT_REL, "arms": {}}
    if args.dry_run:
        for name in ARMS:
            with arm(name):
                pass
        res["dry_run"] = True
        res["arm_patches"] = {a: [f"{getattr(o, '__name__', o)}.{attr}" for o, attr, _ in arm_patches(a)] for a in ARMS}
        return res
    att = guarded(args.family)
    cycles = int(args.sleep_ms * CYCLES_PER_MS)
    for name in ARMS:
        trials = []
        for t in range(args.trials):
            # the undisturbed call: same inputs, the caller on the legacy stream, no delays (warms the kernel up)
            q, k, v = inputs(shape, seed=t)
            clean = att(comfy_attention, q, k, v, shape[1], skip_reshape=True, skip_output_reshape=True).float()
            ref = torch.nn.functional.scaled_dot_product_attention(q, k, v).float()
            torch.cuda.synchronize()
            del q, k, v
            with arm(name):
                row = one_trial(att, shape, t, clean, cycles)
            row["undisturbed_rel_l2_vs_sdpa"] = rel_l2(clean, ref)
            trials.append(row)
            del clean, ref
        res["arms"][name] = {"trials": len(trials), "corrupted": sum(r["corrupted"] for r in trials), "rows": trials}
        print(name, res["arms"][name]["corrupted"], "/", len(trials), "corrupted", flush=True)
    res["verdict"] = negative_verdict(res["arms"])
    res["ok"] = res["verdict"]["ok"]
    return res


# ------------------------------------------------------------------------- kernel streams
def classify_streams(trace_events: list[dict]) -> dict:
    """From a chrome trace's events: the legacy and side stream ids (the first and second marker
    kernel, in time order) and each other kernel's name and stream, as "legacy", "caller" or
    "other:<id>"."""
    kernels = sorted((e for e in trace_events if e.get("cat") == "kernel"), key=lambda e: e.get("ts", 0))
    markers = [e for e in kernels if MARKER in e.get("name", "")]
    if len(markers) < 2:
        return {"error": f"expected 2 marker kernels ({MARKER}), found {len(markers)}"}
    legacy_id, side_id = markers[0]["args"]["stream"], markers[1]["args"]["stream"]
    rows = []
    for e in kernels:
        if e is markers[0] or e is markers[1]:
            continue
        s = e["args"]["stream"]
        rows.append({"name": e["name"][:140], "stream": "legacy" if s == legacy_id else
                     "caller" if s == side_id else f"other:{s}"})
    on = {r["stream"] for r in rows}
    return {"legacy_stream_id": legacy_id, "caller_stream_id": side_id, "kernels": rows,
            "on_legacy": "legacy" in on, "only_legacy": on == {"legacy"}}


def stream_verdict(observed: dict, launches_on_legacy_stream: bool) -> dict:
    """The envelope's flag against what ran: the hop is needed iff any kernel ran on the legacy
    stream while the caller was on another."""
    if "error" in observed or not observed.get("kernels"):
        return {"agrees": None, "why": observed.get("error", "no kernel recorded")}
    return {"agrees": observed["on_legacy"] == launches_on_legacy_stream,
            "table_says_legacy": launches_on_legacy_stream, "observed_on_legacy": observed["on_legacy"]}


def available_kernels(only: list[str] | None) -> dict:
    """family -> Kernel for every family this environment can call (or an error string)."""
    from safe_ops.families.envelope import FAMILIES
    from safe_ops.facts.devices import runtime
    from safe_ops.families.registry import ck_kernel, families, kernel_of, sage_kernel
    from safe_ops.families.sage_dispatch import SAGE1
    rt = runtime()
    out: dict = {}
    if rt.sage_version and rt.sage_version.startswith("1."):
        out[SAGE1] = sage_kernel(rt) or "sage 1.x kernel unavailable"
    elif rt.sage_version:
        for fam in [name for name in families() if name.startswith("sage2_")]:
            out[fam] = kernel_of(fam) or "not in this build"
    out[rt.ck_family or "ck_int8"] = ck_kernel(rt) or f"comfy-kitchen: {rt.ck_error}"
    return {f: k for f, k in out.items() if (only is None or f in only) and (f in FAMILIES or isinstance(k, str))}


def profile_family(kern, shape) -> dict:
    from torch.profiler import ProfilerActivity, profile
    legacy = torch.cuda.default_stream()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        q, k, v = inputs(shape, 0)
        kern.fn(q, k, v, "HND", None)                   # warm-up (JIT, autotune) outside the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with torch.cuda.stream(legacy):
            torch.cuda._sleep(1000)
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(1000)
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            kern.fn(q, k, v, "HND", None)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    return classify_streams(events)


def kernels(args) -> dict:
    shape = tuple(int(x) for x in args.shape.split(","))
    res = {"env": env_info(), "shape_HND": shape, "families": {}}
    if args.dry_run:
        res["dry_run"] = True
        return res
    for fam, kern in available_kernels(args.families.split(",") if args.families else None).items():
        if isinstance(kern, str):
            res["families"][fam] = {"error": kern}
            continue
        try:
            obs = profile_family(kern, shape)
        except Exception as e:  # noqa: BLE001 - a family this build cannot run here: recorded
            res["families"][fam] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            continue
        obs.update(stream_verdict(obs, kern.envelope.launches_on_legacy_stream))
        res["families"][fam] = obs
        print(fam, {k: obs.get(k) for k in ("agrees", "observed_on_legacy", "table_says_legacy")}, flush=True)
    ran = [r for r in res["families"].values() if r.get("agrees") is not None]
    res["ok"] = bool(ran) and all(r["agrees"] for r in ran)
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("section", choices=("negative", "kernels"))
    ap.add_argument("--out")
    ap.add_argument("--family", default="sage2_fp8pv_perwarp", help="negative: a legacy-stream sage 2.x family")
    ap.add_argument("--families", default=None, help="kernels: only these (comma-separated)")
    ap.add_argument("--shape", default=None, help="HND B,H,S,D (default: negative 1,24,8192,128; kernels 1,8,2048,128)")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--sleep-ms", type=float, default=200.0)
    ap.add_argument("--dry-run", action="store_true", help="no GPU: the arms' patches and the output's shape only")
    args = ap.parse_args(argv)
    args.shape = args.shape or ("1,24,8192,128" if args.section == "negative" else "1,8,2048,128")
    res = negative(args) if args.section == "negative" else kernels(args)
    res["env"]["command"] = " ".join(["python3", "-m", "bench.kernels.gpu_streams"]
                                     + list(sys.argv[1:] if argv is None else argv))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print("ok" if res.get("ok") else "NOT ok" if "ok" in res else "dry run", flush=True)
    return res


if __name__ == "__main__":
    main()
