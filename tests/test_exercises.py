"""The course's exercises (q35lab.exercises): each solution passes its check, an untouched skeleton
falls back to the solution, and a wrong or half-written attempt fails with the case that broke."""

import pytest
import torch

from q35lab import exercises

EXERCISES = [
    (exercises.row_softmax, exercises.check_row_softmax),
    (exercises.scale_grad, exercises.check_scale_grad),
    (exercises.log_softmax_wide, exercises.check_log_softmax_wide),
    (exercises.second_difference, exercises.check_second_difference),
]
NAMES = [solution.__name__ for solution, _ in EXERCISES]


@pytest.mark.parametrize("solution, check", EXERCISES, ids=NAMES)
def test_the_solution_passes_its_check(solution, check, capsys):
    results = check(solution)
    assert len(results) == 6 and all(r.ok for r in results)
    assert "not written yet" not in capsys.readouterr().out


@pytest.mark.parametrize("solution, check", EXERCISES, ids=NAMES)
def test_an_untouched_skeleton_is_named_and_the_solution_checked_instead(solution, check, capsys):
    calls = []

    def skeleton(*inputs):  # what a skeleton's host returns before its kernel is written: its NaN fill
        calls.append(inputs)
        return torch.full_like(solution(*inputs), float("nan"))

    results = check(skeleton)
    assert calls and all(r.ok for r in results)
    assert "not written yet" in capsys.readouterr().out


@pytest.mark.parametrize("solution, check", EXERCISES, ids=NAMES)
def test_a_wrong_attempt_fails_naming_the_exercise(solution, check):
    with pytest.raises(AssertionError, match="fail the numerics rule"):
        check(lambda *inputs: solution(*inputs) * 1.01)


def test_a_half_written_kernel_fails_where_it_wrote_nothing():
    def half(x):  # the softmax of every row but the last
        y = exercises.row_softmax(x)
        y[-1] = float("nan")
        return y

    with pytest.raises(AssertionError, match=r"\[7, 1000\]"):
        exercises.check_row_softmax(half)


def test_the_check_wants_a_host_function_returning_a_tensor():
    with pytest.raises(TypeError, match="expected your host function"):
        exercises.check_scale_grad(None)
    with pytest.raises(TypeError, match="expected a tensor"):
        exercises.check_second_difference(lambda x: x.tolist())
