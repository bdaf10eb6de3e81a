"""History store: privacy modes, durability, damaged lines, full disk, concurrency, exports."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from k3chat import history, paths
from k3chat.history import HistoryError, HistoryStore


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("K3CHAT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def store(home: Path) -> HistoryStore:
    return HistoryStore()


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def user(text: str, **extra: Any) -> dict[str, Any]:
    return {"role": "user", "content": text, **extra}


def assistant(text: str, reasoning: str = "thinking", **extra: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": text, "reasoning_content": reasoning, **extra}


def session_file(store: HistoryStore, session_id: str) -> Path:
    return store.root / f"{session_id}.jsonl"


def three_turns(store: HistoryStore) -> str:
    sid = store.create("Case 12").id
    store.append(sid, user("first"))
    store.append(sid, assistant("one"))
    store.append(sid, user("second"))
    return sid


# ---------------------------------------------------------------- places and modes


def test_default_root_is_under_k3chat_home_and_private(home: Path) -> None:
    old = os.umask(0)  # the most permissive umask must still give private files
    try:
        store = HistoryStore()
        sid = store.create("x").id
        store.append(sid, user("hi"))
    finally:
        os.umask(old)
    assert store.root == home / "data" / "sessions"
    assert mode(home / "data") == 0o700
    assert mode(store.root) == 0o700
    for name in (f"{sid}.jsonl", "sessions.json", "sessions.lock"):
        assert mode(store.root / name) == 0o600, name


def test_loose_existing_directory_and_file_are_tightened(tmp_path: Path) -> None:
    root = tmp_path / "h"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    store = HistoryStore(root)
    assert mode(root) == 0o700
    sid = store.create("x").id
    os.chmod(session_file(store, sid), 0o644)
    store.append(sid, user("hi"))
    assert mode(session_file(store, sid)) == 0o600


def test_ensure_private_dir_refuses_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(paths.UnsafePathError):
        paths.ensure_private_dir(tmp_path / "f")


# ---------------------------------------------------------------- records


def test_round_trip_with_metadata(store: HistoryStore) -> None:
    sid = store.create("Intake", model="kimi-k3").id
    records = [
        {"role": "system", "content": "Be brief."},
        user("Hello\nthere ✓", time=1700000000.5),
        assistant("Hi.", "", interrupted=True, effort="max", thinking=True,
                  sampler={"greedy": False, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 2**64 - 1},
                  tokens={"prompt": 30, "reasoning": 0, "content": 2}, speed={"decode_tps": 1.5}),
        user(""),
    ]
    stored = [store.append(sid, r) for r in records]
    loaded = store.load(sid)
    assert loaded.problems == []
    assert loaded.records == stored
    assert all("time" in r for r in stored)  # added when absent, kept when given
    assert stored[1]["time"] == 1700000000.5
    assert [r["content"] for r in loaded.records] == ["Be brief.", "Hello\nthere ✓", "Hi.", ""]
    info = loaded.info
    assert (info.name, info.n_messages, info.model) == ("Intake", 4, "kimi-k3")
    # The spec fields come first in the file, in the peer's order.
    line = session_file(store, sid).read_text().splitlines()[3]
    assert list(json.loads(line))[:4] == ["role", "content", "reasoning_content", "interrupted"]


@pytest.mark.parametrize("record, reason", [
    ({"role": "tool", "content": "x"}, "role"),
    ({"role": "user"}, "content is missing"),
    ({"role": "user", "content": 3}, "content must be a string"),
    ({"role": "user", "content": "x", "reasoning_content": "r"}, "only allowed on assistant"),
    ({"role": "user", "content": "x", "interrupted": True}, "only allowed on assistant"),
    ({"role": "user", "content": "x", "colour": "red"}, "unknown field"),
    ({"role": "user", "content": "x", "time": float("nan")}, "time"),
    ({"role": "user", "content": "x", "effort": "medium"}, "effort"),
    ({"role": "user", "content": "x", "tokens": {"prompt": -1}}, "tokens.prompt"),
    ({"role": "user", "content": "x", "sampler": {"top_k": True}}, "sampler.top_k"),
    ({"role": "user", "content": "bad \ud800"}, "surrogate"),
    ("not a dict", "JSON object"),
])
def test_invalid_records_are_refused(store: HistoryStore, record: Any, reason: str) -> None:
    sid = store.create("x").id
    before = session_file(store, sid).read_bytes()
    with pytest.raises(HistoryError, match=reason):
        store.append(sid, record)
    assert session_file(store, sid).read_bytes() == before


def test_role_order_is_enforced(store: HistoryStore) -> None:
    sid = store.create("x").id
    with pytest.raises(HistoryError, match="first record"):
        store.append(sid, assistant("no"))
    store.append(sid, user("a"))
    with pytest.raises(HistoryError, match="after 'user'"):
        store.append(sid, user("b"))
    with pytest.raises(HistoryError, match="after 'user'"):
        store.append(sid, {"role": "system", "content": "late"})
    store.append(sid, assistant("ok"))
    # Another instance (another process) sees the same order from the file itself.
    with pytest.raises(HistoryError, match="after 'assistant'"):
        HistoryStore(store.root).append(sid, assistant("again"))


def test_bad_ids_and_missing_sessions(store: HistoryStore) -> None:
    for bad in ("../etc", "", ".hidden", "a/b", "x" * 65):
        with pytest.raises(HistoryError, match="invalid session id"):
            store.load(bad)
    with pytest.raises(HistoryError, match="no session"):
        store.append("nope", user("x"))
    with pytest.raises(HistoryError, match="no session"):
        store.load("nope")
    with pytest.raises(HistoryError):
        store.create("line\nbreak")


# ---------------------------------------------------------------- damage


def test_truncated_last_line_is_reported_and_the_rest_kept(store: HistoryStore) -> None:
    sid = three_turns(store)
    path = session_file(store, sid)
    data = path.read_bytes()
    path.write_bytes(data[:-7])  # a crash cut the last record short
    loaded = store.load(sid)
    assert [r["content"] for r in loaded.records] == ["first", "one"]
    assert len(loaded.problems) == 1 and "line 4" in loaded.problems[0] and "incomplete" in loaded.problems[0]

    # Appending after the damage must not glue the new record onto the fragment.
    store.append(sid, user("retyped"))
    loaded = store.load(sid)
    assert [r["content"] for r in loaded.records] == ["first", "one", "retyped"]
    assert len(loaded.problems) == 1 and "line 4" in loaded.problems[0]
    assert store.list()[0].n_messages == 3


def test_garbage_lines_in_the_middle_are_skipped(store: HistoryStore) -> None:
    sid = three_turns(store)
    path = session_file(store, sid)
    lines = path.read_bytes().splitlines(keepends=True)
    damaged = lines[:2] + [b"{not json\n", b"\xff\xfe binary\n", b'{"role": "robot", "content": ""}\n'] + lines[2:]
    path.write_bytes(b"".join(damaged))
    loaded = store.load(sid)
    assert [r["content"] for r in loaded.records] == ["first", "one", "second"]
    assert len(loaded.problems) == 3
    assert "line 3: not valid JSON" in loaded.problems[0]
    assert "line 4: not valid UTF-8" in loaded.problems[1]
    assert "line 5: invalid record" in loaded.problems[2]


def test_lost_line_breaking_the_order_is_reported_but_kept(store: HistoryStore) -> None:
    sid = three_turns(store)
    path = session_file(store, sid)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:2] + lines[3:]))  # the assistant line vanished
    loaded = store.load(sid)
    assert [r["content"] for r in loaded.records] == ["first", "second"]
    assert "line 3" in loaded.problems[0] and "lost" in loaded.problems[0]


def test_disk_full_during_save_leaves_the_file_valid(store: HistoryStore, monkeypatch: pytest.MonkeyPatch) -> None:
    sid = three_turns(store)
    path = session_file(store, sid)
    before = path.read_bytes()
    real_write = os.write
    calls = []

    def full_disk_write(fd: int, data: Any) -> int:
        # The first call gets half the line on disk, the next finds the disk full: the usual
        # shape of ENOSPC on a nearly full file system.
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full_disk_write)
    with pytest.raises(HistoryError, match="disk is full.*not saved"):
        store.append(sid, assistant("a long answer " * 20))
    monkeypatch.setattr(os, "write", real_write)

    assert len(calls) == 2  # the partial write really happened before the failure
    assert path.read_bytes() == before
    assert store.load(sid).problems == []
    assert store.list()[0].n_messages == 3
    store.append(sid, assistant("saved later"))  # the same turn can be saved once space is back
    assert [r["content"] for r in store.load(sid).records][-1] == "saved later"


def test_failed_fsync_is_rolled_back(store: HistoryStore, monkeypatch: pytest.MonkeyPatch) -> None:
    sid = three_turns(store)
    before = session_file(store, sid).read_bytes()

    def broken_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(HistoryError, match="Input/output error"):
        store.append(sid, assistant("x"))
    monkeypatch.undo()
    assert session_file(store, sid).read_bytes() == before


def test_index_write_failure_after_a_durable_record_is_not_an_error(
        store: HistoryStore, monkeypatch: pytest.MonkeyPatch) -> None:
    sid = three_turns(store)

    def no_space(path: Path, data: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(paths, "atomic_write", no_space)
    store.append(sid, assistant("kept"))  # the record is on disk: this save succeeded
    monkeypatch.undo()
    assert store.load(sid).records[-1]["content"] == "kept"
    assert store.list()[0].n_messages == 4  # the stale index entry is repaired by size


# ---------------------------------------------------------------- concurrency


def _append_many(root: str, name: str, count: int, barrier: Any) -> None:
    store = HistoryStore(Path(root))
    barrier.wait()
    sid = store.create(name).id
    index = Path(root) / "sessions.json"
    for i in range(count):
        record = user(f"{name} {i}") if i % 2 == 0 else assistant(f"{name} {i}", tokens={"content": i})
        store.append(sid, record)
        # Only this process writes this session, so with the index lock its entry is exact
        # after every append; without it the other process's updates would clobber it.
        entry = json.loads(index.read_text())["sessions"][sid]
        if entry["n_messages"] != i + 1:
            raise SystemExit(f"index lost an update: {entry['n_messages']} != {i + 1}")


def test_two_processes_append_to_different_sessions_at_once(tmp_path: Path) -> None:
    root = tmp_path / "h"
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_append_many, args=(str(root), name, 200, barrier)) for name in ("alpha", "beta")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0

    # The raw index, before list() gets a chance to repair anything: every update landed.
    raw = json.loads((root / "sessions.json").read_text())["sessions"]
    assert sorted(e["name"] for e in raw.values()) == ["alpha", "beta"]
    for sid, entry in raw.items():
        assert entry["n_messages"] == 200
        assert entry["bytes"] == (root / f"{sid}.jsonl").stat().st_size

    store = HistoryStore(root)
    infos = store.list()
    assert sorted((i.name, i.n_messages) for i in infos) == [("alpha", 200), ("beta", 200)]
    for info in infos:
        loaded = store.load(info.id)
        assert loaded.problems == []
        assert [r["content"] for r in loaded.records] == [f"{info.name} {i}" for i in range(200)]


# ---------------------------------------------------------------- index


def test_corrupt_index_is_rebuilt(store: HistoryStore) -> None:
    sid = three_turns(store)
    store.rename(sid, "Renamed")
    index = store.root / "sessions.json"
    index.write_text('{"version": 1, "sessions": {"x": ')
    infos = store.list()
    assert [(i.id, i.name, i.n_messages) for i in infos] == [(sid, "Renamed", 3)]
    assert json.loads(index.read_text())["sessions"][sid]["n_messages"] == 3
    assert mode(index) == 0o600

    index.unlink()
    assert [i.id for i in HistoryStore(store.root).list()] == [sid]


def test_stale_index_entries_are_repaired(store: HistoryStore) -> None:
    sid = three_turns(store)
    gone = store.create("gone").id
    index = store.root / "sessions.json"
    doc = json.loads(index.read_text())
    doc["sessions"][sid]["n_messages"] = 1  # pretend a crash came between record and index
    doc["sessions"][sid]["bytes"] = 10
    index.write_text(json.dumps(doc))
    session_file(store, gone).unlink()
    assert [(i.id, i.n_messages) for i in store.list()] == [(sid, 3)]


# ---------------------------------------------------------------- rename, delete, export


def test_rename_and_delete(store: HistoryStore) -> None:
    sid = three_turns(store)
    other = store.create("other").id
    info = store.rename(sid, "Smith v. Jones")
    assert info.name == "Smith v. Jones"
    assert store.load(sid).info.name == "Smith v. Jones"
    assert store.load(sid).records[-1]["content"] == "second"  # records untouched
    assert {i.id: i.name for i in HistoryStore(store.root).list()}[sid] == "Smith v. Jones"

    store.delete(sid)
    assert not session_file(store, sid).exists()
    assert [i.id for i in store.list()] == [other]
    with pytest.raises(HistoryError, match="no session"):
        store.append(sid, assistant("x"))  # never resurrected
    with pytest.raises(HistoryError, match="no session"):
        store.delete(sid)
    with pytest.raises(HistoryError):
        store.rename(other, "")


def test_export_markdown(store: HistoryStore) -> None:
    sid = store.create("Consult").id
    store.append(sid, {"role": "system", "content": "You are careful."})
    store.append(sid, user("What is **X**?"))
    store.append(sid, assistant("X is Y.", "Line one\nLine two", interrupted=True))
    md = store.export_markdown(sid)
    assert md.startswith("# Consult\n")
    for heading in ("## System", "## User", "## Assistant"):
        assert heading in md
    assert "What is **X**?" in md and "X is Y." in md
    assert "> Line one\n> Line two" in md
    assert "[interrupted]" in md
    assert md.index("## User") < md.index("## Assistant")


def test_export_json_round_trips(store: HistoryStore) -> None:
    sid = three_turns(store)
    doc = json.loads(store.export_json(sid))
    assert doc["records"] == store.load(sid).records
    assert doc["session"]["name"] == "Case 12" and doc["session"]["id"] == sid
    assert doc["problems"] == []


def test_export_for_the_peer_drops_metadata(store: HistoryStore) -> None:
    sid = store.create("p").id
    store.append(sid, user("q", time=1.0))
    store.append(sid, assistant("a", "r", effort="low", interrupted=True))
    store.append(sid, user("q2"))
    store.append(sid, {"role": "assistant", "content": "no thinking"})
    lines = [json.loads(line) for line in store.export_peer_jsonl(sid).splitlines()]
    assert [list(line) for line in lines] == [
        ["role", "content"], ["role", "content", "reasoning_content"], ["role", "content"], ["role", "content"]]
    assert lines[1] == {"role": "assistant", "content": "a", "reasoning_content": "r"}


def test_record_problem_is_public_and_matches_append() -> None:
    assert history.record_problem({"role": "user", "content": ""}) is None
    assert history.record_problem({"role": "assistant", "content": "", "interrupted": "yes"})
