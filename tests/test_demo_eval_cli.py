"""`k3chat eval-demo` refuses bad arguments before it opens any model, and says what is valid."""
from __future__ import annotations

import pytest

from k3chat.demo import evaluate, tasks


def test_an_unknown_task_is_named_with_the_valid_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert evaluate.main(["--tasks", "add_2d,documents", "--modes", "low,medium"]) == 2
    err = capsys.readouterr().err
    assert "medium, documents" in err and "add_2d" not in err.split("(")[0]
    assert "modes: low,high,max,off" in err
    assert all(name in err for name in tasks.EVAL_TASKS)


def test_n_below_one_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert evaluate.main(["--n", "0"]) == 2
    assert "--n must be >= 1" in capsys.readouterr().err
