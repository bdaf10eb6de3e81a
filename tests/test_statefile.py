"""State files: a round trip, and a refusal with its reason for every kind of damage."""

from __future__ import annotations

import errno
import os
import stat
import struct
from pathlib import Path
from typing import Any

import pytest

from k3chat import statefile
from k3engine import private_files
from k3chat.statefile import StateFileError, load_state, model_fingerprint, save_state

FP = model_fingerprint(b'{"model_type": "kimi_k3"}', b'{"weight_map": {}}')
PAYLOAD = bytes(range(256)) * 40


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "state" / "s1.k3state"
    save_state(path, PAYLOAD, fingerprint=FP, n_tokens=1234)
    return path


def refusal(path: Path, fingerprint: str = FP) -> str:
    with pytest.raises(StateFileError) as info:
        load_state(path, fingerprint=fingerprint)
    assert str(info.value)  # always a readable reason for the status line
    return info.value.reason


def test_round_trip_and_modes(saved: Path) -> None:
    state = load_state(saved, fingerprint=FP)
    assert (state.payload, state.n_tokens, state.fingerprint) == (PAYLOAD, 1234, FP)
    assert stat.S_IMODE(os.stat(saved).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(saved.parent).st_mode) == 0o700
    assert [p.name for p in saved.parent.iterdir()] == [saved.name]  # no temp file left


def test_empty_payload_and_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "s"
    save_state(path, b"old", fingerprint=FP, n_tokens=1)
    save_state(path, b"", fingerprint=FP, n_tokens=0)
    assert load_state(path, fingerprint=FP).payload == b""


def test_missing(tmp_path: Path) -> None:
    assert refusal(tmp_path / "nothing") == statefile.MISSING


def test_bad_magic(saved: Path) -> None:
    saved.write_bytes(b"GGUF" + saved.read_bytes()[4:])
    assert refusal(saved) == statefile.BAD_MAGIC


def test_unsupported_version(saved: Path) -> None:
    data = bytearray(saved.read_bytes())
    struct.pack_into("<I", data, 8, 2)
    saved.write_bytes(bytes(data))
    with pytest.raises(StateFileError, match="version 2"):
        load_state(saved, fingerprint=FP)
    assert refusal(saved) == statefile.UNSUPPORTED_VERSION


def test_fingerprint_mismatch(saved: Path) -> None:
    other = model_fingerprint(b'{"model_type": "kimi_k3", "layers": 2}', b'{"weight_map": {}}')
    assert refusal(saved, other) == statefile.FINGERPRINT_MISMATCH


@pytest.mark.parametrize("keep", [0, 5, 12, 40])
def test_truncated_inside_the_header(saved: Path, keep: int) -> None:
    saved.write_bytes(saved.read_bytes()[:keep])
    assert refusal(saved) == statefile.TRUNCATED


def test_truncated_payload(saved: Path) -> None:
    saved.write_bytes(saved.read_bytes()[:-100])
    with pytest.raises(StateFileError, match="truncated"):
        load_state(saved, fingerprint=FP)
    assert refusal(saved) == statefile.LENGTH_MISMATCH


def test_trailing_bytes(saved: Path) -> None:
    saved.write_bytes(saved.read_bytes() + b"\0")
    assert refusal(saved) == statefile.LENGTH_MISMATCH


def test_checksum_mismatch_in_payload(saved: Path) -> None:
    data = bytearray(saved.read_bytes())
    data[-1] ^= 0x01
    saved.write_bytes(bytes(data))
    assert refusal(saved) == statefile.CHECKSUM_MISMATCH


def test_checksum_covers_the_header(saved: Path) -> None:
    data = bytearray(saved.read_bytes())
    fp_len = struct.unpack_from("<H", data, 12)[0]
    n_tokens_at = 14 + fp_len
    data[n_tokens_at] ^= 0x01  # n_tokens off by one would desynchronise the prefix
    saved.write_bytes(bytes(data))
    assert refusal(saved) == statefile.CHECKSUM_MISMATCH


def test_failed_save_keeps_the_old_file(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(fd: int, data: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(private_files, "write_all", no_space)  # the one writer, under paths
    with pytest.raises(OSError):
        save_state(saved, b"new" * 100, fingerprint=FP, n_tokens=9)
    monkeypatch.undo()
    assert load_state(saved, fingerprint=FP).n_tokens == 1234
    assert [p.name for p in saved.parent.iterdir()] == [saved.name]


def test_model_fingerprint() -> None:
    assert FP == model_fingerprint(b'{"model_type": "kimi_k3"}', b'{"weight_map": {}}')
    assert FP.startswith("sha256:") and len(FP) == 7 + 64
    assert model_fingerprint(b"ab", b"c") != model_fingerprint(b"a", b"bc")  # parts are delimited
    assert model_fingerprint(b"a", b"b") != model_fingerprint(b"a", b"b", extra=b"engine-2")


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        save_state(tmp_path / "s", b"", fingerprint="", n_tokens=0)
    with pytest.raises(ValueError):
        save_state(tmp_path / "s", b"", fingerprint=FP, n_tokens=-1)


def test_a_cancelled_save_leaves_the_old_file_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(statefile, "_WRITE_CHUNK", 1000)
    path = tmp_path / "s"
    save_state(path, b"old", fingerprint=FP, n_tokens=1)
    calls = [0]

    def cancel() -> bool:
        calls[0] += 1
        return calls[0] > 3  # after three pieces of the payload
    with pytest.raises(statefile.SaveCancelled):
        save_state(path, PAYLOAD, fingerprint=FP, n_tokens=2, cancel=cancel)
    assert load_state(path, fingerprint=FP).payload == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["s"]
    save_state(path, PAYLOAD, fingerprint=FP, n_tokens=2, cancel=lambda: False)  # pieces add up
    assert load_state(path, fingerprint=FP).payload == PAYLOAD
