"""`k3chat eval-demo`: bad arguments are refused before any model opens, saying what is valid; each
accuracy comes with its 95% interval."""
from __future__ import annotations

import json
from pathlib import Path

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


@pytest.mark.parametrize(("right", "n", "lo", "hi"), [
    # Newcombe (1998), "Two-sided confidence intervals for the single proportion", Stat. Med.
    # 17:857-872, Table I, method 3 (Wilson score interval without continuity correction)
    (81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718),
])
def test_the_interval_beside_each_accuracy_is_wilsons(right: int, n: int, lo: float, hi: float) -> None:
    got = evaluate.wilson_interval(right, n)
    assert got == pytest.approx((lo, hi), abs=5e-5)


def test_the_table_and_the_json_carry_each_tasks_interval(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "eval.json"
    assert evaluate.main(["--n", "2", "--tasks", "add_1d,other", "--modes", "low,off", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    table = capsys.readouterr().out
    assert "95% CI" in table.splitlines()[0]
    for name, r in result["tasks"].items():
        right = round(r["accuracy"] * r["n"])
        assert r["n"] == 4 and r["ci95"] == pytest.approx(list(evaluate.wilson_interval(right, 4)))
        assert r["ci95"][0] <= r["accuracy"] <= r["ci95"][1]
        lo, hi = r["ci95"]
        assert f"{100 * lo:.0f}-{100 * hi:.0f}%" in next(ln for ln in table.splitlines() if ln.startswith(name))
    assert 0.0 <= result["well_formed_ci95"][0] <= result["well_formed"] <= result["well_formed_ci95"][1] <= 1.0


def test_failures_list_every_wrong_answer_and_only_those(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "eval.json"
    # document: the shipped demo gets about half of it wrong (README); add_1d: all right
    assert evaluate.main(["--n", "2", "--tasks", "document,add_1d", "--modes", "low,off", "--failures",
                          "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    printed = capsys.readouterr().out
    wrong = {name: r["n"] - round(r["accuracy"] * r["n"]) for name, r in result["tasks"].items()}
    assert sum(wrong.values()) == len(result["failures"]) > 0
    assert f"{len(result['failures'])} wrong:" in printed
    for f in result["failures"]:
        assert f["got"] != f["expected"] or not f["well_formed"]
        if f["task"] == "document":                      # asked about a file, answered a number
            assert "==== attachment 1 of 1" in f["question"]
            assert f["expected"].lstrip("-").isdigit()
        assert f"{f['task']}/{f['mode']}: " in printed
    assert {f["task"] for f in result["failures"]} <= {"document", "add_1d"}
    assert sum(1 for ln in printed.splitlines() if ln.startswith(("document/", "add_1d/"))) == len(result["failures"])


def _result(seed: int, **acc: tuple[float, int]) -> dict[str, object]:
    return {"tasks": {t: {"accuracy": a, "n": n} for t, (a, n) in acc.items()}, "well_formed": 1.0,
            "seed": seed, "per_task_and_mode": 5, "modes": ["low", "off"]}


def test_the_comparison_puts_each_task_beside_the_earlier_result() -> None:
    before = _result(7, add_2d=(0.75, 40), count=(0.5, 40))
    before["well_formed"] = 0.98
    now = _result(7, add_2d=(1.0, 40), count=(0.25, 40), repeat=(0.0, 40))
    rows = {ln.split()[0]: ln.split()[1:] for ln in evaluate.format_comparison(before, now, "old.json").splitlines()[2:]}
    assert rows["add_2d"] == ["75.0%", "100.0%", "+25.0"]
    assert rows["count"] == ["50.0%", "25.0%", "-25.0"]
    assert rows["repeat"] == ["-", "0.0%"]                         # not scored before: not in the sum
    assert rows["sum"] == ["125.0", "125.0", "+0.0"]
    assert rows["well-formed"] == ["98.0%", "100.0%", "+2.0"]
    assert "not the same questions" not in evaluate.format_comparison(before, now, "old.json")
    assert "not the same questions" in evaluate.format_comparison(_result(8, add_2d=(1.0, 40)), now, "x")


def test_the_comparison_adds_up_as_printed() -> None:
    # 81.25 and 63.75 show as 81.2 and 63.8: the change and the sum must be of what is shown
    before = _result(7, add_2d=(0.8125, 80), count=(0.6375, 80), compare=(0.7125, 80))
    now = _result(7, add_2d=(0.9375, 80), count=(0.4125, 80), compare=(0.8875, 80))
    rows = {ln.split()[0]: ln.split()[1:] for ln in evaluate.format_comparison(before, now, "x").splitlines()[2:]}
    shown = {t: (float(v[0].rstrip("%")), float(v[1].rstrip("%")), float(v[2])) for t, v in rows.items()}
    for task, (a, b, change) in shown.items():
        assert round(b - a, 1) == change, (task, rows[task])
    tasks_only = [v for t, v in shown.items() if t not in ("sum", "well-formed")]
    assert round(sum(a for a, _, _ in tasks_only), 1) == shown["sum"][0]
    assert round(sum(b for _, b, _ in tasks_only), 1) == shown["sum"][1]


@pytest.mark.parametrize("text, says", [
    (None, "cannot read"),
    ("{not json", "is not JSON"),
    ('{"tasks": {"add_2d": {"accuracy": "high"}}, "well_formed": 1}', "is not an eval-demo result"),
    ("[1, 2]", "is not an eval-demo result"),
])
def test_a_bad_file_to_compare_with_is_refused_before_any_question_runs(
        text: str | None, says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    def no_eval(*a: object, **k: object) -> None:
        raise AssertionError("the evaluation ran")

    monkeypatch.setattr(evaluate, "evaluate", no_eval)
    path = tmp_path / "before.json"
    if text is not None:
        path.write_text(text)
    assert evaluate.main(["--n", "1", "--tasks", "add_1d", "--compare", str(path)]) == 2
    err = capsys.readouterr().err
    assert "--compare" in err and says in err and str(path) in err


def test_comparing_a_run_with_itself_changes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "first.json"
    assert evaluate.main(["--n", "1", "--tasks", "add_1d,count", "--modes", "low", "--json", str(out)]) == 0
    capsys.readouterr()
    assert evaluate.main(["--n", "1", "--tasks", "add_1d,count", "--modes", "low", "--compare", str(out)]) == 0
    printed = capsys.readouterr().out.split(f"compared with {out}\n", 1)[1].splitlines()
    first = json.loads(out.read_text())
    assert [ln.split()[0] for ln in printed[1:]] == ["add_1d", "count", "sum", "well-formed"]
    assert all(ln.split()[-1] == "+0.0" for ln in printed[1:])
    total = sum(100 * r["accuracy"] for r in first["tasks"].values())
    assert printed[3].split()[1] == f"{total:.1f}"
