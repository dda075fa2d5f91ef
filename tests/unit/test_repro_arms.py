"""bench/repro's single-kernel arms and its prompts 1-3 of one server (issue 46 goal 8), without a server:
an arm whose ComfyUI flag the tree lacks is a skipped row (no server started), sage_sm80's own emulated
arch wins over the run's, later prompts save their latents and the guard's state, the driver compares
each later prompt with the same prompt of the PyTorch and unguarded arms, and kept latents / the
verdict's run identity key on a synthetic checkpoint's settings (its drift: the same bytes either way)."""
import argparse
import json
import os
import struct
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from bench.common import synth_h3  # noqa: E402
from bench.repro import arms, driver, verdict, worker  # noqa: E402


def _tree(tmp_path, *flags):
    """A stand-in ComfyUI tree whose comfy/cli_args.py defines ``flags``."""
    root = tmp_path / "comfy_tree"
    (root / "comfy").mkdir(parents=True)
    (root / "comfy" / "cli_args.py").write_text(
        "".join(f'attn_group.add_argument("{f}", action="store_true")\n' for f in flags))
    return root


def test_missing_flags_reads_the_trees_own_cli_args(tmp_path):
    root = _tree(tmp_path, "--use-sage-attention", "--cpu")
    assert worker.missing_flags(root, ["--use-ck-attention", "--use-sage-attention"]) == ["--use-ck-attention"]
    assert worker.missing_flags(root, arms.comfy_flags("sage_sm80")) == []
    assert worker.missing_flags(tmp_path / "nowhere", ["--use-ck-attention"]) == []     # ComfyUI then says


def test_the_ck_arm_on_a_tree_without_the_flag_is_skipped_without_a_server(tmp_path, monkeypatch):
    root = _tree(tmp_path, "--use-sage-attention", "--cpu")
    monkeypatch.setattr(worker, "make_server", lambda **kw: pytest.fail("a server was made"))
    row = worker.run_row(comfy=root, ckpt=tmp_path / "x.safetensors", arm="ck", size="tiny", work=tmp_path / "w")
    assert row["rc"] == "unsupported" and row["outcome"] == "skipped: this ComfyUI has no --use-ck-attention"
    assert "--use-ck-attention" in row["error"] and row["latent"] is None
    assert arms.ARMS["ck"]["safesage"] is None and arms.comfy_flags("ck") == ["--use-ck-attention"]


def test_sage_sm80s_own_arch_wins_over_the_runs(tmp_path):
    ckpt = tmp_path / "m.safetensors"
    ckpt.write_bytes(b"")
    envs = {}
    for arm in ("sage_sm80", "sage"):
        server, _, _ = worker.make_server(comfy=tmp_path, ckpt=ckpt, arm=arm, tag=arm, work=tmp_path / "w",
                                          emulate_arch="sm120")
        envs[arm] = server.env["SAFESAGE_REPRO_EMULATE_ARCH"]
    assert envs == {"sage_sm80": "sm80", "sage": "sm120"}


class _Server:
    """queue_and_wait writes the latent the graph names, as SafeSageReproSaveLatent does."""

    def __init__(self, probe_out):
        self.probe_out, self.graphs, self.probes = probe_out, [], 50

    def queue_and_wait(self, graph, timeout):
        self.graphs.append(graph)
        path = graph["11"]["inputs"]["path"]
        if path:
            Path(path).write_bytes(b"latent")
        self.probe_out.write_text(json.dumps({"s_per_step": [1.0, 0.5]}))
        return {"status": {"status_str": "success"}}


def test_later_prompts_save_their_latents_and_the_guards_state(tmp_path):
    from bench.repro import workflow
    srv = _Server(tmp_path / "probe.json")
    first = tmp_path / "38k_safesage.pt"
    out = worker.later_prompts(
        srv, lambda i, path: workflow.row_graph("m", 64, 64, 22, 16, 2, 77 + 1000 * i, path, {}), 3,
        srv.probe_out, 10.0, latent_of=lambda i: worker.prompt_latent(first, i + 1),
        quality=lambda: {"quality": {"probes": 50}})
    assert [p["prompt"] for p in out] == [2, 3]
    assert [Path(p["latent"]).name for p in out] == ["38k_safesage.p2.pt", "38k_safesage.p3.pt"]
    assert all(p["safesage_quality"] == {"quality": {"probes": 50}} for p in out)
    # each later prompt has its own seeds: ComfyUI's cache re-runs the sampler
    assert [g["5"]["inputs"]["noise_seed"] for g in srv.graphs] == [1077, 2077]


def _lat(x):
    return {"video": torch.full((2, 3), float(x)), "audio": torch.full((4,), float(x))}


def test_each_later_prompt_is_compared_with_the_same_prompt_of_pytorch_and_unguarded():
    runs = [{"size": "38k", "arm": a, "worker": {"later_prompts": [{"prompt": 2}, {"prompt": 3}]}}
            for a in ("pytorch", "sage", "safesage")]
    later = {("38k", "pytorch", 2): _lat(1), ("38k", "pytorch", 3): _lat(2),
             ("38k", "sage", 2): _lat(1.5), ("38k", "safesage", 2): _lat(1.5), ("38k", "safesage", 3): _lat(2.2)}
    driver.compare_later(runs, "38k", later)
    p2, p3 = runs[2]["worker"]["later_prompts"]
    assert p2["rel_l2_vs_pytorch"] == pytest.approx(0.5) and p3["rel_l2_vs_pytorch"] == pytest.approx(0.1)
    assert p2["unguarded_arm"] == "sage" and p2["rel_l2_vs_unguarded"] == pytest.approx(0.0)
    assert "rel_l2_vs_unguarded" not in p3                   # sage's prompt 3 did not run
    assert runs[1]["worker"]["later_prompts"][1] == {"prompt": 3}


def _synth_file(path, drift):
    """A file with a safetensors header recording bench.common.synth_h3 settings (no tensors)."""
    meta = {synth_h3.SETTINGS_KEY: json.dumps({"seed": 0, "drift": drift})}
    header = json.dumps({"__metadata__": meta}).encode().ljust(256)     # one size for either drift
    path.write_bytes(struct.pack("<Q", len(header)) + header)


def test_kept_latents_key_on_the_checkpoints_settings(tmp_path):
    ckpt, keep = tmp_path / "h3.safetensors", tmp_path / "keep"
    _synth_file(ckpt, None)
    a = argparse.Namespace(keep_latents=str(keep), ckpt=str(ckpt), steps=2, seed=77, emulate_arch="sm120", cpu=False)
    doc = {}
    assert driver._latent_store(a, doc) == {}
    for name in (driver.kept_name("38k", "pytorch"), driver.kept_name("38k", "safesage", 3), "38k_nonarm.pt"):
        (keep / name).write_bytes(b"x")
    found = driver._latent_store(a, doc)
    assert sorted(found) == [("38k", "pytorch", 1), ("38k", "safesage", 3)]
    assert doc["earlier_latents"] == ["38k:pytorch", "38k:safesage:p3"]
    st = ckpt.stat()
    _synth_file(ckpt, {"synthetic": True, "factor": 16.0})       # same size and mtime, another drift
    os.utime(ckpt, (st.st_atime, st.st_mtime))
    assert ckpt.stat().st_size == st.st_size
    assert driver._latent_store(a, doc) == {}                      # the store was made for the other checkpoint


def test_the_verdicts_run_identity_tells_a_drifted_checkpoint_apart():
    base = {"checkpoint": {"bytes": 10, "blocks": 50}, "steps": 2, "seed": 77, "command": "x --emulate-arch sm120"}
    drifted = dict(base, checkpoint_settings={"drift": {"synthetic": True, "factor": 16.0}})
    assert verdict._run_identity(base) != verdict._run_identity(drifted)
    assert verdict._run_identity(base) == verdict._run_identity(dict(base, checkpoint_settings={"drift": None}))
