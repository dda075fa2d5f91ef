"""Where a guarded call's host time goes: each piece of the hot path timed alone (timeit, best of 5
x 20,000), then cProfile over 50,000 calls. A diagnostic beside bench/cost/host_path.py (whose numbers
are the ones reported); the null kernel and stand-in runtime are host_path's.

    python3 -m bench.cost.host_profile cuda OUT.json > LOG.txt        (GPU host)
    python3 -m bench.cost.host_profile cpu OUT.json
"""
import cProfile, pstats, io, sys, time, timeit, json
import torch
from safe_ops.attention.override import SafeAttention
from safe_ops.attention import call_forms, special_calls
from safe_ops.facts.devices import Runtime
from safe_ops.families.envelope import Envelope
from safe_ops.families.family import Kernel
from safe_ops.policy import Policy
from safe_ops.facts import compiler
from safe_ops.ui import run_stats

dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
torch.set_num_threads(1)
rt = Runtime("host-bench", None, None, None, None, None, "host-bench", None, None, None)
B, S, H, D = 1, 64, 4, 32
dt = torch.bfloat16
out_hnd = torch.zeros(B, H, S, D, device=dev, dtype=dt)
out_nhd = torch.zeros(B, S, H, D, device=dev, dtype=dt)
env = Envelope(family="null_kernel", source="prof", head_dims=(D,), dtypes=("bfloat16",),
               supports_mask=False, terms=(), devices=(dev.type,), temp_bytes=lambda call: 0)
def null_kernel(q, k, v, layout, scale):
    return out_hnd if layout == "HND" else out_nhd
def null_comfy(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False, **kw):
    return q
x3 = torch.randn(B, S, 3 * H * D, device=dev, dtype=dt)
q3, k3, v3 = x3.split(H * D, dim=-1)
q4, k4, v4 = (t.view(B, S, H, D).transpose(1, 2) for t in (q3, k3, v3))
g = SafeAttention(Policy(kernel="sage", verify="off", quality="faults only"), kernels=[Kernel(env, null_kernel)], rt=rt)
kw = {"skip_reshape": True, "skip_output_reshape": True}
args = (q4, k4, v4, H)
for _ in range(500):
    g(null_comfy, *args, **kw)
p = g.prepared_plans()[0]
print("prepared fixed", p.fixed, "envelopes", len(p.envelopes), "cuda", p.cuda, "plan", p.plan.kind)
N = 20000
res = {}
def us(name, f):
    t = min(timeit.repeat(f, number=N, repeat=5)) / N * 1e6
    res[name] = round(t, 3)
    print(f"{name:45s} {t:7.3f} us")
a = call_forms.call_arguments(args, kw)
n = p.form.bind(a, kw)
cd = q4.device
us("guarded 4d call", lambda: g(null_comfy, *args, **kw))
us("guarded 3d call", lambda: g(null_comfy, q3, k3, v3, H))
us("kernel alone 4d", lambda: null_kernel(q4, k4, v4, "HND", None))
us("t.device", lambda: q4.device)
us("t.get_device()", lambda: q4.get_device())
us("t.is_cuda", lambda: q4.is_cuda)
us("t.shape", lambda: q4.shape)
us("t.stride()", lambda: q4.stride())
us("t.dtype", lambda: q4.dtype)
us("t.data_ptr()", lambda: q4.data_ptr())
us("t.transpose(1,2)", lambda: q4.transpose(1, 2))
us("t.view(B,S,H,D)", lambda: q3.view(B, S, H, D))
us("dev.type", lambda: cd.type)
us("hash(dev)", lambda: hash(cd))
dev.type == "cuda" and us("torch.cuda.is_current_stream_capturing", torch.cuda.is_current_stream_capturing)
dev.type == "cuda" and us("torch._C._cuda_isCurrentStreamCapturing", torch._C._cuda_isCurrentStreamCapturing)
us("special_calls.capturing", special_calls.capturing)
dev.type == "cuda" and us("torch.cuda.current_stream()", torch.cuda.current_stream)
us("torch.compiler.is_compiling", special_calls.torch_is_compiling)
us("call_arguments", lambda: call_forms.call_arguments(args, kw))
us("signature+dict get", lambda: g.prepared_for(null_comfy, *args, **kw))
us("form.bind", lambda: p.form.bind(a, kw))
us("plan_now (the plan under the budget now)", lambda: g.plan_now(p))
us("compiler.enabled_now", lambda: compiler.enabled_now(cd))
us("budget (the plans' reader)", lambda: g.probe_budget(cd))
us("run_stats.counts", run_stats.counts)
us("executor.run", lambda: g.executor.run(p.plan, n))
us("attend_prepared", lambda: g.attend_prepared(p, p.form.bind(a, kw), null_comfy))
us("n.finish", lambda: n.finish(out_hnd, "HND"))
pr = cProfile.Profile()
pr.enable()
for _ in range(50000):
    g(null_comfy, *args, **kw)
pr.disable()
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
print(s.getvalue())
json.dump({"command": "python3 -m bench.cost.host_profile " + " ".join(sys.argv[1:]), "us": res},
          open(sys.argv[2], "w") if len(sys.argv) > 2 else sys.stdout, indent=1)
