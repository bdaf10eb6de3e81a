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


@pytest.mark.parametrize("bad", ["0", "-3", "two"])
def test_a_thread_count_below_one_is_refused(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert evaluate.main(["--threads", bad]) == 2
    assert "--threads: expected a positive integer" in capsys.readouterr().err


def test_eval_demo_runs_the_small_demo_on_one_thread_unless_told(monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Two threads decode the demo several times slower than one (runtime.SMALL_MODEL_HIDDEN):
    eval-demo takes the same default as `run --demo` and the app; --threads still wins."""
    from k3engine import model as engine_model
    from k3chat.runtime import default_threads

    assert default_threads(256, None) == 1 and default_threads(256, 2) == 2
    assert default_threads(7168, None) >= 1 and default_threads(7168, 3) == 3
    counts: list[int] = []
    real = engine_model.Model.set_threads

    def spy(self: engine_model.Model, n: int) -> None:
        counts.append(n)
        real(self, n)

    monkeypatch.setattr(engine_model.Model, "set_threads", spy)
    args = ["--n", "1", "--tasks", "add_1d", "--modes", "off"]
    assert evaluate.main(args) == 0
    assert counts and counts[-1] == 1, counts
    counts.clear()
    assert evaluate.main(args + ["--threads", "2"]) == 0
    assert counts[-1] == 2, counts
    assert "add_1d" in capsys.readouterr().out
