"""Every directory k3chat creates is 0700 and every file it writes 0600, whatever the umask
(issue 12 item 12): K3CHAT_HOME and its parents, the benchmark cache, fixtures, checkpoints
written by our writer. `plan --json` and `doctor --json` are in test_planner/test_doctor."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from k3engine.private_files import make_private_dirs, write_private


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.fixture
def loose_umask() -> Iterator[None]:
    """The common 022 umask, under which plain mkdir/open give 0755/0644."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def tree_modes(root: Path) -> dict[str, int]:
    """Mode of `root` and of everything under it, by path relative to root."""
    found = {".": mode(root)}
    for path in root.rglob("*"):
        found[str(path.relative_to(root))] = mode(path)
    return found


def assert_private_tree(root: Path) -> None:
    modes = tree_modes(root)
    loose = {p: oct(m) for p, m in modes.items()
             if m != (0o700 if (root / p).is_dir() else 0o600)}
    assert not loose, loose


def test_k3chat_home_and_its_missing_parents_are_created_0700(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loose_umask: None) -> None:
    from k3chat import paths
    home = tmp_path / "new" / "home"
    monkeypatch.setenv(paths.HOME_ENV, str(home))
    before = mode(tmp_path)
    paths.ensure_private_dir(paths.data_dir())
    paths.ensure_private_dir(paths.state_dir())
    assert mode(tmp_path / "new") == 0o700 and mode(home) == 0o700
    assert mode(home / "data") == 0o700 and mode(home / "state") == 0o700
    assert mode(tmp_path) == before  # an existing directory is the user's: left alone


def test_make_private_dirs_is_0700_even_under_a_umask_that_removes_owner_bits(
        tmp_path: Path) -> None:
    old = os.umask(0o277)
    try:
        made = make_private_dirs(tmp_path / "a" / "b")
    finally:
        os.umask(old)
    assert mode(tmp_path / "a") == 0o700 and mode(made) == 0o700
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        make_private_dirs(tmp_path / "file")


def test_write_private_replaces_a_loose_existing_file_with_a_0600_one(
        tmp_path: Path, loose_umask: None) -> None:
    target = tmp_path / "report.json"
    target.write_text("old")
    assert mode(target) == 0o644
    write_private(target, "new\n")
    assert target.read_text() == "new\n" and mode(target) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]  # no temp left


def test_fixture_cli_writes_a_private_directory(tmp_path: Path, loose_umask: None) -> None:
    out = tmp_path / "parents" / "tiny"
    done = subprocess.run([sys.executable, "-m", "k3chat.cli", "fixture", "tiny", str(out),
                           "--no-oracle"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert {"config.json", "fixture.json", "tiktoken.model", "tokenizer_config.json",
            "model.safetensors.index.json"} <= {p.name for p in out.iterdir()}
    assert_private_tree(out)
    assert mode(tmp_path / "parents") == 0o700


def test_fixture_with_oracle_files_is_private(tiny_dir: Path) -> None:
    assert {"oracle.npz", "oracle.json"} <= {p.name for p in tiny_dir.iterdir()}
    assert_private_tree(tiny_dir)


def test_single_file_fixture_is_private(tiny_single_dir: Path) -> None:
    assert (tiny_single_dir / "model.safetensors").exists()
    assert_private_tree(tiny_single_dir)


def test_bench_checkpoint_goes_to_k3chat_home_cache_privately(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loose_umask: None) -> None:
    from k3engine.bench import TINY_SHAPE, build_bench_checkpoint, default_bench_dir
    monkeypatch.setenv("K3CHAT_HOME", str(tmp_path / "home"))
    d = default_bench_dir()
    assert d.parent == tmp_path / "home" / "cache"
    build_bench_checkpoint(d, shape=TINY_SHAPE)
    assert mode(tmp_path / "home") == 0o700 and mode(tmp_path / "home" / "cache") == 0o700
    assert_private_tree(d)
