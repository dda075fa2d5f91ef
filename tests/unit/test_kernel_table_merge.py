"""bench/common/tables.py merge_into_table: the one way a measured run enters safe_ops/facts/kernel_table.json
(``tables.py --update-table`` and ``gpu_kvchunks.py --update-table`` both call it)."""
import json


def test_merge_replaces_measured_keeps_others_and_names_each_source_once(bench_tables, tmp_path):
    path = tmp_path / "kernel_table.json"
    path.write_text(json.dumps({"about": "a", "archs": {"sm_90": {
        "gpu": "H200", "tflops": {"sdpa": 550.0, "sage2_sm80": 459.7}, "sizes": [38000], "source": "one.json: cmd"}}}))
    entry = bench_tables.merge_into_table("sm_90", "NVIDIA H200", {"sdpa": 556.1, "sage2_sm86_triton": 460.1},
                                          [230000, 38000], "two.json: cmd2", table_path=str(path))
    assert entry["tflops"] == {"sage2_sm80": 459.7, "sage2_sm86_triton": 460.1, "sdpa": 556.1}
    assert entry["sizes"] == [38000, 230000] and entry["gpu"] == "NVIDIA H200"
    assert entry["source"] == "one.json: cmd | two.json: cmd2"
    bench_tables.merge_into_table("sm_90", "NVIDIA H200", {"sdpa": 556.1}, [], "two.json: cmd2", about="b",
                                  table_path=str(path))
    doc = json.loads(path.read_text())
    assert doc["archs"]["sm_90"]["source"] == "one.json: cmd | two.json: cmd2" and doc["about"] == "b"
    # a new arch starts its own entry; the measured one is untouched
    bench_tables.merge_into_table("sm_120", "RTX 5090", {"sdpa": 200.0}, [74000], "three.json", table_path=str(path))
    doc = json.loads(path.read_text())
    assert doc["archs"]["sm_120"]["tflops"] == {"sdpa": 200.0} and doc["archs"]["sm_90"]["tflops"]["sdpa"] == 556.1
