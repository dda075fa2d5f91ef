"""Which GPUs and package versions run each kernel family, in words (registry.family_users): the demo
labels every family with them, in the same words as the Preflight node's report (issue 48 item 5)."""
from __future__ import annotations

from safe_ops.facts.devices import Runtime
from safe_ops.families.registry import families, family_users
from safe_ops.families.sage_dispatch import GPU_NAMES, dispatch_archs, gpu_words, sage_family_for
from safe_ops.ui import preflight

NO_GPU = Runtime("2.13.0", None, None, None, None, None, "no CUDA device", None, None, None)


def test_every_shipped_family_but_sdpa_has_users():
    for name in families():
        words = family_users(name)
        assert bool(words) == (name != "sdpa"), (name, words)


def test_preflight_scenarios_and_family_users_use_the_same_words():
    """Each scenario a report without a GPU lists ("sm_89 (RTX 4090 / L40S) with sageattention 2.2.0")
    names its GPU as gpu_words does, and the family sageattn runs there is labelled with that GPU and
    version."""
    scenarios = preflight.scenarios_for(NO_GPU)
    assert len(scenarios) == len(preflight.COMMON_GPUS) * len(preflight.COMMON_SAGE)
    for sc in scenarios:
        assert sc.label == f"{gpu_words(sc.arch)} with sageattention {sc.sage_version}", sc.label
        words = family_users(sc.family)
        assert gpu_words(sc.arch) in words and f"with sageattention {sc.sage_version}" in words, (sc.label, words)
    # a family one arch runs through sageattn carries Preflight's label word for word
    assert "sm_89 (RTX 4090 / L40S) with sageattention 2.2.0" in family_users("sage2_sm89_fp8pv")
    assert family_users("sage2_sm90") == "sm_90 (H100 / H200) with sageattention 2.2.0"


def test_users_follow_sageattns_dispatch():
    """The archs named for a family are the ones sage_dispatch sends to it, and no other GPU is named as
    a sageattn user."""
    for name in families():
        for ver in ("2.2.0", "1.0.6"):
            archs = dispatch_archs(name, ver)
            assert archs == [a for a in GPU_NAMES if sage_family_for(ver, a) == name]
    assert "sm_120" not in family_users("sage2_sm89_fp8pv").split(";")[0]
    assert family_users("sage1_triton").endswith("with sageattention 1.0.6")
    assert "sm_120 (RTX 5090 / RTX PRO 6000 Blackwell)" in family_users("sage2_sm80")   # its move target there


def test_comfy_kitchen_families_name_their_versions_as_preflight_does():
    for version, fam in preflight.COMMON_CK:
        assert f"comfy-kitchen {version}" in family_users(fam) and "--use-ck-attention" in family_users(fam)
