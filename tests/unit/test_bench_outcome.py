"""bench/kernels/gpu_attention.py's verdict on an unguarded child: the GPU test
``test_unguarded_call_faults_or_is_wrong_in_a_subprocess`` and every stress table trust it."""

import pytest

ga = pytest.importorskip("bench.kernels.gpu_attention", reason="bench/kernels/gpu_attention.py needs torch")

GOOD = {"worst_head_rel_err": 0.01, "finite": True, "tail_worst_row_rel_err": 0.02}


def test_clean_exit_within_tolerance_is_correct():
    assert ga.outcome(0, "", GOOD, 0.05) == "correct"


@pytest.mark.parametrize("bad", [{"worst_head_rel_err": 0.6}, {"finite": False},
                                 {"tail_worst_row_rel_err": 186.0}])
def test_clean_exit_with_bad_numbers_is_wrong(bad):
    assert ga.outcome(0, "", {**GOOD, **bad}, 0.05) == "wrong"


def test_cuda_fault_and_signal_are_faults():
    tail = "RuntimeError: Triton Error [CUDA]: an illegal memory access was encountered"
    assert ga.outcome(1, tail, {}, 0.05) == "fault"
    assert ga.outcome(-6, "Fatal Python error: Aborted", {}, 0.05) == "fault"


def test_a_build_refusing_the_call_is_not_a_fault():
    # what an 8.9 build's sageattn says on an H200 (seen on the GPU, session 3)
    tail = 'AssertionError: SM90 kernel is not available. Make sure you GPUs with compute capability 9.0.'
    assert ga.outcome(1, tail, {}, 0.05) == "error"
