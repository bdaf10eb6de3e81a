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
    assert "Reasoning:\n\n```text\nLine one\nLine two\n```" in md
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
    # The text itself is all there, as text.
    assert md.count("![pixel](https://tracker.example/p.png)") == 3


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
