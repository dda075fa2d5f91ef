"""bench/common/live_storage.py's tracker (issue 47 item 1): a known sequence of allocations and frees gives a
known peak, the storages live there with the line that made each, and the live bytes after each free.
bench/common/standin_families.py's sage stand-in: what it allocates is what its ``temp_bytes`` says, its
result is SDPA's."""
from __future__ import annotations

import inspect
import os
import types

import pytest

torch = pytest.importorskip("torch")

from bench.common.live_storage import LiveStorages, fit_linear, top_sites  # noqa: E402
from bench.common import standin_families  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
F32 = 4


def _line(marker: str) -> int:
    """The line of this file holding ``marker`` (a comment after an allocation)."""
    lines = inspect.getsource(inspect.getmodule(_line)).splitlines()
    hits = [i + 1 for i, ln in enumerate(lines) if ln.rstrip().endswith("# " + marker)]
    assert len(hits) == 1, marker
    return hits[0]


def _site(marker: str, fn: str) -> str:
    return f"tests/unit/test_live_storage.py:{_line(marker)}:{fn}"


def test_a_known_sequence_gives_its_peak_its_holders_and_the_bytes_after_each_free():
    with LiveStorages(depth=1, roots=(ROOT,)) as tr:
        a = torch.ones(1000)                     # alloc-a
        b = torch.ones(2000)                     # alloc-b
        assert tr.bytes == 3000 * F32
        del a                                    # freed: the next allocation must not raise the peak
        assert tr.bytes == 2000 * F32
        c = torch.ones(500)                      # alloc-c
        view = b.view(2, 1000)                   # a view: no new storage
        b.add_(1)                                # in place: no new storage
        assert tr.bytes == 2500 * F32 and tr.allocations == 3
        del b
        assert tr.bytes == 2500 * F32            # the view keeps b's storage
        del view
        assert tr.bytes == 500 * F32
        del c
    assert tr.bytes == 0 and tr.live == {}
    assert tr.peak == 3000 * F32                 # a + b; 3500 if the free of a were missed
    assert sorted((s.nbytes, s.site) for s in tr.at_peak) == [
        (1000 * F32, _site("alloc-a", "test_a_known_sequence_gives_its_peak_its_holders_and_the_bytes_after_each_free")),
        (2000 * F32, _site("alloc-b", "test_a_known_sequence_gives_its_peak_its_holders_and_the_bytes_after_each_free"))]


def _make(n):
    return torch.zeros(n)                        # alloc-in-helper


def test_sites_group_by_the_allocating_line_with_its_callers():
    keep = []
    with LiveStorages(depth=2, roots=(ROOT,)) as tr:
        for n in (100, 300):
            keep.append(_make(n))
        keep.append(torch.zeros(50))             # alloc-direct
    fn = "test_sites_group_by_the_allocating_line_with_its_callers"
    top = top_sites(tr.at_peak)
    assert [(g.bytes, g.storages) for g in top] == [(400 * F32, 2), (50 * F32, 1)]
    assert top[0].site.startswith(_site("alloc-in-helper", "_make") + " < tests/unit/test_live_storage.py:")
    assert top[0].site.endswith(f":{fn}") and top[0].shapes == [[100], [300]]
    assert top[1].site.split(" < ")[0] == _site("alloc-direct", fn)
    assert [g.bytes for g in top_sites(tr.at_peak, n=1)] == [400 * F32]


def test_inputs_count_under_their_label_and_a_result_written_into_an_input_is_not_new():
    x = torch.ones(256)
    with LiveStorages(roots=(ROOT,)) as tr:
        tr.add(x, "the input")
        torch.mul(x, 2, out=x)
        y = x * 2                                                                   # noqa: F841
    assert tr.allocations == 2 and tr.peak == 512 * F32
    assert {s.site for s in tr.at_peak if s.label} == {"the input"}


def test_the_peak_is_taken_only_inside_windows_each_window_has_its_own():
    with LiveStorages(window=False) as tr:
        big = torch.ones(10_000)                 # outside every window: tracked, not a peak
        del big
        tr.enter("block")
        a = torch.ones(1000)
        tr.enter("mlp")
        b = torch.ones(3000)
        del b
        tr.leave()
        c = torch.ones(2000)
        del a, c
        tr.leave()
        d = torch.ones(20_000)                   # after the windows: not a peak                 # noqa: F841
    assert tr.peak == 4000 * F32 and tr.peak_phase == "mlp"
    assert tr.phase_peaks == {"block": 3000 * F32, "mlp": 4000 * F32}


def test_fit_linear_is_exact_on_a_line_and_needs_two_xs():
    a, b, resid = fit_linear([1000, 2000, 4000], [7 + 3 * x for x in (1000, 2000, 4000)])
    assert (round(a, 6), round(b, 9), round(resid, 6)) == (7, 3, 0)
    with pytest.raises(ValueError):
        fit_linear([5, 5], [1, 2])


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_the_sage_stand_in_allocates_its_temp_bytes_at_its_peak_and_returns_sdpa(layout):
    b, h, s, d = 1, 4, 200, 64                   # 200 keys: the transposed V pads to 256
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(b, s, 3 * h * d, generator=g).to(torch.bfloat16)
    q, k, v = (t.view(b, s, h, d) for t in qkv.split(h * d, -1))          # NHD views, H3's strides
    if layout == "HND":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    with LiveStorages() as tr:
        out = standin_families.sage_like(q, k, v, layout, None)
    hnd = (lambda t: t) if layout == "HND" else (lambda t: t.transpose(1, 2))
    call = types.SimpleNamespace(q=types.SimpleNamespace(shape=(b, h, s, d)),
                                 k=types.SimpleNamespace(shape=(b, h, s, d)), elt_bytes=2)
    assert tr.peak == standin_families.sage_like_temp_bytes(call)
    assert out.is_contiguous() and out.shape == q.shape
    ref = torch.nn.functional.scaled_dot_product_attention(hnd(q).float(), hnd(k).float(), hnd(v).float())
    assert (hnd(out).float() - ref).abs().max() < 2e-2
