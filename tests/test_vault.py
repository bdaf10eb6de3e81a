"""Encrypted history at rest: the key file, sealed records and streams, the stores that use them,
`sessions encrypt` / `decrypt`, and `run --prompt` and the app on an encrypted history.

Most tests write their key file with a cheap scrypt (n = 2**10) through create_key_file; the
end-to-end conversion test lets `sessions encrypt` write it with the real default cost.
"""
from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from k3chat import history, paths, statefile, vault, vault_convert
from k3chat.history import HistoryError, HistoryStore, open_store
from k3chat.statefile import StateFileError, load_state, model_fingerprint, save_state
from k3chat.vault import (KIND_SESSION, PASSPHRASE_ENV, SealError, VaultError, WrongPassphrase,
                          create_key_file, unlock)

PASSPHRASE = "correct horse battery staple"
CHEAP = 2**10  # scrypt n for tests only; the commands always use vault.KDF_N
PHRASE = "Ms. Okafor's settlement figure is 4,750,000"  # must never reach the disk in plaintext
NAME = "Okafor v. Brightline (privileged)"
FP = model_fingerprint(b'{"model_type": "kimi_k3"}', b'{"weight_map": {}}')


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("K3CHAT_HOME", str(h))
    secret = tmp_path / "passphrase"
    secret.write_text(PASSPHRASE + "\n")
    monkeypatch.setenv(PASSPHRASE_ENV, str(secret))
    monkeypatch.setattr(vault, "_UNLOCKED", {})  # every test unlocks for itself
    return h


def key_file() -> Path:
    return paths.data_dir() / vault.KEY_FILE_NAME


def cheap_vault(state: str = vault.STATE_ON) -> vault.Vault:
    paths.ensure_private_dir(paths.data_dir())
    return create_key_file(key_file(), PASSPHRASE, n=CHEAP, state=state)


def k3chat(home: Path, *args: str, passphrase_file: Path | None = None, timeout: float = 180,
           **kw: Any) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "K3CHAT_HOME": str(home)}
    env.pop(PASSPHRASE_ENV, None)
    if passphrase_file is not None:
        env[PASSPHRASE_ENV] = str(passphrase_file)
    return subprocess.run([sys.executable, "-m", "k3chat.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, **kw)


def files_holding(root: Path, *needles: str) -> list[str]:
    """Every file under ``root`` (temp files, index, state, key file included) holding a needle."""
    hits = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            data = Path(dirpath, name).read_bytes()
            hits += [f"{name}: {n!r}" for n in needles if n.encode() in data]
    return hits


def conversation(store: HistoryStore) -> str:
    sid = store.create(NAME).id
    store.append(sid, {"role": "user", "content": f"Draft a letter. {PHRASE}."})
    store.append(sid, {"role": "assistant", "content": "Dear counsel, ...", "reasoning_content": PHRASE})
    store.append(sid, {"role": "user", "content": "Shorter, please."})
    return sid


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# --------------------------------------------------------------------------- primitives


def test_sealed_line_opens_only_where_it_was_sealed(home: Path) -> None:
    v = cheap_vault()
    line = json.dumps({"role": "user", "content": PHRASE}).encode()
    sealed = v.seal_line(line, kind=KIND_SESSION, binding="s1")
    assert PHRASE.encode() not in sealed and vault.is_sealed_line(sealed) and b"\n" not in sealed
    assert v.open_line(sealed, kind=KIND_SESSION, binding="s1") == line
    with pytest.raises(SealError, match="failed authentication"):
        v.open_line(sealed, kind=KIND_SESSION, binding="s2")  # another session
    with pytest.raises(SealError, match="failed authentication"):
        v.open_line(sealed, kind=vault.KIND_INDEX, binding="s1")  # another kind of file
    with pytest.raises(SealError, match="not an encrypted record"):
        v.open_line(line, kind=KIND_SESSION, binding="s1")


@pytest.mark.parametrize("size", [0, 1, 15, 16, 17, 32, 33, 100])
def test_stream_round_trip_at_every_chunk_boundary(home: Path, tmp_path: Path, size: int) -> None:
    v = cheap_vault()
    data = os.urandom(size)
    pieces = [data[:5], data[5:40], b"", data[40:]]  # pieces that straddle chunk boundaries
    path = tmp_path / "s"
    path.write_bytes(b"".join(v.seal_stream(pieces, kind="state", binding="a", chunk_size=16)))
    chunks = -(-size // 16) or 1
    assert path.stat().st_size == 32 + size + 28 * chunks  # header, then nonce + tag per chunk
    with open(path, "rb") as f:
        assert bytes(v.read_stream(f, kind="state", binding="a")) == data


def _sealed_chunks(v: vault.Vault, data: bytes) -> tuple[bytes, list[bytes]]:
    blob = b"".join(v.seal_stream([data], kind="state", binding="a", chunk_size=16))
    header, body = blob[:32], blob[32:]
    return header, [body[i : i + 44] for i in range(0, len(body), 44)]


def _open_stream(v: vault.Vault, path: Path, blob: bytes) -> bytes:
    path.write_bytes(blob)
    with open(path, "rb") as f:
        return bytes(v.read_stream(f, kind="state", binding="a"))


def test_stream_truncated_reordered_extended_or_flipped_is_refused(home: Path, tmp_path: Path) -> None:
    v = cheap_vault()
    header, chunks = _sealed_chunks(v, os.urandom(40))  # chunks of 16, 16 and 8 bytes
    assert len(chunks) == 3
    path = tmp_path / "s"
    with pytest.raises(SealError, match="truncated: it ends after chunk 1") as cut:
        _open_stream(v, path, header + chunks[0] + chunks[1])
    assert cut.value.truncated
    with pytest.raises(SealError):
        _open_stream(v, path, header + chunks[0] + chunks[1] + chunks[2][:10])  # inside a chunk
    with pytest.raises(SealError, match="chunk 0 failed"):
        _open_stream(v, path, header + chunks[1] + chunks[0] + chunks[2])
    with pytest.raises(SealError):
        _open_stream(v, path, header + b"".join(chunks) + b"more")
    flipped = bytearray(header + b"".join(chunks))
    flipped[32 + 44 + 20] ^= 1
    with pytest.raises(SealError, match="chunk 1 failed"):
        _open_stream(v, path, bytes(flipped))
    with pytest.raises(SealError, match="header"):
        _open_stream(v, path, header[:20])


# --------------------------------------------------------------------------- key file


def test_key_file_defaults_are_the_memory_hard_cost(tmp_path: Path) -> None:
    path = tmp_path / "vault.json"
    start = time.perf_counter()
    v = create_key_file(path, PASSPHRASE)
    elapsed = time.perf_counter() - start
    doc = json.loads(path.read_text())
    assert doc["kdf"] == {"name": "scrypt", "n": 2**17, "r": 8, "p": 1, "salt": doc["kdf"]["salt"]}
    assert doc["cipher"] == "AES-256-GCM" and len(base64.b64decode(doc["kdf"]["salt"])) == 16
    assert (path.stat().st_mode & 0o777) == 0o600
    assert elapsed > 0.05  # 128 MiB of scrypt is not instant (about 0.5 s here)
    assert v.state == vault.STATE_ENCRYPTING
    assert unlock(path, PASSPHRASE).open_line(v.seal_line(b"x", kind="index", binding=""),
                                              kind="index", binding="") == b"x"


def test_wrong_passphrase_and_damaged_key_files_are_refused_clearly(tmp_path: Path) -> None:
    path = tmp_path / "vault.json"
    create_key_file(path, PASSPHRASE, n=CHEAP)
    with pytest.raises(WrongPassphrase, match="wrong passphrase .* nothing was read or changed"):
        unlock(path, "correct horse battery stapler")
    doc = json.loads(path.read_text())
    doc["kdf"]["n"] = 2**40  # a hostile file must not make scrypt ask for a terabyte
    path.write_text(json.dumps(doc))
    with pytest.raises(VaultError, match="damaged .*1 GiB.*restore it from a backup"):
        unlock(path, PASSPHRASE)
    path.write_text("{not json")
    with pytest.raises(VaultError, match="is damaged"):
        unlock(path, PASSPHRASE)
    with pytest.raises(VaultError, match="at least 8 characters"):
        create_key_file(tmp_path / "other.json", "short", n=CHEAP)


def test_terminal_is_asked_once_per_process_and_three_times_at_most(home: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    cheap_vault()
    monkeypatch.delenv(PASSPHRASE_ENV)
    answers = iter(["wrong one!", PASSPHRASE])
    asked: list[str] = []
    monkeypatch.setattr(vault, "ask_terminal", lambda prompt, **kw: asked.append(prompt) or next(answers))
    monkeypatch.setattr(vault, "_UNLOCKED", {})
    first, second = open_store(), open_store()
    assert first.vault is second.vault is not None and len(asked) == 2  # one wrong try, then right
    monkeypatch.setattr(vault, "_UNLOCKED", {})
    monkeypatch.setattr(vault, "ask_terminal", lambda prompt, **kw: asked.append(prompt) or "still wrong")
    with pytest.raises(WrongPassphrase):
        open_store()
    assert len(asked) == 2 + vault.TERMINAL_TRIES


def test_a_new_passphrase_is_asked_twice_and_must_match(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PASSPHRASE_ENV)
    typed = iter([PASSPHRASE, PASSPHRASE + "!"])
    monkeypatch.setattr(vault, "ask_terminal", lambda prompt, **kw: next(typed))
    with pytest.raises(VaultError, match="the two passphrases differ; nothing was changed"):
        vault_convert.encrypt_history()
    assert not key_file().exists()
    typed = iter([PASSPHRASE, PASSPHRASE])
    assert vault_convert.encrypt_history().created_key and key_file().exists()


def test_no_terminal_and_no_passphrase_file_is_a_usage_error(home: Path) -> None:
    cheap_vault()
    r = k3chat(home, "sessions", "list", stdin=subprocess.DEVNULL, start_new_session=True)  # no tty
    assert r.returncode == 2, r.stderr
    assert "the history is encrypted and there is no terminal to ask for it" in r.stderr
    assert PASSPHRASE_ENV in r.stderr


# --------------------------------------------------------------------------- the history store


def test_encrypted_store_round_trip_leaves_no_plaintext(home: Path) -> None:
    cheap_vault()
    store = open_store()
    sid = conversation(store)
    store.rename(sid, NAME + " II")
    loaded = HistoryStore(store.root, vault=store.vault).load(sid)  # a second instance, same key
    assert loaded.problems == []
    assert [r["role"] for r in loaded.records] == ["user", "assistant", "user"]
    assert PHRASE in loaded.records[0]["content"] and loaded.info.name == NAME + " II"
    assert [i.name for i in open_store().list()] == [NAME + " II"]
    assert files_holding(home, PHRASE, NAME, "Dear counsel") == []
    lines = (store.root / f"{sid}.jsonl").read_bytes().splitlines()
    assert len(lines) == 5 and all(vault.is_sealed_line(line) for line in lines)  # header, 3, rename


def _flip_in_line(path: Path, number: int) -> None:
    lines = path.read_bytes().split(b"\n")
    doc = json.loads(lines[number - 1])
    sealed = bytearray(base64.b64decode(doc["c"]))
    sealed[3] ^= 0x40
    doc["c"] = base64.b64encode(bytes(sealed)).decode()
    lines[number - 1] = json.dumps(doc, separators=(",", ":")).encode()
    path.write_bytes(b"\n".join(lines))


def test_a_flipped_byte_skips_that_record_only(home: Path) -> None:
    cheap_vault()
    store = open_store()
    sid = conversation(store)
    _flip_in_line(store.root / f"{sid}.jsonl", 3)  # the assistant record
    loaded = open_store().load(sid)
    assert [r["content"] for r in loaded.records] == [f"Draft a letter. {PHRASE}.", "Shorter, please."]
    assert len(loaded.problems) >= 1
    assert loaded.problems[0] == ("line 3: encrypted record failed authentication (damaged, or moved here "
                                  "from another session or file), skipped")
    assert loaded.info.name == NAME


def test_a_record_moved_from_another_session_is_refused(home: Path) -> None:
    cheap_vault()
    store = open_store()
    a, b = conversation(store), conversation(store)
    path_a, path_b = store.root / f"{a}.jsonl", store.root / f"{b}.jsonl"
    lines_a, lines_b = path_a.read_bytes().split(b"\n"), path_b.read_bytes().split(b"\n")
    lines_b[3] = lines_a[3]  # line 4 of b replaced by a's (valid, sealed for a)
    path_b.write_bytes(b"\n".join(lines_b))
    loaded = store.load(b)
    assert [r["content"] for r in loaded.records] == [f"Draft a letter. {PHRASE}.", "Dear counsel, ..."]
    assert loaded.problems[0].startswith("line 4: encrypted record failed authentication")
    path_b.write_bytes(path_a.read_bytes())  # the whole file copied over another session's
    assert store.load(b).records == [] and len(store.load(b).problems) >= 4


def test_stores_never_mix_plaintext_and_sealed_files(home: Path) -> None:
    plain_sid = conversation(HistoryStore())
    cheap_vault(state=vault.STATE_ENCRYPTING)  # as if `sessions encrypt` stopped before this file
    with pytest.raises(HistoryError, match="is encrypted: open it with its passphrase"):
        HistoryStore()  # never a plaintext store on an encrypted history
    store = open_store()
    path = store.root / f"{plain_sid}.jsonl"
    before = path.read_bytes()
    with pytest.raises(HistoryError, match="not encrypted although the history is: an earlier "
                                           "`k3chat sessions encrypt` did not finish; run it again"):
        store.load(plain_sid)
    with pytest.raises(HistoryError, match="did not finish"):
        store.append(plain_sid, {"role": "assistant", "content": "x"})
    assert path.read_bytes() == before  # nothing sealed was mixed into it


def test_a_sealed_index_without_its_key_file_is_left_alone(home: Path) -> None:
    cheap_vault()
    store = open_store()
    conversation(store)
    index = store.root / history.INDEX_NAME
    sealed = index.read_bytes()
    assert vault.is_sealed_line(sealed)
    key_file().unlink()  # lost key file: nothing may be rebuilt over the sealed files
    with pytest.raises(HistoryError, match="key file .* is missing; restore it"):
        HistoryStore().list()
    assert index.read_bytes() == sealed


def test_an_append_that_waited_while_its_file_was_converted_writes_nothing(
        home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cheap_vault()
    store = open_store()
    sid = conversation(store)
    path = store.root / f"{sid}.jsonl"
    real_flock = history.fcntl.flock
    replaced: list[int] = []

    def flock(fd: int, op: int) -> None:
        if not replaced and os.fstat(fd).st_ino == path.stat().st_ino:
            replaced.append(fd)
            paths.atomic_write(path, path.read_bytes())  # `sessions encrypt` got there first
        real_flock(fd, op)

    monkeypatch.setattr(history.fcntl, "flock", flock)
    with pytest.raises(HistoryError, match="replaced or deleted while saving; nothing was written"):
        store.append(sid, {"role": "assistant", "content": "lost?"})
    assert replaced and len(open_store().load(sid).records) == 3


# --------------------------------------------------------------------------- state files


def test_sealed_state_file_round_trip_and_refusals(home: Path, tmp_path: Path) -> None:
    v = cheap_vault()
    payload = os.urandom(3 * vault.STREAM_CHUNK + 5)
    path = tmp_path / "state" / "s1.k3state"
    save_state(path, payload, fingerprint=FP, n_tokens=7, vault=v)
    data = path.read_bytes()
    assert data.startswith(vault.STREAM_MAGIC) and payload[1000:1064] not in data
    state = load_state(path, fingerprint=FP, vault=v)
    assert (bytes(state.payload), state.n_tokens) == (payload, 7)

    def refusal(blob: bytes, name: str = "s1.k3state", with_vault: bool = True) -> str:
        target = path.with_name(name)
        target.write_bytes(blob)
        with pytest.raises(StateFileError) as info:
            load_state(target, fingerprint=FP, vault=v if with_vault else None)
        assert str(info.value)
        return info.value.reason

    record = 12 + vault.STREAM_CHUNK + 16
    assert refusal(data[: 32 + 2 * record]) == statefile.TRUNCATED  # cut at a chunk boundary
    assert refusal(data[:-100]) in (statefile.TRUNCATED, statefile.AUTH_FAILED)  # inside the last
    flipped = bytearray(data)
    flipped[32 + record + 77] ^= 1
    assert refusal(bytes(flipped)) == statefile.AUTH_FAILED
    assert refusal(data, name="s2.k3state") == statefile.AUTH_FAILED  # another session's name
    assert refusal(data, with_vault=False) == statefile.ENCRYPTED
    save_state(path, payload, fingerprint=FP, n_tokens=7)  # a plaintext one, left from before
    assert refusal(path.read_bytes()) == statefile.NOT_ENCRYPTED


_KILLED_WRITER = """
import os, signal, sys
from pathlib import Path
from k3chat import vault
from k3chat.statefile import save_state, model_fingerprint
v = vault.unlock(Path(sys.argv[1]), vault.passphrase_from_file())
polls = []
def cancel():
    polls.append(1)
    if len(polls) == 2:  # after the first 64 MiB piece reached the temp file
        os.kill(os.getpid(), signal.SIGKILL)
    return False
payload = (sys.argv[3] + " ").encode() * ((65 << 20) // (len(sys.argv[3]) + 1))
save_state(Path(sys.argv[2]), payload, fingerprint=model_fingerprint(b"c", b"i"), n_tokens=1,
           cancel=cancel, vault=v)
"""


def test_a_killed_state_write_leaves_only_ciphertext(home: Path) -> None:
    cheap_vault()
    target = paths.state_dir() / "sessions" / "s1.k3state"
    child = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(key_file()), str(target), PHRASE],
                           env=dict(os.environ), capture_output=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr
    temps = list(target.parent.glob(".s1.k3state.*.tmp"))
    assert len(temps) == 1 and temps[0].stat().st_size > 64 << 20  # the killed write's temp file
    assert not target.exists()
    assert files_holding(home, PHRASE) == []


# --------------------------------------------------------------------------- encrypt / decrypt


def test_encrypt_and_decrypt_through_the_cli(home: Path, tmp_path: Path) -> None:
    store = HistoryStore()
    sid = conversation(store)
    original = store.load(sid).records
    state = paths.state_dir() / "sessions" / f"{sid}.k3state"
    save_state(state, f"engine state {PHRASE}".encode(), fingerprint=FP, n_tokens=3)
    # A temp copy left by a write that was killed before encryption: plaintext, to be removed.
    (store.root / f".{sid}.jsonl.{dead_pid()}.0123456789ab.tmp").write_text(PHRASE)
    assert len(files_holding(home, PHRASE, NAME)) >= 4
    secret = tmp_path / "passphrase"

    r = k3chat(home, "sessions", "encrypt", passphrase_file=secret)
    assert r.returncode == 0, r.stderr
    assert "encrypted 1 session(s) and 1 engine state file(s)" in r.stderr
    assert files_holding(home, PHRASE, NAME, "Dear counsel") == []
    doc = json.loads(key_file().read_text())
    assert (doc["kdf"]["n"], doc["kdf"]["r"], doc["kdf"]["p"], doc["state"]) == (2**17, 8, 1, "on")

    listed = k3chat(home, "sessions", "list", "--json", passphrase_file=secret)
    assert listed.returncode == 0, listed.stderr
    assert [s["name"] for s in json.loads(listed.stdout)] == [NAME]
    wrong = tmp_path / "wrong"
    wrong.write_text("correct horse battery stapler\n")
    refused = k3chat(home, "sessions", "show", sid, passphrase_file=wrong)
    assert refused.returncode == 2 and refused.stdout == ""
    assert "wrong passphrase for the encrypted history" in refused.stderr
    out = tmp_path / "export.md"
    exported = k3chat(home, "sessions", "export", sid, "-o", str(out), passphrase_file=secret)
    assert exported.returncode == 0 and PHRASE in out.read_text()
    assert "is plaintext: the history is encrypted, this export is not" in exported.stderr
    again = k3chat(home, "sessions", "encrypt", passphrase_file=secret)  # idempotent
    assert again.returncode == 0 and "encrypted 0 session(s)" in again.stderr

    back = k3chat(home, "sessions", "decrypt", passphrase_file=secret)
    assert back.returncode == 0, back.stderr
    assert not key_file().exists()
    assert HistoryStore().load(sid).records == original
    assert state.read_bytes().startswith(statefile.MAGIC)
    assert load_state(state, fingerprint=FP).payload == f"engine state {PHRASE}".encode()
    assert k3chat(home, "sessions", "decrypt").stderr.strip().endswith("not encrypted; nothing to do")


def _interrupt_on_second(real: Any) -> Any:
    calls = []

    def convert(*args: Any, **kw: Any) -> bool:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return bool(real(*args, **kw))
    return convert


@pytest.mark.parametrize("direction", ["encrypt", "decrypt"])
def test_an_interrupted_conversion_leaves_whole_files_and_resumes(home: Path, direction: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    if direction == "decrypt":
        cheap_vault()
        store = open_store()
    else:
        store = HistoryStore()
    sids = [conversation(store) for _ in range(3)]
    if direction == "encrypt":
        cheap_vault(state=vault.STATE_ENCRYPTING)  # the key file is the first thing encrypt writes
    monkeypatch.setattr(vault_convert, "_convert_session_file",
                        _interrupt_on_second(vault_convert._convert_session_file))
    with pytest.raises(KeyboardInterrupt):
        getattr(vault_convert, f"{direction}_history")()
    forms = [vault.has_sealed_line((store.root / f"{sid}.jsonl").read_bytes()) for sid in sorted(sids)]
    assert forms == [direction == "encrypt", direction == "decrypt", direction == "decrypt"]  # whole files
    assert json.loads(key_file().read_text())["state"] == f"{direction}ing"
    monkeypatch.undo()
    monkeypatch.setenv("K3CHAT_HOME", str(home))
    monkeypatch.setenv(PASSPHRASE_ENV, str(home.parent / "passphrase"))
    getattr(vault_convert, f"{direction}_history")()  # run again: finishes
    reader = open_store() if direction == "encrypt" else HistoryStore()
    assert key_file().exists() == (direction == "encrypt")
    for sid in sids:
        assert vault.has_sealed_line((store.root / f"{sid}.jsonl").read_bytes()) == (direction == "encrypt")
        loaded = reader.load(sid)
        assert loaded.problems == [] and len(loaded.records) == 3


def test_decrypt_keeps_a_damaged_record_as_a_reported_line(home: Path, tmp_path: Path) -> None:
    cheap_vault()
    store = open_store()
    sid = conversation(store)
    path = store.root / f"{sid}.jsonl"
    _flip_in_line(path, 3)
    damaged = path.read_bytes().split(b"\n")[2]
    r = k3chat(home, "sessions", "decrypt", passphrase_file=tmp_path / "passphrase")
    assert r.returncode == 0, r.stderr
    assert f"warning: session {sid} line 3: encrypted record failed authentication" in r.stderr
    loaded = HistoryStore().load(sid)
    assert [r["role"] for r in loaded.records] == ["user", "user"]
    assert loaded.problems[0] == "line 3: unexpected store line 'damaged', skipped"  # then the role order
    marker = json.loads(path.read_bytes().split(b"\n")[2])
    assert base64.b64decode(marker["bytes"]) == damaged  # its bytes are kept, nothing thrown away


# --------------------------------------------------------------------------- the front-ends


def test_run_prompt_on_the_demo_model_with_an_encrypted_history(home: Path, tmp_path: Path) -> None:
    cheap_vault()
    secret, out = tmp_path / "passphrase", tmp_path / "turn.json"
    question = "What is 36 + 47?"
    args = ("run", "--demo", "--thinking-effort", "low", "--session", NAME, "--json", str(out))
    first = k3chat(home, *args, "--prompt", question, passphrase_file=secret)
    assert first.returncode == 0, first.stderr
    assert "**83**" in json.loads(out.read_text())["answer"]
    second = k3chat(home, *args, "--prompt", "What is 12 + 30?", passphrase_file=secret)
    assert second.returncode == 0, second.stderr
    turn = json.loads(out.read_text())
    assert turn["reuse_source"] == "state_file" and turn["reused_tokens"] > 0  # the sealed state file
    sid = turn["session"]
    assert (paths.state_dir() / "sessions" / f"{sid}.k3state").read_bytes().startswith(vault.STREAM_MAGIC)
    records = open_store().load(sid).records
    assert [r["content"] for r in records[::2]] == [question, "What is 12 + 30?"]
    assert files_holding(home, "36 + 47", "12 + 30", NAME) == []
    wrong = tmp_path / "wrong"
    wrong.write_text("not the passphrase\n")
    refused = k3chat(home, *args, "--prompt", "again", passphrase_file=wrong)
    assert refused.returncode == 2 and "wrong passphrase" in refused.stderr
    assert len(open_store().load(sid).records) == 4  # nothing written


def test_the_app_asks_before_it_starts_and_writes_sealed_records(home: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("textual")
    from k3chat.app import build_app
    from k3chat.settings import Settings

    cheap_vault()
    monkeypatch.delenv(PASSPHRASE_ENV)
    asked: list[str] = []
    monkeypatch.setattr(vault, "ask_terminal", lambda prompt, **kw: asked.append(prompt) or PASSPHRASE)
    monkeypatch.setattr(vault, "_UNLOCKED", {})  # a new process: nothing unlocked yet
    app = build_app(None, settings=Settings(max_tokens=64, thinking=False), demo=True, threads=2)
    assert len(asked) == 1 and app.store.vault is not None  # before the screen exists

    async def scenario() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            while not app.ready:
                await pilot.pause(0.02)
            app.chat.prompt.set_text("What is 36 + 47?")
            await pilot.press("enter")
            while app.turns_over < 1:
                await pilot.pause(0.02)
            assert app.ui_errors == [] and app.conv is not None
            sids.append(app.conv.session_id)
            await pilot.press("ctrl+q")

    sids: list[str] = []
    asyncio.run(asyncio.wait_for(scenario(), 180))
    records = open_store().load(sids[0]).records
    assert records[0]["content"] == "What is 36 + 47?" and records[1]["role"] == "assistant"
    assert files_holding(home, "36 + 47") == [] and len(asked) == 1
