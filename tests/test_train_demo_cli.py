"""`k3chat train-demo` refuses bad arguments before torch is needed, saying which and why."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from k3chat.demo import train


@pytest.mark.parametrize("args, said", [
    (["--copy-warmup", "-1"], "--copy-warmup must be >= 0"),
    (["--copy-mix", "-2"], "--copy-mix must be >= 0"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--copy-mix-from", "-1"], "--copy-mix-from must be >= 0"),
    (["--copy-mix-from", "100"], "--copy-mix-from needs --copy-mix ROWS"),
    (["--copy-mix", "8", "--copy-mix-from", "2500"], "--copy-mix-from must be below --steps (2500)"),
    (["--copy-mix", "8", "--steps", "10", "--copy-mix-from", "10"], "must be below --steps (10)"),
    (["--copy-mix-until", "-1"], "--copy-mix-until must be >= 0"),
    (["--copy-mix-until", "500"], "--copy-mix-until needs --copy-mix ROWS"),
    (["--copy-words-only"], "--copy-words-only needs --copy-mix ROWS"),
    (["--copy-mix-from", "5", "--copy-mix-until", "9"], "--copy-mix-from and --copy-mix-until need --copy-mix"),
    (["--copy-mix", "8", "--copy-mix-until", "2501"], "--copy-mix-until must be above --copy-mix-from (0) and at most --steps (2500)"),
    (["--copy-mix", "8", "--copy-mix-from", "40", "--copy-mix-until", "40"], "above --copy-mix-from (40)"),
    (["--recall-mix", "-1"], "--recall-mix must be >= 0"),
    (["--recall-mix-until", "-3"], "--recall-mix-until must be >= 0"),
    (["--recall-mix-until", "100"], "--recall-mix-until needs --recall-mix ROWS"),
    (["--recall-mix", "8", "--recall-mix-until", "2501"], "--recall-mix-until must be at most --steps (2500)"),
    (["--lr", "0"], "--lr must be > 0"),
    (["--final-lr", "1.5"], "--final-lr must be a fraction of --lr from 0 to 1, not 1.5"),
    (["--final-lr", "-0.01"], "--final-lr must be a fraction"),
    (["--final-lr", "nan"], "--final-lr must be a fraction"),
    (["--count-weight", "0.5"], "--count-weight must be from 1 to 1000, not 0.5"),
    (["--count-weight", "nan"], "--count-weight must be from 1 to 1000, not nan"),
    (["--count-weight", "1e9"], "--count-weight must be from 1 to 1000"),
    (["--ffn-lr", "0"], "--ffn-lr must be a fraction of --lr above 0 and at most 1, not 0.0"),
    (["--ffn-lr", "1.5"], "--ffn-lr must be a fraction"),
    (["--ffn-lr", "nan"], "--ffn-lr must be a fraction"),
    (["--off-share", "1"], "--off-share must be a fraction from 0 to below 1, not 1.0"),
    (["--off-share", "-0.1"], "--off-share must be a fraction"),
    (["--off-share", "nan"], "--off-share must be a fraction"),
])
def test_bad_numbers_are_refused_with_the_rule(args: list[str], said: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert train.main(["--out", str(tmp_path / "m")] + args) == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "m").exists()            # nothing written


@pytest.mark.parametrize("mix, said", [
    ("foo=0.1", "--mix: unknown task 'foo'"),
    ("add_3d", "'add_3d' needs TASK=WEIGHT"),
    ("add_3d=x", "'add_3d=x' needs TASK=WEIGHT with a weight >= 0"),
    ("add_3d=-0.1", "weight >= 0"),
    ("add_3d=nan", "weight >= 0"),
    ("count=0.1,count=0.2", "--mix: count is given twice"),
    (",".join(f"{t}=0" for t in ("add_1d", "add_2d", "add_3d", "sub_1d", "sub_2d", "sub_3d", "compare",
                                  "count", "reverse", "repeat", "about", "other", "document")),
     "the weights add up to 0"),
])
def test_a_bad_task_mix_is_refused(mix: str, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert train.main(["--out", str(tmp_path / "m"), "--mix", mix]) == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_a_task_mix_parses_to_weights() -> None:
    assert train.parse_mix("add_3d=0.12, count=0.14") == ((("add_3d", 0.12), ("count", 0.14)), [])
    assert train.parse_mix("") == ((), [])


def test_the_schedule_ends_at_the_final_fraction_and_its_default_is_the_shipped_runs() -> None:
    import math

    for final in (0.1, 0.01, 0.0):
        assert train.cosine_factor(0.0, final) == 1.0
        assert abs(train.cosine_factor(1.0, final) - final) < 1e-15
        assert abs(train.cosine_factor(0.5, final) - (1 + final) / 2) < 1e-15
    # the shipped demo was trained with lr * (0.1 + 0.9 * half-cosine): the default keeps every step's
    # factor bit for bit, so the documented retrain command still gives the shipped model
    for j in range(2500):
        frac = j / 2499
        assert train.cosine_factor(frac, 0.1) == 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))


def test_compile_where_torch_compile_cannot_build_is_refused_before_any_data(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """--compile first builds a tiny kernel; when that fails (no C++ compiler, say) the run is
    refused, exit 2, with what failed and the two ways on, instead of failing at step 0."""
    monkeypatch.setattr(train, "compile_unavailable", lambda: "InvalidCxxCompiler: no working C++ compiler found")
    assert train.main(["--out", str(tmp_path / "m"), "--compile"]) == 2
    err = capsys.readouterr().err
    assert "--compile: torch.compile does not work here (InvalidCxxCompiler: no working C++ compiler" in err
    assert "install a C++ compiler (g++), or train without --compile" in err
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("argv, says", [(["--lr", "fast"], "--lr must be"), (["--lr", "0"], "--lr must be"),
                                        (["--steps", "0"], "must be >= 1"),
                                        (["--ffn-lr", "0"], "--ffn-lr must be a fraction"),
                                        (["--ffn-lr", "2"], "--ffn-lr must be a fraction")])
def test_recall_probe_refuses_bad_arguments(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before torch is needed (the probe is for machines with it), exit 2, saying which."""
    from k3chat.demo import recall_probe

    assert recall_probe.main(argv) == 2
    assert says in capsys.readouterr().err


def _checkpoint_like(d: Path, training: str = '{"seed": 0, "steps": 2500, "train_seconds": 3000.5}') -> Path:
    d.mkdir(parents=True)
    for name in ("config.json", "tiktoken.model", "tokenizer_config.json", "model.safetensors.index.json"):
        (d / name).write_text("{}")
    (d / "training.json").write_text(training)
    return d


@pytest.mark.parametrize("make, said", [
    (lambda t: t / "nowhere", "is not a directory; give a checkpoint directory that train-demo wrote"),
    (lambda t: (t / "empty").mkdir() or t / "empty",
     "has no training.json, config.json, tiktoken.model, tokenizer_config.json, model.safetensors.index.json"),
    (lambda t: _checkpoint_like(t / "cut", '{"seed": 0, "ste'), "training.json cannot be read"),
    (lambda t: _checkpoint_like(t / "other", '{"seed": 0}'), "training.json cannot be read (no train_seconds)"),
    (lambda t: _checkpoint_like(t / "listed", "[1, 2]"), "cannot be read"),
])
def test_init_from_what_train_demo_did_not_write_is_refused_before_any_data(
        make: Any, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = make(tmp_path)
    assert train.main(["--out", str(tmp_path / "m"), "--init-from", str(src)]) == 2
    err = capsys.readouterr().err
    assert f"--init-from: {src}" in err and said in err
    assert not (tmp_path / "m").exists()            # nothing written


def test_init_from_its_own_output_is_refused_and_left_as_it_was(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    src = _checkpoint_like(tmp_path / "src")
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    assert train.main(["--out", str(src), "--init-from", str(tmp_path / "." / "src")]) == 2
    assert "is also --out; the run would overwrite the weights it starts from" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before


def test_init_from_records_the_source_recipe_and_its_time() -> None:
    """What a continued run keeps of the run it starts from: its recipe, and the time of every
    run behind its weights (a source that was itself continued counts its own sources)."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as t:
        plain = _checkpoint_like(Path(t) / "plain", json.dumps(
            {"seed": 0, "steps": 2500, "lr": 0.003, "copy_mix": 32, "train_seconds": 3484.5, "tokens": 9}))
        source = train.read_init_source(plain, Path(t) / "out")
        assert source["seed"] == 0 and source["steps"] == 2500 and source["copy_mix"] == 32
        assert source["train_seconds"] == source["train_seconds_total"] == 3484.5
        assert "tokens" not in source
        # keys this older training.json predates are what it ran with: the defaults, not None
        assert source["compile"] is False and source["init_from"] is None
        again = _checkpoint_like(Path(t) / "again", json.dumps(
            {"steps": 300, "train_seconds": 600.0, "train_seconds_total": 4084.5, "init_from": source}))
        chained = train.read_init_source(again, Path(t) / "out")
        assert chained["train_seconds_total"] == 4084.5 and chained["init_from"]["steps"] == 2500
        # the training text's options are kept too: a chain of three runs is retrained from them
        styled = _checkpoint_like(Path(t) / "styled", json.dumps(
            {"steps": 300, "off_steps_by_place": True, "mix": {"count": 0.14}, "ffn_lr": 0.1,
             "train_seconds": 563.1, "train_seconds_total": 4047.6, "init_from": source}))
        kept = train.read_init_source(styled, Path(t) / "out")
        assert kept["off_steps_by_place"] is True and kept["mix"] == {"count": 0.14} and kept["ffn_lr"] == 0.1
        assert kept["sign_by_places"] is None and kept["init_from"]["copy_mix"] == 32


def test_a_continued_run_records_every_option_of_its_source_recipe() -> None:
    """Each key of a run's recipe is one INIT_SOURCE_KEYS keeps, so an option added later
    cannot silently drop out of what a continued run records of its source."""
    recipe = train.run_recipe(steps=1, seed=0, conversations=1, batch_tokens=1, lr=1.0, final_lr=0.1,
                              tie_embeddings=False, copy_warmup=0, copy_mix=0, copy_mix_from=0,
                              copy_mix_until=0, copy_words_only=False, count_weight=1.0)
    assert set(recipe) <= set(train.INIT_SOURCE_KEYS), set(recipe) - set(train.INIT_SOURCE_KEYS)
