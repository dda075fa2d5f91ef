"""The H3 block index patch (safe_ops/quality/blocks.py): it sets block_index, chains what was there, contains its
own error, and torch.compile traces it without a graph break (it runs inside H3's compiled block loop)."""
import pytest

torch = pytest.importorskip("torch")

from safe_ops.quality.blocks import BlockIndex  # noqa: E402


def block(args):
    return {"img": args["img"] * 2 + args["transformer_options"]["block_index"]}


def test_sets_the_index_and_runs_the_block_or_the_chained_replacement():
    seen = []

    def previous(args, extra):
        seen.append(args["transformer_options"]["block_index"])
        return extra["original_block"](args)

    to = {}
    out = BlockIndex(3, None)({"img": torch.ones(2), "transformer_options": to}, {"original_block": block})
    assert to["block_index"] == 3 and torch.equal(out["img"], torch.full((2,), 5.0))
    BlockIndex(7, previous)({"img": torch.ones(2), "transformer_options": {}}, {"original_block": block})
    assert seen == [7]


def test_compiled_without_a_graph_break():
    patch = BlockIndex(2, None)

    def forward(x):
        to = {"block_index": 0}
        return patch({"img": x, "transformer_options": to}, {"original_block": block})["img"]

    torch._dynamo.reset()
    expl = torch._dynamo.explain(forward)(torch.ones(3))
    assert expl.graph_break_count == 0, expl.break_reasons
    assert torch.equal(torch.compile(forward, fullgraph=True)(torch.ones(3)), torch.full((3,), 4.0))


def test_its_own_error_is_contained_the_blocks_passes_through(monkeypatch):
    patch = BlockIndex(1, None)
    monkeypatch.setattr(BlockIndex, "mark", lambda self, args: (_ for _ in ()).throw(RuntimeError("ours")))
    out = patch({"img": torch.ones(1), "transformer_options": {"block_index": 0}}, {"original_block": block})
    assert torch.equal(out["img"], torch.full((1,), 2.0))           # the block ran, unmarked

    def bad_block(args):
        raise ValueError("ComfyUI's block")
    with pytest.raises(ValueError, match="ComfyUI's block"):
        patch({"img": torch.ones(1), "transformer_options": {}}, {"original_block": bad_block})
