"""History store: privacy modes, durability, damaged lines, full disk, concurrency, exports."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import stat
import subprocess
import sys
import time
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
    # Fresh interpreters, as two `k3chat run` would be: a forked copy of this pytest process
    # would inherit its engine threads (reader threads, the compute pool) without them, and
    # a model left for the garbage collector hung or crashed such a child (see test_fork_safety).
    ctx = multiprocessing.get_context("spawn")
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
    # Reasoning set apart: a quote holding an inert code block.
    assert "> **Reasoning**\n>\n> ```text\n> Line one\n> Line two\n> ```" in md
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


# ---------------------------------------------------------------- names with controls


@pytest.mark.parametrize("name", ["csi \x9b31m", "nel \x85", "rlo \u202eevil", "isolate \u2066x\u2069",
                                  "esc \x1b[2J", "del \x7f", "lone \udcff"])
def test_names_with_c1_or_bidi_controls_are_refused(store: HistoryStore, name: str) -> None:
    with pytest.raises(HistoryError, match="control characters"):
        store.create(name)
    sid = store.create("fine").id
    with pytest.raises(HistoryError, match="control characters"):
        store.rename(sid, name)
    assert store.info(sid).name == "fine"


def test_bad_names_read_back_are_reported_and_shown_escaped(store: HistoryStore) -> None:
    sid = store.create("fine").id
    path = session_file(store, sid)
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    header["name"] = "Hdr\x9b2J\u202e"
    path.write_text(json.dumps(header) + "\n")
    loaded = store.load(sid)  # no crash
    assert loaded.info.name == "Hdr\\x9b2J\\u202e"
    assert len(loaded.problems) == 1 and "line 1" in loaded.problems[0] and "name refused" in loaded.problems[0]
    with open(path, "a") as f:
        f.write(json.dumps({"k3chat": "rename", "name": "Ren\x1b]0;t\x07\nx"}) + "\n")
    loaded = store.load(sid)
    assert loaded.info.name == "Ren\\x1b]0;t\\x07\\nx"
    assert "line 2" in loaded.problems[-1]
    assert HistoryStore(store.root).list()[0].name == "Ren\\x1b]0;t\\x07\\nx"  # the index too


# ---------------------------------------------------------------- truncate anchoring


def _contents(store: HistoryStore, sid: str) -> list[str]:
    return [r["content"] for r in store.load(sid).records]


def test_records_are_numbered_and_truncate_names_the_last_kept(store: HistoryStore) -> None:
    sid = three_turns(store)
    store.append(sid, assistant("two"))
    assert [r["seq"] for r in store.load(sid).records] == [1, 2, 3, 4]
    store.truncate(sid, 3)  # regenerate the last answer
    stored = store.append(sid, assistant("two again"))
    assert stored["seq"] == 5  # numbers are never reused
    line = json.loads(session_file(store, sid).read_text().splitlines()[-2])
    assert (line["k3chat"], line["seq"], line["records"]) == ("truncate", 3, 3)
    store.truncate(sid, 2)  # edit the last message
    store.append(sid, user("second, edited"))
    assert _contents(store, sid) == ["first", "one", "second, edited"]
    assert [r["seq"] for r in store.load(sid).records] == [1, 2, 6]
    store.truncate(sid, 0)
    assert _contents(store, sid) == [] and not store.load(sid).problems


def test_a_damaged_line_before_a_truncate_cannot_bring_back_a_superseded_answer(store: HistoryStore) -> None:
    sid = three_turns(store)
    store.append(sid, assistant("superseded"))
    store.truncate(sid, 3)
    store.append(sid, assistant("the kept answer"))
    path = session_file(store, sid)
    lines = path.read_bytes().splitlines(keepends=True)
    lines[1] = b"{damaged\n"  # the first record; the truncate after it kept 3 records
    path.write_bytes(b"".join(lines))
    loaded = store.load(sid)
    assert [r["content"] for r in loaded.records] == ["one", "second", "the kept answer"]
    assert "superseded" not in [r["content"] for r in loaded.records]
    loud = [p for p in loaded.problems if "truncate could not be applied exactly" in p]
    assert len(loud) == 1 and "line 6" in loud[0]


def test_a_lost_last_kept_record_is_reported(store: HistoryStore) -> None:
    sid = three_turns(store)
    store.append(sid, assistant("superseded"))
    store.truncate(sid, 3)
    path = session_file(store, sid)
    lines = path.read_bytes().splitlines(keepends=True)
    del lines[3]  # "second", the last record the truncate keeps
    path.write_bytes(b"".join(lines))
    loaded = store.load(sid)
    assert [r["content"] for r in loaded.records] == ["first", "one"]
    assert any("number 3) is missing" in p for p in loaded.problems)


def test_old_files_without_sequence_numbers_still_load_and_continue(store: HistoryStore) -> None:
    sid = store.create("old").id
    path = session_file(store, sid)
    old = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a1"},
           {"k3chat": "truncate", "records": 1, "time": 1.0}, {"role": "assistant", "content": "a2"}]
    with open(path, "a") as f:
        f.write("".join(json.dumps(x) + "\n" for x in old))
    loaded = store.load(sid)
    assert _contents(store, sid) == ["q", "a2"] and not loaded.problems
    store.append(sid, user("q2"))  # numbered after the old lines (3 record lines so far)
    assert store.load(sid).records[-1]["seq"] == 4
    store.truncate(sid, 2)  # keeps old "a2" (implicitly number 3)
    assert _contents(store, sid) == ["q", "a2"] and not store.load(sid).problems
    # An old count-based truncate after a damaged line is reported, not trusted silently.
    lines = path.read_bytes().splitlines(keepends=True)
    lines[1] = b"garbage\n"
    path.write_bytes(b"".join(lines))
    assert any("old format" in p for p in store.load(sid).problems)


# ---------------------------------------------------------------- stale temp files


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temp_files_are_swept_when_the_store_opens_and_on_delete(home: Path) -> None:
    store = HistoryStore()
    sid = store.create("x").id
    other = store.create("y").id
    store.append(sid, user("secret"))
    dead, alive = _dead_pid(), os.getpid()
    stale = store.root / f".{sid}.jsonl.{dead}.0123456789ab.tmp"
    index_stale = store.root / f".sessions.json.{dead}.0123456789ab.tmp"
    in_use = store.root / f".{other}.jsonl.{alive}.0123456789ab.tmp"
    mine_in_use = store.root / f".{sid}.jsonl.{alive}.ba9876543210.tmp"
    unrelated = store.root / "notes.tmp"
    for p in (stale, index_stale, in_use, mine_in_use, unrelated):
        p.write_text("a copy of the conversation")
    HistoryStore()  # opening sweeps what dead writers left
    assert not stale.exists() and not index_stale.exists()
    assert in_use.exists() and mine_in_use.exists() and unrelated.exists()
    store.delete(sid)  # a deleted session leaves no copy, whoever wrote it
    assert not mine_in_use.exists() and in_use.exists()


def test_cli_rm_removes_the_state_file_and_its_temp_copies(home: Path) -> None:
    from k3chat.cli import main
    from k3chat.conversation import state_path

    store = HistoryStore()
    sid = store.create("x").id
    keep = store.create("y").id
    sp = state_path(sid)
    sp.parent.mkdir(parents=True, exist_ok=True)
    sp.write_bytes(b"state")
    temps = [sp.parent / f".{sid}.k3state.{pid}.0123456789ab.tmp" for pid in (_dead_pid(), os.getpid())]
    other_stale = sp.parent / f".{keep}.k3state.{_dead_pid()}.0123456789ab.tmp"
    for p in (*temps, other_stale):
        p.write_bytes(b"state copy")
    assert main(["sessions", "rm", sid, "--yes"]) == 0
    assert not sp.exists() and not any(p.exists() for p in temps)
    assert not other_stale.exists()  # stale (dead writer): swept when the store opened


# ---------------------------------------------------------------- exports that stay inert


def test_markdown_export_never_renders_model_text_live(store: HistoryStore) -> None:
    from markdown_it import MarkdownIt

    evil = ("![pixel](https://tracker.example/p.png) [click](https://x.example) <img src=https://x.example/a>"
            "\n<script>fetch('https://x.example')</script>\n<https://auto.example>\n"
            "````\n```\n![closed the fence?](https://x.example/b.png)\n```` `` ` done")
    sid = store.create("![name](https://x.example/n.png) <b>bold</b>").id
    store.append(sid, user(evil))
    store.append(sid, assistant(evil, "reasoning " + evil))
    md = store.export_markdown(sid)
    html = MarkdownIt("commonmark", {"html": True}).render(md)
    for live in ("<img", "<a ", "<script", "<b>", 'src="', 'href="'):
        assert live not in html, live
    # The text itself is all there, as text: verbatim where typed or reasoned, and in the
    # answer escaped so that it renders as that text.
    assert md.count("![pixel](https://tracker.example/p.png)") == 2
    assert html.count("![pixel](<code>https://tracker.example/p.png</code>)") == 1


def test_markdown_export_renders_answers_as_markdown_that_cannot_fetch(store: HistoryStore) -> None:
    from markdown_it import MarkdownIt

    answer = ("**Void**, because:\n\n- clause `Vec<T>` 7\n- see https://court.example/ruling and www.law.example\n"
              "- ![pixel](https://t.example/p.png) [click](https://c.example) <img src=https://x.example/a>\n\n"
              "| a | b |\n|---|---|\n| `x | <img src=https://x.example/t>` | y |\n\n"
              "- p `\n- ` q ` <img src=https://x.example/list> `\n\n"
              "```python\nif a < b: print('<b>')\n```\n\n```\nnever closed <script>fetch(1)</script>")
    sid = store.create("Ruling").id
    store.append(sid, user("Is it valid?"))
    store.append(sid, assistant(answer, "check <img src=https://x.example/r>"))
    store.append(sid, user("Thanks"))
    md = store.export_markdown(sid)
    # The renderer that links the most (GitHub-like: raw HTML on, bare URLs linked).
    html = MarkdownIt("gfm-like", {"html": True, "linkify": True}).render(md)
    for live in ("<img", "<a ", "<script", "<b>", 'src="', 'href="'):
        assert live not in html, live
    assert "<strong>Void</strong>" in html and "<li>clause <code>Vec&lt;T&gt;</code> 7</li>" in html
    assert "<code>https://court.example/ruling</code>" in html and "<table>" in html
    assert '<pre><code class="language-python">if a &lt; b: print(\'&lt;b&gt;\')' in html
    # The fence the answer left open is closed: the next message is still a heading.
    assert "<h2>User" in html.split("never closed")[1]
    assert "<blockquote>" in html and "check &lt;img" in html


def test_show_text_is_plain_and_readable(store: HistoryStore) -> None:
    sid = store.create("Consult").id
    store.append(sid, user("What is *X*?"))
    store.append(sid, assistant("X is **Y** [1].", "Line one\nLine two", interrupted=True))
    text = store.export_text(sid)
    lines = text.splitlines()
    assert lines[0] == "Consult"
    assert "You (" in text and "K3 (" in text and "[interrupted]:" in text
    assert "What is *X*?" in lines and "X is **Y** [1]." in lines  # as written, nothing escaped
    assert "  \u2502 Line one" in lines and "  \u2502 Line two" in lines
    assert "```" not in text and "\\" not in text


def test_rename_refuses_a_name_another_session_has(store: HistoryStore) -> None:
    a = store.create("alpha").id
    b = store.create("beta").id
    with pytest.raises(history.NameTaken, match="another session is already named 'alpha'"):
        store.rename(b, "alpha")
    assert store.load(b).info.name == "beta"  # nothing appended
    assert store.rename(a, "alpha").name == "alpha"  # its own name again is fine
    assert store.find("alpha").id == a


def test_names_made_from_a_message_are_numbered_when_taken(store: HistoryStore) -> None:
    first = store.create("hello", numbered=True)
    second = store.create("hello", numbered=True)
    third = store.create("hello", numbered=True)
    assert (first.name, second.name, third.name) == ("hello", "hello (2)", "hello (3)")
    assert store.find("hello (2)").id == second.id


def test_peer_export_drops_unrendered_records_and_reports_damage(store: HistoryStore) -> None:
    sid = store.create("p").id
    store.append(sid, user("hello"))
    store.append(sid, assistant("", "", interrupted=True))  # Ctrl-C during the prefill
    store.append(sid, user("hello again"))
    store.append(sid, assistant("fine", "r"))
    store.append(sid, user("and?"))
    store.append(sid, assistant("", "", interrupted=True))
    text, warnings = store.export_peer_jsonl_checked(sid)
    lines = [json.loads(x) for x in text.splitlines()]
    assert [x["content"] for x in lines] == ["hello", "hello again", "fine", "and?"]
    assert sum("an empty interrupted answer, left out" in w for w in warnings) == 2
    assert any("two user messages in a row" in w for w in warnings)
    assert store.export_peer_jsonl(sid) == text
    path = session_file(store, sid)
    with open(path, "ab") as f:
        f.write(b"{broken\n")
    _, warnings = store.export_peer_jsonl_checked(sid)
    assert any(w.startswith("damaged line not exported: line") for w in warnings)


def test_find_by_id_or_name_and_refuse_a_shared_name(tmp_path: Path) -> None:
    from k3chat.history import AmbiguousSession

    store = HistoryStore(tmp_path / "h")
    a = store.create("alpha")
    b1, b2 = store.create("beta"), store.create("beta")
    assert store.find(a.id) == store.find("alpha") and store.find("alpha").id == a.id
    assert store.find("nope") is None
    with pytest.raises(AmbiguousSession, match="use an id"):
        store.find("beta")
    assert store.find(b2.id).id == b2.id and b1.id != b2.id


# ---------------------------------------------------------------- issue 12: history and sessions


def _under(path: Any, root: Path) -> bool:
    try:
        return os.path.abspath(os.fsdecode(path)).startswith(str(root))
    except TypeError:
        return False  # an fd


@pytest.fixture
def read_only_fs(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Make a directory behave as a read-only mount (EROFS for every change under it), as a
    chmod -w home does for a user that is not root: tests often run as root, whom chmod does
    not stop."""
    def install(root: Path) -> None:
        def refuse(path: Any) -> None:
            raise OSError(errno.EROFS, "Read-only file system", os.fsdecode(path))

        real_open = os.open
        writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

        def ro_open(path: Any, flags: int, mode: int = 0o777, *, dir_fd: Any = None) -> int:
            if flags & writing and _under(path, root):
                refuse(path)
            return real_open(path, flags, mode, dir_fd=dir_fd)

        monkeypatch.setattr(os, "open", ro_open)
        for name in ("mkdir", "chmod", "unlink", "rmdir"):
            real = getattr(os, name)

            def guarded(path: Any, *args: Any, _real: Any = real, **kw: Any) -> Any:
                if _under(path, root):
                    refuse(path)
                return _real(path, *args, **kw)

            monkeypatch.setattr(os, name, guarded)
        for name in ("replace", "rename"):
            real = getattr(os, name)

            def guarded2(src: Any, dst: Any, *args: Any, _real: Any = real, **kw: Any) -> Any:
                if _under(src, root) or _under(dst, root):
                    refuse(dst)
                return _real(src, dst, *args, **kw)

            monkeypatch.setattr(os, name, guarded2)

    return install


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_read_only_home_still_lists_shows_and_exports(home: Path, tmp_path: Path, read_only_fs: Any,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from k3chat.cli import main

    store = HistoryStore()
    sid = three_turns(store)
    store.append(sid, assistant("two"))
    before = _snapshot(home)
    read_only_fs(home)
    assert main(["sessions", "list"]) == 0
    assert "Case 12" in capsys.readouterr().out
    assert main(["sessions", "show", "Case 12"]) == 0
    assert "second" in capsys.readouterr().out
    assert main(["sessions", "export", sid, "--format", "json"]) == 0
    assert [r["content"] for r in json.loads(capsys.readouterr().out)["records"]] == ["first", "one", "second", "two"]
    dest = tmp_path / "out.md"  # outside the read-only home
    assert main(["sessions", "export", "Case 12", "-o", str(dest)]) == 0
    assert "## Assistant" in dest.read_text()
    # A stale index is worked around in memory, not repaired on disk.
    assert main(["sessions", "list", "--json"]) == 0
    capsys.readouterr()
    # Commands that write still fail, clearly, and nothing changed.
    assert main(["sessions", "rename", sid, "New"]) == 1
    err = capsys.readouterr().err
    assert "sessions.lock" in err and "write access" in err
    assert _snapshot(home) == before


def test_read_only_home_without_history_lists_nothing(home: Path, read_only_fs: Any,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from k3chat.cli import main

    home.mkdir(mode=0o700)
    read_only_fs(home)
    assert main(["sessions", "list"]) == 0
    assert "no sessions" in capsys.readouterr().err
    assert main(["sessions", "show", "x"]) == 2
    assert list(home.iterdir()) == []


def test_read_only_store_shares_the_lock_file_opened_read_only(store: HistoryStore,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import fcntl

    sid = three_turns(store)
    taken: list[tuple[int, int]] = []
    real_flock = fcntl.flock

    def spy(fd: int, op: int) -> None:
        taken.append((fcntl.fcntl(fd, fcntl.F_GETFL), op))
        real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", spy)
    reader = HistoryStore(store.root, read_only=True)
    assert [i.id for i in reader.list()] == [sid]
    assert taken and all(flags & os.O_ACCMODE == os.O_RDONLY and op == fcntl.LOCK_SH for flags, op in taken)
    with pytest.raises(HistoryError, match="read-only"):
        reader.rename(sid, "x")


def _create_when_told(root: Path, go: Path, name: str) -> subprocess.Popen[str]:
    code = ("import sys, time\n"
            "from pathlib import Path\n"
            "from k3chat.history import HistoryStore, SessionExists\n"
            "store = HistoryStore(Path(sys.argv[1]))\n"
            "while not Path(sys.argv[2]).exists():\n"
            "    time.sleep(0.001)\n"
            "try:\n"
            "    print('created', store.create(sys.argv[3], unique_name=True).id)\n"
            "except SessionExists as exc:\n"
            "    print('exists', exc.info.id)\n")
    return subprocess.Popen([sys.executable, "-c", code, str(root), str(go), name], stdout=subprocess.PIPE,
                            text=True)


def test_two_processes_creating_one_new_name_make_one_session(tmp_path: Path) -> None:
    root = tmp_path / "h"
    HistoryStore(root)
    go = tmp_path / "go"
    procs = [_create_when_told(root, go, "S") for _ in range(3)]
    time.sleep(0.5)  # all three are waiting
    go.touch()
    outs = [p.communicate(timeout=60)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(kind for kind, _ in outs) == ["created", "exists", "exists"]
    assert len({sid for _, sid in outs}) == 1  # the losers were told the winner's id
    assert [i.name for i in HistoryStore(root).list()] == ["S"]


def test_unique_create_refuses_a_name_taken_by_a_file_the_index_misnames(store: HistoryStore) -> None:
    from k3chat.history import SessionExists

    sid = three_turns(store)
    index = store.root / "sessions.json"
    doc = json.loads(index.read_text())
    doc["sessions"][sid]["name"] = "Something else"  # the index lies; the file says "Case 12"
    index.write_text(json.dumps(doc))
    with pytest.raises(SessionExists, match=sid):
        store.create("Case 12", unique_name=True)
    assert [i.name for i in store.list()] == ["Case 12"]  # and the index was repaired


def test_find_by_name_believes_the_session_file_not_a_stale_index(store: HistoryStore) -> None:
    sid = three_turns(store)
    other = store.create("Other").id
    index = store.root / "sessions.json"
    doc = json.loads(index.read_text())
    doc["sessions"][sid]["name"] = "Renamed in the index only"
    doc["sessions"][other]["name"] = "Case 12"  # and a wrong claim to the name
    index.write_text(json.dumps(doc))
    found = store.find("Case 12")
    assert found is not None and found.id == sid and found.name == "Case 12"
    repaired = json.loads(index.read_text())["sessions"]
    assert (repaired[sid]["name"], repaired[other]["name"]) == ("Case 12", "Other")
    assert store.find("Renamed in the index only") is None
    # A read-only store answers from the files too, without writing.
    index.write_text(json.dumps(doc))
    found = HistoryStore(store.root, read_only=True).find("Case 12")
    assert found is not None and found.id == sid
    assert json.loads(index.read_text()) == doc


def _glue(path: Path, line: int, cut: int) -> None:
    """Damage line ``line`` (1-based): keep its first ``cut`` bytes and lose its line break,
    so the next line is glued onto the fragment."""
    lines = path.read_bytes().splitlines(keepends=True)
    lines[line - 1] = lines[line - 1][:cut]
    path.write_bytes(b"".join(lines))


def test_answer_after_a_damaged_user_line_is_kept(store: HistoryStore) -> None:
    sid = three_turns(store)
    store.append(sid, assistant("the answer to second"))
    _glue(session_file(store, sid), 4, 25)  # "second" lost half its bytes and its line break
    loaded = store.load(sid)
    assert [r["content"] for r in loaded.records] == ["first", "one", "the answer to second"]
    assert len(loaded.skipped) == 1
    assert "line 4" in loaded.skipped[0] and "25 damaged bytes skipped" in loaded.skipped[0]
    # Only a lost line break: nothing is skipped at all.
    sid2 = three_turns(store)
    store.append(sid2, assistant("two"))
    path = session_file(store, sid2)
    _glue(path, 4, len(path.read_bytes().splitlines()[3]))
    loaded = store.load(sid2)
    assert [r["content"] for r in loaded.records] == ["first", "one", "second", "two"]
    assert loaded.skipped == [] and "2 lines without the line break between them" in loaded.problems[0]


def test_exports_say_exactly_which_lines_were_skipped(store: HistoryStore) -> None:
    sid = three_turns(store)
    store.append(sid, assistant("two"))
    path = session_file(store, sid)
    lines = path.read_bytes().splitlines(keepends=True)
    lines[3] = b'{"role": "user", "content": "sec\n'  # the user line is damaged, the answer intact
    path.write_bytes(b"".join(lines))
    loaded = store.load(sid)
    assert [r["content"] for r in loaded.records] == ["first", "one", "two"]
    assert len(loaded.skipped) == 1 and loaded.skipped[0].startswith("line 4:")
    assert len(loaded.problems) == 2 and "line 5" in loaded.problems[1] and "kept" in loaded.problems[1]
    md = store.export_markdown(sid)
    assert "1 damaged line(s) of the session file were skipped" in md and "1 warning(s)" in md
    assert "two" in md
    _, warnings = store.export_peer_jsonl_checked(sid)
    assert [w.split(":")[0] for w in warnings] == ["damaged line not exported", "exported, with a warning"]


@pytest.mark.parametrize("make", ["directory", "symlink"])
def test_an_index_that_is_not_a_file_is_named_with_what_to_do(store: HistoryStore, make: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from k3chat.cli import main

    sid = three_turns(store)
    index = store.root / "sessions.json"
    index.unlink()
    if make == "directory":
        index.mkdir()
    else:
        index.symlink_to(store.root / f"{sid}.jsonl")
    with pytest.raises(HistoryError, match=f"cannot read the history index {index}: it is a") as err:
        store.list()
    assert "move it out of the way" in str(err.value)
    stored = store.append(sid, assistant("kept"))  # the record itself is saved all the same
    assert store.load(sid).records[-1] == stored
    assert main(["sessions", "list"]) == 1
    out = capsys.readouterr().err
    assert str(index) in out and "Errno" not in out


def test_atomic_write_refuses_a_directory_before_creating_anything(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "dir"
    target.mkdir()
    before = sorted(tmp_path.iterdir())
    created: list[str] = []
    real_open = os.open

    def spy(path: Any, flags: int, *args: Any, **kw: Any) -> int:
        if flags & os.O_CREAT:
            created.append(os.fsdecode(path))
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", spy)
    with pytest.raises(IsADirectoryError, match="is a directory"):
        paths.atomic_write(target, b"text")
    assert created == [] and sorted(tmp_path.iterdir()) == before


def test_answering_lock_names_the_process_that_holds_it(store: HistoryStore) -> None:
    from k3chat.history import SessionBusy

    sid = three_turns(store)
    other = HistoryStore(store.root)  # another open of the lock file, as another process has
    with store.answering(sid):
        with pytest.raises(SessionBusy, match=rf"being answered by another k3chat \(pid {os.getpid()}\)"):
            other.check_idle(sid)
        with pytest.raises(SessionBusy):
            with other.answering(sid):
                pass
    other.check_idle(sid)  # released
    with other.answering(sid):
        pass
    assert stat.S_IMODE(os.stat(store.root / f"{sid}.answering").st_mode) == 0o600
    store.delete(sid)
    assert not (store.root / f"{sid}.answering").exists()


def test_wipe_overwrites_every_copy_before_unlinking(store: HistoryStore) -> None:
    from k3chat.history import SessionBusy

    sid = three_turns(store)
    keep = store.create("keep").id
    path = session_file(store, sid)
    temp = store.root / f".{sid}.jsonl.{os.getpid()}.0123456789ab.tmp"
    temp.write_bytes(b"a copy of: first one second")
    fds = {p: os.open(p, os.O_RDONLY) for p in (path, temp, store.root / "sessions.json")}
    sizes = {p: os.fstat(fd).st_size for p, fd in fds.items()}
    try:
        with HistoryStore(store.root).answering(sid):
            with pytest.raises(SessionBusy):
                store.wipe(sid)
        assert path.exists()
        wiped = store.wipe(sid)
        assert sorted(wiped) == sorted([path, temp])
        for p, fd in fds.items():
            data = os.pread(fd, sizes[p] + 1, 0)
            assert len(data) == sizes[p] and data == bytes(sizes[p]), p  # the old bytes are zeros now
    finally:
        for fd in fds.values():
            os.close(fd)
    assert not path.exists() and not temp.exists()
    assert list(json.loads((store.root / "sessions.json").read_text())["sessions"]) == [keep]
    assert b"Case 12" not in (store.root / "sessions.json").read_bytes()
    with pytest.raises(HistoryError, match="no session"):
        store.wipe(sid)


def test_wipe_caveat_says_what_this_file_system_cannot_promise(tmp_path: Path) -> None:
    dev = os.stat(tmp_path).st_dev
    line = f"36 35 {os.major(dev)}:{os.minor(dev)} / /data rw,relatime shared:1 - {{}} /dev/sda1 rw"
    cow = history.wipe_caveat(tmp_path, mountinfo=line.format("btrfs"))
    assert "btrfs, a copy-on-write file system" in cow and "may still hold" in cow
    plain = history.wipe_caveat(tmp_path, mountinfo=line.format("ext4"))
    assert "the history is on ext4" in plain and ("does not guarantee" in plain or "non-rotating" in plain)
    unknown = history.wipe_caveat(tmp_path, mountinfo="")
    assert "file system is unknown" in unknown and "encryption" in unknown
