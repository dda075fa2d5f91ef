"""The pack as a real ComfyUI server sees it: node schema, load log, validation and runtime errors."""

from __future__ import annotations

import json
import os
import re

import pytest

from tools.harness.comfy_graphs import sd2_graph
from tools.harness.comfy_server import PACK_DIR_NAME, execution_error

EXPECTED_MODULE = "custom_nodes." + PACK_DIR_NAME


def _combo_options(spec):
    """Options of a combo input in /object_info, V1 style ([[opts], {...}]) or V3 style
    (["COMBO", {"options": [...]}])."""
    if isinstance(spec[0], list):
        return spec[0]
    assert spec[0] == "COMBO", spec
    return spec[1]["options"]


def test_raylight_node_in_object_info(comfy):
    """The node that applies SafeSage in raylight's Ray workers: takes and gives raylight's RAY_ACTORS."""
    node = comfy.object_info()["SafeSageRaylight"]
    assert node["python_module"] == EXPECTED_MODULE
    req = node["input"]["required"]
    assert list(req) == ["ray_actors", "kernel", "mlp_chunking", "mlp_chunk_tokens", "verify"]
    assert req["ray_actors"][0] == "RAY_ACTORS" and node["output"] == ["RAY_ACTORS"]
    assert _combo_options(req["kernel"]) == ["auto", "sage", "sdpa"]
    for name, spec in req.items():
        assert len(spec) > 1 and spec[1].get("tooltip"), "input %r has no tooltip" % name


def test_node_in_object_info(comfy):
    info = comfy.object_info()
    assert "SafeSageAttention" in info, (
        "SafeSageAttention missing from /object_info; pack log lines:\n"
        + "\n".join(l for l in comfy.logs().splitlines() if "SafeSage" in l or "IMPORT FAILED" in l))
    node = info["SafeSageAttention"]
    assert node["python_module"] == EXPECTED_MODULE
    req = node["input"]["required"]
    assert list(req) == ["model", "kernel", "mlp_chunking", "mlp_chunk_tokens", "verify", "debug_sync"]
    assert req["model"][0] == "MODEL"
    assert _combo_options(req["kernel"]) == ["auto", "sage", "sdpa"]
    assert _combo_options(req["mlp_chunking"]) == ["auto", "off", "tokens"]
    assert _combo_options(req["verify"]) == ["first", "every", "off"]
    assert req["mlp_chunk_tokens"][0] == "INT"
    assert req["debug_sync"][0] == "BOOLEAN"
    assert req["debug_sync"][1].get("default") is False
    for name, spec in req.items():
        assert len(spec) > 1 and spec[1].get("tooltip"), "input %r has no tooltip" % name
    assert node["output"] == ["MODEL"]
    # the description says what the node does: no fences (buffers "kept alive until the GPU has
    # finished") since the stream-ordered executor -- issue 26, point 8
    desc = node["description"].lower()
    assert "alive" not in desc and "made on the gpu stream that reads it" in desc, node["description"]
    # what an error of SafeSage's own code does, as patch.apply_node does it (tests/unit/test_node_contained.py)
    assert "where it could not be patched whole, unpatched (the status says why)" in desc, node["description"]
    assert "the model going in is never changed" in desc, node["description"]


def test_pack_loaded_cleanly(comfy):
    # the buffer as it stood at start-up: later prompts roll these lines out of ComfyUI's 300-entry buffer
    logs = comfy.start_logs()
    # ComfyUI's import-time summary: "<secs> seconds[ (IMPORT FAILED)]: <path>/custom_nodes/<dir>"
    lines = _import_lines(logs)
    assert lines, "no import-time line for %s in /internal/logs" % PACK_DIR_NAME
    assert not any("IMPORT FAILED" in l for l in lines), lines
    assert "Cannot import" not in logs or PACK_DIR_NAME not in "".join(
        l for l in logs.splitlines() if "Cannot import" in l)
    assert "SafeSage: IMPORT FAILED" not in logs
    # the shim of the CI venv never hides a failure of the pack itself
    assert not any("IMPORT FAILED" in l and "SafeSage" in l for l in logs.splitlines())


def _import_lines(logs):
    return [l for l in logs.splitlines() if re.search(r"seconds.*custom_nodes[/\\]%s\s*$" % re.escape(PACK_DIR_NAME), l)]


def test_start_up_lines_outlive_a_full_log_buffer(comfy):
    """ComfyUI's /internal/logs keeps its last 300 writes: after enough prompts the import-time line
    is gone from it (test_pack_loaded_cleanly failed on 783545f6 when the tests before it had run
    enough prompts). The harness keeps the buffer as it stood at start-up; this floods it first."""
    graph = {"1": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
             "2": {"class_type": "SaveLatent", "inputs": {"samples": ["1", 0], "filename_prefix": "flood"}}}
    for _ in range(40):
        if not _import_lines(comfy.logs()):
            break
        for _ in range(10):
            comfy.queue_and_wait(graph, timeout=60)
    assert not _import_lines(comfy.logs()), "400 prompts did not fill ComfyUI's log buffer"
    assert _import_lines(comfy.start_logs()), "the start-up buffer lost the import-time line"


def _errors_text(errs):
    return " ".join("%s %s" % (e.get("message", ""), e.get("details", "")) for e in errs)


def test_bad_node_input_is_rejected_with_node_errors(comfy, tiny_sd2, seed_counter):
    unet = os.path.basename(tiny_sd2["path"])
    # out of the INT input's declared range: ComfyUI itself rejects it at /prompt
    res = comfy.post_prompt(sd2_graph(unet, seed_counter(), "bad_tokens", safesage={"mlp_chunk_tokens": 1}))
    assert isinstance(res, dict), "mlp_chunk_tokens=1 was accepted (prompt id %r)" % res
    assert res["error"]["type"] == "prompt_outputs_failed_validation", res
    assert res["node_errors"]["10"]["class_type"] == "SafeSageAttention"
    assert "mlp_chunk_tokens" in _errors_text(res["node_errors"]["10"]["errors"])

    # an unknown node type
    g = sd2_graph(unet, seed_counter(), "bad_type", safesage={})
    g["10"]["class_type"] = "SafeSageAttentionDoesNotExist"
    res = comfy.post_prompt(g)
    assert isinstance(res, dict), res
    # 0.3.75 says invalid_prompt, newer ComfyUI missing_node_type; both name the node
    assert res["error"]["type"] in ("missing_node_type", "invalid_prompt"), res
    assert "SafeSageAttentionDoesNotExist" in json.dumps(res), res
    assert comfy.alive()


#: the inputs SafeSageAttention.validate_inputs takes (its combos): ComfyUI skips its own checks of these
#: and files the function's message under each of them that the prompt carries
VALIDATED = ("kernel", "mlp_chunking", "verify", "quality")


def _refused_at_validation(comfy, graph, bad_input, bad_value):
    """The body of the HTTP 400 for a graph whose SafeSageAttention (id 10) has one bad combo value,
    checked: refused before anything is queued, one error under each validated input the graph
    carries, each naming the bad input, its value and every allowed value (read from /object_info);
    the server alive. Returns the errors."""
    res = comfy.post_prompt(graph)
    assert isinstance(res, dict), "%s=%r was queued (prompt id %r), not refused at validation" % (
        bad_input, bad_value, res)
    assert res["error"]["type"] == "prompt_outputs_failed_validation", res
    assert list(res["node_errors"]) == ["10"], res["node_errors"]
    assert res["node_errors"]["10"]["class_type"] == "SafeSageAttention", res
    errs = res["node_errors"]["10"]["errors"]
    carried = [n for n in VALIDATED if n in graph["10"]["inputs"]]
    assert sorted(e["extra_info"]["input_name"] for e in errs) == sorted(carried), errs
    spec = comfy.object_info("SafeSageAttention")["SafeSageAttention"]["input"]
    allowed = _combo_options({**spec["required"], **spec.get("optional", {})}[bad_input])
    for e in errs:
        assert e["type"] == "custom_validation_failed", e
        text = _errors_text([e])
        assert bad_input in text and repr(bad_value) in text, text
        assert all(repr(a) in text for a in allowed), (allowed, text)
    assert comfy.alive()
    return errs


def test_bad_combo_value_gives_one_clear_error_under_its_input(comfy, tiny_sd2, seed_counter):
    """An unknown kernel (a hand-edited or newer workflow) is refused at validation on every
    supported ComfyUI (validate_inputs: 0.3.75 does not check V3 combo values itself), never run,
    never silently sampled with some default. ComfyUI files the node's one message under each input
    validate_inputs takes that the prompt carries (kernel, mlp_chunking, verify; no quality here:
    a workflow saved before that input existed), and that message names the input, the bad value
    and the allowed ones."""
    graph = sd2_graph(os.path.basename(tiny_sd2["path"]), seed_counter(), "bad_kernel",
                      safesage={"kernel": "flash-turbo"})
    assert "quality" not in graph["10"]["inputs"]
    errs = _refused_at_validation(comfy, graph, "kernel", "flash-turbo")
    assert len({e["details"].split(" - ", 1)[1] for e in errs}) == 1, errs  # one message, filed 3 times
    assert "mlp_chunking:" not in errs[0]["details"] and "verify:" not in errs[0]["details"], errs


@pytest.mark.parametrize("bad_input", VALIDATED)
def test_bad_value_refused_at_validation_names_input_value_and_options(comfy, tiny_sd2, seed_counter, bad_input):
    """Each combo input, a bad value with every optional input present: HTTP 400 before the run."""
    graph = sd2_graph(os.path.basename(tiny_sd2["path"]), seed_counter(), "bad_" + bad_input,
                      safesage={"quality": "balanced", bad_input: "no-such-" + bad_input})
    _refused_at_validation(comfy, graph, bad_input, "no-such-" + bad_input)


def test_bad_value_refused_at_validation_other_inputs_keep_comfys_checks(comfy, tiny_sd2, seed_counter):
    """validate_inputs takes only the combos (no **kwargs): ComfyUI still range-checks the INT inputs,
    also in a prompt that validate_inputs refuses too."""
    graph = sd2_graph(os.path.basename(tiny_sd2["path"]), seed_counter(), "bad_two",
                      safesage={"quality": "balanced", "verify": "sometimes", "exact_steps": -1})
    res = comfy.post_prompt(graph)
    assert isinstance(res, dict), res
    errs = res["node_errors"]["10"]["errors"]
    by_input = {}
    for e in errs:
        by_input.setdefault(e["extra_info"]["input_name"], []).append(e["type"])
    assert by_input.pop("exact_steps") == ["value_smaller_than_min"], errs
    assert by_input == {n: ["custom_validation_failed"] for n in VALIDATED}, errs
    # and a good prompt right after runs
    comfy.run(sd2_graph(os.path.basename(tiny_sd2["path"]), seed_counter(), "after_refused",
                        safesage={"quality": "faults only"}))


def test_runtime_error_is_reported_and_server_survives(comfy, tiny_sd2, seed_counter):
    corrupt = comfy.models_dir / "safesage_corrupt.safetensors"
    corrupt.write_bytes(b"\x00\x00\x00\x00\x00\x00\x00\x10{not a safetensors header" + os.urandom(256))
    pid = comfy.post_prompt(sd2_graph(corrupt.name, seed_counter(), "corrupt", safesage={}))
    assert isinstance(pid, str), pid
    entry = comfy.wait_history(pid)
    assert entry["status"]["status_str"] == "error"
    err = execution_error(entry)
    assert err is not None, entry["status"]
    assert err["node_type"] == "UNETLoader", err
    assert err["exception_message"], err
    assert comfy.alive()
    # and the next good prompt, through the node, still runs
    comfy.run(sd2_graph(os.path.basename(tiny_sd2["path"]), seed_counter(), "after_error", safesage={}))
