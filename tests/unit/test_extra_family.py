"""A kernel family defined in one file inside the tests (fake_family.py), with no file of the pack edited:
registered through SAFESAGE_EXTRA_FAMILIES (the mechanism a ComfyUI server started with it uses too), it is
detected on this runtime, checked, planned, run, verified and shown in the run statistics end to end."""
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

SCRIPT = r"""
import json, torch
import fake_family
from safe_ops.families import registry
from safe_ops.families.envelope import FAMILIES, AttnCall, TensorDesc, check
from safe_ops.attention.override import SafeAttention
from safe_ops.facts.devices import Runtime
from safe_ops.policy import Policy
from safe_ops.ui import run_stats

rt = Runtime("test", None, None, None, None, None, "test", None, None, None)    # a machine without CUDA
out = {"installed": [k.family for k in registry.installed_kernels(rt)], "registered": fake_family.NAME in FAMILIES}
if out["registered"]:
    S, heads, d = 1400, 4, 16                       # H3-shaped strided q/k/v views of one [S, 3*heads*d] buffer
    qkv = torch.randn(S, 3 * heads * d, generator=torch.Generator().manual_seed(0))
    q, k, v = [t.view(S, heads, d).transpose(0, 1).unsqueeze(0) for t in qkv.split(heads * d, -1)]
    desc = lambda t: TensorDesc(tuple(t.shape), tuple(t.stride()))
    out["violations"] = [str(x) for x in check(AttnCall(desc(q), desc(k), desc(v), "float32", "HND", False, "cpu"),
                                              FAMILIES[fake_family.NAME])]
    att = SafeAttention(Policy(kernel="sage", verify="first"), rt=rt)
    out["candidates"] = att.candidates(None)
    got = att(None, q, k, v, heads, skip_reshape=True, skip_output_reshape=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    out["err"] = float((got.double() - ref).norm() / ref.norm())
    out["launches"] = len(fake_family.LAUNCHES)
    out["stats"] = {k: v for k, v in run_stats.snapshot().items() if k in
                    ("plans", "probes", "probe_failures", "fallbacks", "attention_calls")}
print("RESULT " + json.dumps(out))
"""


def run(extra):
    env = {k: v for k, v in os.environ.items() if k != "SAFESAGE_EXTRA_FAMILIES"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE)])
    env["CUDA_VISIBLE_DEVICES"] = ""
    if extra:
        env["SAFESAGE_EXTRA_FAMILIES"] = extra
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.split("RESULT ", 1)[1])


def test_a_family_from_one_test_file_runs_end_to_end():
    r = run("fake_family")
    assert r["registered"] and r["installed"] == ["fake_cpu16"]                 # detected on this runtime
    assert r["candidates"] == ["fake_cpu16", "sdpa"]
    assert r["violations"] and all("fake_quant" in v for v in r["violations"])    # checked: the views cross it
    (plan,) = r["stats"]["plans"].values()
    assert plan.startswith(("head_groups on fake_cpu16", "repack on fake_cpu16", "query_chunks on fake_cpu16")), plan
    assert r["launches"] >= 1 and r["err"] < 1e-5                                # run, every launch in its envelope
    assert r["stats"]["probes"] == 1 and r["stats"].get("probe_failures", 0) == 0   # verified
    assert r["stats"]["fallbacks"] == 0 and r["stats"]["attention_calls"] == 1


def test_without_the_variable_there_is_no_such_family():
    r = run(None)
    assert not r["registered"] and r["installed"] == []


def test_a_module_that_cannot_load_is_left_out():
    r = run("no_such_family_module,fake_family")
    assert r["installed"] == ["fake_cpu16"]
