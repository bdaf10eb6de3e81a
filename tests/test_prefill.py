"""A long prefill a person can live with: progress, a stop at a chunk boundary, and a resume
that feeds only the rest (issue 9, item 3), on the tiny fixture.

Feeds are counted through a spy on Session.feed and through the engine's own tokens_fed
counter; expected counts come from the template and the tokenizer, never from the code that
feeds.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from k3chat import statefile
from k3chat.conversation import Conversation, engine_prefill_piece, state_path
from k3chat.events import PrefillProgress
from k3chat.history import HistoryStore
from k3chat.progress import PrefillMeter, progress_bar, progress_line
from k3chat.template import encode, render
from k3chat.tokenizer import Tokenizer
from k3engine.exit_codes import EXIT_INTERRUPTED, EXIT_OK
from k3engine.model import Model, Session, StreamOptions

PIECE = 16
DOCUMENT = " ".join(f"clause {i} of the lease" for i in range(24))  # about 250 tokens: many pieces


@pytest.fixture(scope="module")
def model(tiny_dir: Path) -> Model:
    return Model(tiny_dir, threads=1)


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> HistoryStore:
    monkeypatch.setenv("K3CHAT_HOME", str(tmp_path / "home"))
    return HistoryStore()


@pytest.fixture
def feeds(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    calls: list[list[int]] = []
    real = Session.feed

    def feed(self: Session, ids: Any, **kw: Any) -> Any:
        calls.append([int(i) for i in ids])
        return real(self, ids, **kw)

    monkeypatch.setattr(Session, "feed", feed)
    return calls


def prompt_ids(tok: Tokenizer, records: list[dict[str, Any]]) -> list[int]:
    return encode(render(records, thinking=False, effort=None, add_generation_prompt=True), tok)


def make(model: Model, tok: Tokenizer, store: HistoryStore, sid: str | None = None, **kw: Any) -> Conversation:
    kw.setdefault("prefill_piece", PIECE)
    return Conversation(model, tok, store, sid or store.create("doc").id, thinking=False, max_tokens=6, **kw)


# --------------------------------------------------------------------------- the meter


def test_meter_sends_the_start_the_end_and_at_most_one_event_per_interval() -> None:
    now = [0.0]
    got: list[Any] = []
    meter = PrefillMeter(100, got.append, interval=0.25, clock=lambda: now[0])
    meter.start()
    for _ in range(10):  # ten pieces of 10 tokens, 0.1 s apart
        now[0] += 0.1
        meter.advance(10)
    assert [(e.done, e.total) for e in got] == [(0, 100), (30, 100), (60, 100), (90, 100), (100, 100)]
    assert got[-1].seconds == pytest.approx(1.0) and got[-1].tokens_per_second == pytest.approx(100.0)
    meter.close()  # the last figures were sent already
    assert len(got) == 5


def test_meter_close_sends_where_a_stop_left_the_prefill() -> None:
    now = [0.0]
    got: list[Any] = []
    meter = PrefillMeter(100, got.append, interval=10.0, clock=lambda: now[0])
    meter.start()
    now[0] = 2.0
    meter.advance(40)  # inside the interval: not sent
    meter.close()
    assert [(e.done, e.total) for e in got] == [(0, 100), (40, 100)]
    assert got[-1].eta_seconds == pytest.approx(3.0)  # 60 more at 20 tok/s


def test_progress_line_and_bar_say_done_total_rate_and_eta() -> None:
    p = PrefillProgress(1024, 5000, 3.2)
    assert progress_line(p) == "prefill 1,024/5,000 tokens (20%), 320 tok/s, ETA 12 s"
    assert progress_bar(p, width=10) == "[##........]"
    assert progress_line(PrefillProgress(0, 5000, 0.0)) == "prefill 0/5,000 tokens (0%), - tok/s, ETA -"
    assert progress_line(PrefillProgress(5000, 5000, 125.0)) == "prefill 5,000/5,000 tokens (100%), 40 tok/s, 2 min 05 s"


# --------------------------------------------------------------------------- pieces


def test_prefill_reports_progress_in_pieces_and_keeps_the_answer_bits(model: Model, tok: Tokenizer,
                                                                      store: HistoryStore,
                                                                      feeds: list[list[int]]) -> None:
    events: list[Any] = []
    conv = make(model, tok, store, stats_every=1)
    r = conv.send(DOCUMENT, on_event=events.append)
    p = prompt_ids(tok, [{"role": "user", "content": DOCUMENT}])
    assert r is not None and r.prompt_tokens == len(p) > 10 * PIECE
    progress = [e for e in events if isinstance(e, PrefillProgress)]
    done = [e.done for e in progress]
    assert done[0] == 0 and done[-1] == len(p) and all(e.total == len(p) for e in progress)
    assert done == sorted(done) and len(set(done)) == len(done)  # monotonic, no repeats
    assert all(d % PIECE == 0 for d in done[:-1])  # sent at piece boundaries
    prefill_calls = feeds[: next(i for i, c in enumerate(feeds) if len(c) == 1)]
    assert sum(prefill_calls, []) == p and max(len(c) for c in prefill_calls) <= PIECE
    # Bit for bit: the same greedy answer as one feed of the whole prompt.
    whole = make(model, tok, store, prefill_piece=10**6)
    r2 = whole.send(DOCUMENT)
    assert r2 is not None and r2.generated_ids == r.generated_ids
    one = model.session(len(p) + 1)
    ref = one.feed(p)
    pieced = model.session(len(p) + 1)
    for i in range(0, len(p), PIECE):
        last = pieced.feed(p[i:i + PIECE])
    assert np.array_equal(ref, last)


def test_the_piece_is_the_engine_chunk_unless_every_weight_is_held(wide_dir: Path) -> None:
    held = Model(wide_dir, streaming=StreamOptions(prefill_chunk=500))
    assert engine_prefill_piece(held) == 64  # nothing is read twice: a finer piece is free
    slot = 16384  # one expert slot (test_streaming.SLOT): far fewer slots than experts
    streamed = Model(wide_dir, streaming=StreamOptions(prefill_chunk=200, expert_cache_bytes=9 * slot))
    assert engine_prefill_piece(streamed) == 200
    trunk = Model(wide_dir, streaming=StreamOptions(prefill_chunk=300, trunk_stream=True))
    assert engine_prefill_piece(trunk) == 300
    for m in (held, streamed, trunk):
        m.close()


def test_pieces_of_the_engine_chunk_read_each_expert_as_one_feed_does(wide_dir: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """With a bounded expert cache, feeding a prompt one chunk per call reads exactly the
    bytes one call of the whole prompt reads (each distinct expert once per chunk)."""
    monkeypatch.setenv("K3CHAT_HOME", str(tmp_path / "home"))
    wtok = Tokenizer.from_dir(wide_dir)
    read = {}
    for how in ("one call", "conversation"):
        m = Model(wide_dir, streaming=StreamOptions(prefill_chunk=24, expert_cache_bytes=9 * 16384))
        store = HistoryStore()
        conv = Conversation(m, wtok, store, store.create(how).id, thinking=False, max_tokens=1, state_files=False)
        p = prompt_ids(wtok, [{"role": "user", "content": DOCUMENT[:300]}])
        before = m.stats()["expert_bytes_read"]
        if how == "one call":
            m.session(len(p) + 8).feed(p)
        else:
            assert conv.prefill_piece == 24
            r = conv.send(DOCUMENT[:300])
            assert r is not None and r.prompt_tokens == len(p) > 3 * 24
        read[how] = m.stats()["expert_bytes_read"] - before
        m.close()
    assert read["conversation"] == read["one call"] > 0


# --------------------------------------------------------------------------- stop and resume


def _stop_after(holder: dict[str, Conversation], pieces: int) -> Any:
    """An event handler that asks the conversation to stop once ``pieces`` pieces were fed."""
    real = Session.feed
    count = [0]

    def feed(self: Session, ids: Any, **kw: Any) -> Any:
        out = real(self, ids, **kw)
        if len(ids) > 1:
            count[0] += 1
            if count[0] == pieces:
                holder["c"].cancel()  # as a Ctrl-C arriving while this piece was computed
        return out

    return feed


def test_a_stop_mid_prefill_saves_the_prefix_and_respond_feeds_only_the_rest(
        model: Model, tok: Tokenizer, store: HistoryStore, monkeypatch: pytest.MonkeyPatch) -> None:
    holder: dict[str, Conversation] = {}
    unpatched = Session.feed
    monkeypatch.setattr(Session, "feed", _stop_after(holder, 3))
    conv = holder["c"] = make(model, tok, store)
    sid = conv.session_id
    p = prompt_ids(tok, [{"role": "user", "content": DOCUMENT}])
    r = conv.send(DOCUMENT)
    assert r is not None and (r.pending, r.stop, r.generated_ids) == (True, "cancelled", [])
    assert r.prefilled_tokens == 3 * PIECE and r.state_saved
    # The history: the message, not yet answered.
    assert [(x["role"], x["content"]) for x in store.load(sid).records] == [("user", DOCUMENT)]
    # The state file holds exactly the first three pieces of the prompt.
    sf = statefile.load_state(state_path(sid), fingerprint=conv.fingerprint)
    from k3engine.model import decode_state
    assert sf.n_tokens == 3 * PIECE and list(decode_state(sf.payload).ids) == p[: 3 * PIECE]
    conv.close()
    monkeypatch.setattr(Session, "feed", unpatched)

    # A new process's Conversation continues from the boundary: the engine is fed the rest.
    before = model.stats()["tokens_fed"]
    again = make(model, tok, store, sid)
    assert again.pending_user
    r2 = again.respond()
    assert (r2.reuse_source, r2.reused_tokens, r2.prefilled_tokens) == ("state_file", 3 * PIECE, len(p) - 3 * PIECE)
    decode_feeds = len(r2.generated_ids) - 1
    assert model.stats()["tokens_fed"] - before == len(p) - 3 * PIECE + decode_feeds + r2.sync_tokens
    # ... and answers as an uninterrupted run does, bit for bit (greedy).
    fresh = make(model, tok, store)
    r3 = fresh.send(DOCUMENT)
    assert r3 is not None and r3.generated_ids == r2.generated_ids and r3.reused_tokens == 0


def test_abort_mid_prefill_keeps_the_message_but_saves_no_state(model: Model, tok: Tokenizer, store: HistoryStore,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    holder: dict[str, Conversation] = {}
    real = Session.feed
    count = [0]

    def feed(self: Session, ids: Any, **kw: Any) -> Any:
        if len(ids) > 1:
            count[0] += 1
            if count[0] == 3:  # both requests arrive while this piece is in flight
                holder["c"].cancel()
                holder["c"].abort()
        return real(self, ids, **kw)

    monkeypatch.setattr(Session, "feed", feed)
    conv = holder["c"] = make(model, tok, store)
    r = conv.send(DOCUMENT)
    assert r is not None and r.pending and not r.state_saved and conv._session.tainted
    assert r.prefilled_tokens == 2 * PIECE  # the aborted third piece does not count
    assert [x["role"] for x in store.load(conv.session_id).records] == ["user"]
    assert not state_path(conv.session_id).exists()
    assert r.message is not None and "aborted" in r.message


def test_a_follow_up_about_the_same_document_prefills_only_the_new_tokens(
        model: Model, tok: Tokenizer, store: HistoryStore, feeds: list[list[int]]) -> None:
    conv = make(model, tok, store)
    r1 = conv.send(DOCUMENT)
    assert r1 is not None
    question = "And the second clause?"
    records = conv.records
    p2 = prompt_ids(tok, records + [{"role": "user", "content": question}])
    history = encode(render(records, thinking=False, effort=None, add_generation_prompt=False), tok)
    # What is new: the question and the template's tokens around a user message (counted
    # with another message: they do not depend on its text).
    new = p2[len(history):]
    other = prompt_ids(tok, records + [{"role": "user", "content": "x"}])
    template = len(other) - len(history) - len(tok.encode_text("x"))
    assert p2[: len(history)] == history and len(new) == len(tok.encode_text(question)) + template
    mark = len(feeds)
    r2 = conv.send(question)
    assert r2 is not None and r2.reuse_source == "live" and r2.reused_tokens == len(history)
    assert r2.prefilled_tokens == len(new) and sum(feeds[mark:], [])[: len(new)] == new
    # The same through the state file, in a new Conversation (a new run).
    conv.close()
    later = make(model, tok, store, conv.session_id)
    p3 = prompt_ids(tok, later.records + [{"role": "user", "content": "Thanks"}])
    held = encode(render(later.records, thinking=False, effort=None, add_generation_prompt=False), tok)
    r3 = later.send("Thanks")
    assert r3 is not None and r3.reuse_source == "state_file" and r3.prefilled_tokens == len(p3) - len(held)


# --------------------------------------------------------------------------- run, as a subprocess

# Slows every prefill piece down (before the engine is called) and says when one starts, so
# that a signal sent then lands while the first piece is computed.
DRIVER = """
import sys, time
from k3engine.model import Session
real = Session.feed
delay = float(sys.argv[1])
def feed(self, ids, **kw):
    if len(ids) > 1:
        print("piece", file=sys.stderr, flush=True)
        time.sleep(delay)
    return real(self, ids, **kw)
Session.feed = feed
from k3chat.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _start(tmp_path: Path, home: Path, delay: float, *args: str) -> tuple[subprocess.Popen[str], queue.Queue[str]]:
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    proc = subprocess.Popen([sys.executable, str(driver), str(delay), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "K3CHAT_HOME": str(home)},
                            cwd=tmp_path)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True).start()  # type: ignore[union-attr]
    return proc, lines


def _wait_for(proc: subprocess.Popen[str], lines: queue.Queue[str], needle: str, seconds: float = 60) -> list[str]:
    deadline = time.monotonic() + seconds
    seen: list[str] = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.1)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        if needle in line:
            return seen
    proc.kill()
    raise AssertionError(f"no {needle!r} on stderr; it says: {''.join(seen)[-2000:]!r}")


def _end(proc: subprocess.Popen[str], lines: queue.Queue[str]) -> str:
    proc.wait(timeout=120)
    time.sleep(0.05)
    out = []
    while not lines.empty():
        out.append(lines.get())
    return "".join(out)


def _run(tiny_dir: Path, home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "k3chat", "run", str(tiny_dir), "--no-think", "--max-tokens", "4",
                           "--threads", "1", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "K3CHAT_HOME": str(home)})


def _stopped_run(tiny_dir: Path, tmp_path: Path, home: Path, sig: signal.Signals) -> tuple[dict[str, Any], str]:
    out = tmp_path / "stopped.json"
    proc, lines = _start(tmp_path, home, 0.5, "run", str(tiny_dir), "--prompt", DOCUMENT, "--no-think",
                         "--max-tokens", "4", "--threads", "1", "--session", "lease", "--json", str(out))
    first = _wait_for(proc, lines, "piece")  # after the first progress line
    assert any("k3chat: prefill 0/" in line for line in first), first
    proc.send_signal(sig)
    err = _end(proc, lines)
    assert proc.returncode == EXIT_INTERRUPTED, err
    return json.loads(out.read_text()), err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_mid_prefill_in_run_exits_5_keeping_the_message_and_the_prefix(
        tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sig: signal.Signals) -> None:
    home = tmp_path / "home"
    res, err = _stopped_run(tiny_dir, tmp_path, home, sig)
    piece = 64  # the plan holds every weight of the tiny fixture: pieces of RESIDENT_PIECE
    assert res["pending"] is True and res["stop"] == "cancelled" and res["exit_code"] == EXIT_INTERRUPTED
    assert res["prefilled_tokens"] % piece == 0 and 0 < res["prefilled_tokens"] < res["prompt_tokens"]
    assert res["generated_ids"] == [] and res["state_saved"] is True and res["prefill_seconds"] > 0
    assert "stopping after the chunk of the prompt in flight and saving what was read" in err
    assert "prefill stopped:" in err and f"--session {res['session']} --resume" in err and "Traceback" not in err
    monkeypatch.setenv("K3CHAT_HOME", str(home))
    records = HistoryStore().load(res["session"]).records
    assert [(r["role"], r["content"]) for r in records] == [("user", DOCUMENT)]  # kept, not yet answered
    from k3chat.conversation import model_fingerprint_for
    from k3engine.model import decode_state
    sf = statefile.load_state(state_path(res["session"]), fingerprint=model_fingerprint_for(tiny_dir))
    p = prompt_ids(Tokenizer.from_dir(tiny_dir), [{"role": "user", "content": DOCUMENT}])
    assert len(p) == res["prompt_tokens"]
    assert sf.n_tokens == res["prefilled_tokens"] and list(decode_state(sf.payload).ids) == p[: sf.n_tokens]


def test_run_resume_after_a_stopped_prefill_feeds_only_the_rest_and_answers_bit_for_bit(
        tiny_dir: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    stopped, _ = _stopped_run(tiny_dir, tmp_path, home, signal.SIGINT)
    held = stopped["prefilled_tokens"]
    resumed = _run(tiny_dir, home, "--session", "lease", "--resume", "--json", str(tmp_path / "resumed.json"))
    assert resumed.returncode == EXIT_OK, resumed.stderr
    res = json.loads((tmp_path / "resumed.json").read_text())
    assert (res["reuse_source"], res["reused_tokens"]) == ("state_file", held)
    assert res["prefilled_tokens"] == res["prompt_tokens"] - held == stopped["prompt_tokens"] - held
    # Counted by the engine (before the state sync): the rest of the prompt and the decode steps.
    decode_feeds = len(res["generated_ids"]) - 1
    assert res["stats"]["tokens_fed"] == res["prefilled_tokens"] + decode_feeds
    # The answer was cut at the limit, so the state is lined up with the stored text: from a
    # snapshot after the whole prompt, never by reading the document again.
    assert 0 < res["sync_tokens"] <= len(res["generated_ids"]) + 8
    # The answer equals an uninterrupted run's (greedy), bit for bit.
    whole = _run(tiny_dir, tmp_path / "other", "--prompt", DOCUMENT, "--json", str(tmp_path / "whole.json"))
    assert whole.returncode == EXIT_OK, whole.stderr
    ref = json.loads((tmp_path / "whole.json").read_text())
    assert ref["reused_tokens"] == 0 and ref["generated_ids"] == res["generated_ids"]
    # A follow-up about the document reads only the new message (from the saved state).
    follow = _run(tiny_dir, home, "--session", "lease", "--prompt", "Who pays?", "--json", str(tmp_path / "f.json"))
    assert follow.returncode == EXIT_OK, follow.stderr
    f = json.loads((tmp_path / "f.json").read_text())
    assert f["reuse_source"] == "state_file" and f["reused_tokens"] > res["prompt_tokens"]
    assert f["prefilled_tokens"] == f["prompt_tokens"] - f["reused_tokens"] < 40
