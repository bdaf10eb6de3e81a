"""Shared fixtures: checkpoints written once per test session by our own writer."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest


def _write(tmp_path_factory: pytest.TempPathFactory, name: str, **kw: object) -> Path:
    from k3engine.fixture import write_fixture

    out = tmp_path_factory.mktemp(name)
    write_fixture("tiny", out, **kw)
    return out


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 13-layer adversarial fixture, sharded, with its oracle data."""
    return _write(tmp_path_factory, "tiny")


@pytest.fixture(scope="session")
def tiny_scrambled_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same tensors with trunk and expert runs broken on purpose."""
    return _write(tmp_path_factory, "tiny_scrambled", scrambled=True)


@pytest.fixture(scope="session")
def tiny_single_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same tensors in one model.safetensors (no index)."""
    return _write(tmp_path_factory, "tiny_single", single_file=True, with_oracle=False)


@pytest.fixture(scope="session")
def tiny_oracle(tiny_dir: Path) -> dict[str, np.ndarray]:
    with np.load(tiny_dir / "oracle.npz") as d:
        return {k: d[k] for k in d.files}


@pytest.fixture(scope="session")
def wide_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Many experts (for cache work), with oracle data."""
    from k3engine.fixture import write_fixture

    out = tmp_path_factory.mktemp("wide")
    write_fixture("wide", out)
    return out
