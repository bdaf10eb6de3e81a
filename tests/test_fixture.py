"""The tiny fixture with its oracle data (spec k3-model.md 9.1-9.3)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from k3engine import fixture as fx
from k3engine.oracle import Oracle


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fx.write_fixture("tiny", tmp_path_factory.mktemp("fixture") / "tiny")


def load(d: Path) -> tuple[dict, dict[str, np.ndarray], dict]:
    meta = json.loads((d / "oracle.json").read_text())
    with np.load(d / "oracle.npz") as z:
        arrays = {k: z[k] for k in z.files}
    cfg = json.loads((d / "config.json").read_text())["text_config"]
    return meta, arrays, cfg


def margins(rows: np.ndarray) -> np.ndarray:
    top = np.sort(rows.astype(np.float64), axis=-1)[:, -2:]
    return top[:, 1] - top[:, 0]


def test_self_checks_recorded(tiny_model: Path) -> None:
    meta, _, _ = load(tiny_model)
    assert meta["T"] == 32 and meta["prompt_len"] == 12 and meta["gen_len"] == 20
    assert meta["weight_seed"] == 0 and meta["prompt_seed"] >= fx.BASE_PROMPT_SEED
    assert all(meta["self_checks"].values()), meta["self_checks"]
    st = meta["stats"]
    assert st["max_abs_gate"] > 4.0 and st["max_abs_up"] > 25.0
    assert st["bias_changed_selection"] is True and st["nan_or_inf"] is False
    assert len(meta["margins"]) == 20 and min(meta["margins"]) == meta["min_margin"] >= 1e-3


def test_oracle_arrays(tiny_model: Path) -> None:
    _, a, cfg = load(tiny_model)
    V = cfg["vocab_size"]
    assert set(a) == {"prompt_ids", "full_ids", "logits"}
    assert a["prompt_ids"].shape == (12,) and a["full_ids"].shape == (32,)
    assert a["logits"].shape == (32, V) and a["logits"].dtype == np.float32
    assert np.array_equal(a["full_ids"][:12], a["prompt_ids"])
    assert np.all(a["prompt_ids"] < V - 256) and np.all(a["prompt_ids"] >= 0)  # ordinary ranks
    assert np.all(a["full_ids"] < V)
    assert np.all(np.isfinite(a["logits"]))
    # G1 on the stored data: teacher-forced argmax reproduces the greedy continuation.
    assert np.array_equal(np.argmax(a["logits"][11:31], axis=-1), a["full_ids"][12:])
    assert margins(a["logits"][11:31]).min() > 0.9e-3  # float32 storage may shave a little


def test_stored_logits_are_the_oracles(tiny_model: Path) -> None:
    _, a, _ = load(tiny_model)
    fresh = Oracle(tiny_model).forward(a["full_ids"])
    np.testing.assert_array_equal(fresh.astype(np.float32), a["logits"])
    # Greedy from the prompt alone, one fresh forward per step (G2 against the oracle).
    ids = list(a["prompt_ids"])
    oracle = Oracle(tiny_model)
    for _ in range(3):
        ids.append(int(np.argmax(oracle.forward(ids)[-1])))
    assert ids == list(a["full_ids"][:15])


def test_deterministic_with_oracle(tiny_model: Path, tmp_path: Path) -> None:
    again = fx.write_fixture("tiny", tmp_path / "again")
    for f in sorted(tiny_model.iterdir()):
        assert (again / f.name).read_bytes() == f.read_bytes(), f.name


class FakeOracle:
    """Deterministic stand-in: next token (id*31+7) mod V; the first attempt's margins are thin."""

    V = 1280

    def __init__(self, model_dir: Path) -> None:
        self.attempt = 0

    def _logits(self, ids: list[int], margin: float) -> np.ndarray:
        out = np.zeros((len(ids), self.V))
        for t, i in enumerate(ids):
            out[t, (int(i) * 31 + 7) % self.V] = 1.0
            out[t, (int(i) * 31 + 8) % self.V] = 1.0 - margin
        return out

    def forward(self, ids: list[int]) -> np.ndarray:
        if len(ids) == fx.PROMPT_LEN:
            self.attempt += 1
        return self._logits(ids, 1e-4 if self.attempt == 1 else 0.5)

    def forward_with_stats(self, ids: list[int]) -> tuple[np.ndarray, dict]:
        stats = {"max_abs_gate": 9.0, "max_abs_up": 30.0, "bias_changed_selection": True, "nan_or_inf": False}
        return self._logits(ids, 0.5), stats


def test_thin_margin_advances_prompt_seed_only(monkeypatch: pytest.MonkeyPatch, tiny_model: Path, tmp_path: Path) -> None:
    import k3engine.oracle

    monkeypatch.setattr(k3engine.oracle, "Oracle", FakeOracle)
    d = fx.write_fixture("tiny", tmp_path / "retry")
    meta, a, _ = load(d)
    assert meta["prompt_seed"] == fx.BASE_PROMPT_SEED + 1 and meta["prompt_attempts"] == 2
    assert meta["min_margin"] == pytest.approx(0.5)
    assert a["full_ids"][12] == (a["full_ids"][11] * 31 + 7) % FakeOracle.V
    shard = "model-00005-of-000014.safetensors"
    assert (d / shard).read_bytes() == (tiny_model / shard).read_bytes()  # weights untouched


def test_refuses_when_no_prompt_qualifies(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(fx, "MIN_MARGIN", 100.0)
    monkeypatch.setattr(fx, "MAX_PROMPT_ATTEMPTS", 2)
    with pytest.raises(fx.FixtureError, match="margin"):
        fx.write_fixture("tiny", tmp_path / "never")
    assert list(tmp_path.iterdir()) == []  # nothing half-written left behind


def test_cli_reports_refusal(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise fx.FixtureError("no prompt qualifies")

    monkeypatch.setattr(fx, "_build", refuse)
    assert fx.main(["tiny", str(tmp_path / "x")]) == 1
    assert "refused: no prompt qualifies" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "stats, needle",
    [
        ({"max_abs_gate": 3.9, "max_abs_up": 30.0, "bias_changed_selection": True, "nan_or_inf": False}, "|g| > 4"),
        ({"max_abs_gate": 9.0, "max_abs_up": 25.0, "bias_changed_selection": True, "nan_or_inf": False}, "|v| > 25"),
        ({"max_abs_gate": 9.0, "max_abs_up": 30.0, "bias_changed_selection": False, "nan_or_inf": False}, "bias"),
        ({"max_abs_gate": 9.0, "max_abs_up": 30.0, "bias_changed_selection": True, "nan_or_inf": True}, "NaN"),
        ({"max_abs_gate": 9.0, "max_abs_up": 30.0, "nan_or_inf": False}, "lack"),
    ],
)
def test_self_check_refusals(stats: dict, needle: str) -> None:
    with pytest.raises(fx.FixtureError, match=needle.replace("|", r"\|")):
        fx._self_check(stats, np.zeros((2, 3)))


def test_self_check_passes_and_catches_nonfinite_logits() -> None:
    ok = {"max_abs_gate": 9.0, "max_abs_up": 30.0, "bias_changed_selection": True, "nan_or_inf": False}
    fx._self_check(ok, np.zeros((2, 3)))
    with pytest.raises(fx.FixtureError, match="NaN"):
        fx._self_check(ok, np.array([[0.0, np.inf]]))
