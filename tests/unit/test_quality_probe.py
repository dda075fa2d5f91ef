"""The quality guard's measurement pieces (safe_ops/quality/probe.py)."""
import pytest

torch = pytest.importorskip("torch")

from safe_ops.quality.probe import reference, rel_error, sample_rows  # noqa: E402


def _qkv(heads_k=4):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, 4, 16, 32, generator=g), torch.randn(1, heads_k, 64, 32, generator=g),
            torch.randn(1, heads_k, 64, 32, generator=g))


def test_reference_without_comfys_function_is_the_packs_sdpa_in_head_groups_too():
    q, k, v = _qkv()
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    whole = reference(None, q, k, v, None, None)
    grouped = reference(None, q, k, v, None, 16 * 64 * 4)          # one head per launch
    assert rel_error(whole, want) < 1e-5 and rel_error(grouped, want) < 1e-5


def test_reference_calls_comfys_function_per_head_group():
    q, k, v = _qkv()
    heads_seen = []

    def comfy(q, k, v, heads, skip_reshape=False, skip_output_reshape=False, **kw):
        heads_seen.append(heads)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)
    reference(comfy, q, k, v, None, 2 * 16 * 64 * 4)
    assert heads_seen == [2, 2]


def test_gqa_reference_and_rows_and_a_nan_never_passes():
    q, k, v = _qkv(heads_k=2)
    got = reference(None, q, k, v, None, None)
    rep = [t.repeat_interleave(2, dim=1) for t in (k, v)]
    assert rel_error(got, torch.nn.functional.scaled_dot_product_attention(q, *rep)) < 1e-5
    rows = sample_rows(10_000, torch.device("cpu"), salt=3, n=100)
    assert rows.shape == (100,) and int(rows.max()) < 10_000 and len(set(rows.tolist())) == 100
    bad = got.clone()
    bad[0, 0, 0, 0] = float("nan")
    assert rel_error(bad, got) == float("inf")
