"""Exact speculative decoding (issue 10, item 3).

The premise first: the logits of positions fed together in one pass are bit-identical to
feeding them one at a time, on every fixture and the demo model. Then the engine's verify
feed and its rollback (``Session.verify`` / ``Session.accept``), the drafter, and the
conversation loop, whose output and final state must equal serial decoding's bit for bit.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from k3engine.model import Model

SEQ = [(i * 37 + 11) % 900 for i in range(16)]  # a prompt every vocabulary holds (>= 991 ids)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.fixture(scope="module", params=["tiny", "wide", "demo"])
def any_model(request: pytest.FixtureRequest) -> Model:
    """Every fixture of engine/fixture.py and the shipped demo model."""
    if request.param == "demo":
        from k3chat.demo import model_dir

        path = model_dir()
        if not (path / "config.json").is_file():
            pytest.fail(f"the shipped demo model is missing at {path}")
    else:
        path = request.getfixturevalue(f"{request.param}_dir")
    m = Model(path, threads=2)
    yield m
    m.close()


@pytest.mark.parametrize("together", [2, 5, 9])
def test_positions_fed_together_have_serial_logits(any_model: Model, together: int) -> None:
    head, tail = SEQ[:5], SEQ[5:5 + together]
    serial = any_model.session(32)
    serial.feed(head)
    one_by_one = np.stack([serial.feed([t]) for t in tail])
    batched = any_model.session(32)
    batched.feed(head)
    assert same_bits(batched.feed(tail, all_logits=True), one_by_one)
    assert batched.export_state() == serial.export_state()


# ------------------------------------------------------------------ engine: verify and accept


def _serial(m: Model, head: list[int], tail: list[int]) -> tuple[np.ndarray, bytes]:
    s = m.session(32)
    s.feed(head)
    rows = np.stack([s.feed([t]) for t in tail]) if tail else np.empty((0, m.vocab), np.float32)
    return rows, bytes(s.export_state())


@pytest.mark.parametrize("n", [1, 4, 9])
def test_verify_then_accept_any_prefix_equals_serial_feeding(any_model: Model, n: int) -> None:
    head, tail = SEQ[:5], SEQ[5:5 + n]
    rows, _ = _serial(any_model, head, tail)
    for keep in sorted({0, 1, n // 2, n - 1, n}):
        s = any_model.session(32)
        s.feed(head)
        before = bytes(s.export_state())
        assert same_bits(s.verify(tail), rows)
        assert bytes(s.export_state()) == before, "a verify feed must not advance the session"
        s.accept(keep)
        _, state = _serial(any_model, head, tail[:keep])
        assert s.length == len(head) + keep and s.ids == head + tail[:keep]
        assert bytes(s.export_state()) == state, f"state after accepting {keep} of {n} differs from serial"
        # and the session goes on exactly as a serial one: the next step's logits agree
        nxt = SEQ[5 + keep]
        s2 = any_model.session(32)
        s2.feed(head + tail[:keep])
        assert same_bits(s.feed([nxt]), s2.feed([nxt]))


def test_verify_with_many_threads_and_scalar_kernels_keeps_bits(tiny_dir: Path) -> None:
    ref = Model(tiny_dir, threads=1)
    rows, state = _serial(ref, SEQ[:5], SEQ[5:12])
    for threads, scalar in ((4, False), (3, True)):
        m = Model(tiny_dir, threads=threads, scalar=scalar)
        s = m.session(32)
        s.feed(SEQ[:5])
        assert same_bits(s.verify(SEQ[5:12]), rows)
        s.accept(7)
        assert bytes(s.export_state()) == state


def test_accept_needs_a_pending_verify(tiny_dir: Path) -> None:
    from k3engine.model import EngineError

    m = Model(tiny_dir)
    s = m.session(32)
    s.feed(SEQ[:5])
    with pytest.raises(EngineError, match="no verify feed to accept"):
        s.accept(1)
    s.verify(SEQ[5:8])
    with pytest.raises(EngineError, match="can accept 0..3 verified positions, got 4"):
        s.accept(4)
    s.feed([SEQ[5]])  # another feed drops the pending verify: its rows are overwritten
    with pytest.raises(EngineError, match="no verify feed to accept"):
        s.accept(1)
    assert s.length == 6 and not s.tainted


def test_verify_past_the_context_end_is_refused_and_changes_nothing(tiny_dir: Path) -> None:
    from k3engine.model import EngineError

    m = Model(tiny_dir)
    s = m.session(8)
    s.feed(SEQ[:5])
    before = bytes(s.export_state())
    with pytest.raises(EngineError, match="context full: 5 positions fed \\+ 4 to verify > capacity 8"):
        s.verify(SEQ[5:9])
    assert bytes(s.export_state()) == before and not s.tainted
    s.verify(SEQ[5:8])  # exactly up to the end is fine
    s.accept(3)
    assert s.length == 8


def test_cancel_during_verify_leaves_the_session_as_it_was(tiny_dir: Path) -> None:
    from k3engine.model import Cancelled, CancelFlag

    m = Model(tiny_dir)
    s = m.session(32)
    s.feed(SEQ[:5])
    before = bytes(s.export_state())
    flag = CancelFlag()
    flag.set()
    with pytest.raises(Cancelled):
        s.verify(SEQ[5:9], cancel=flag)
    assert not s.tainted and bytes(s.export_state()) == before
    from k3engine.model import EngineError
    with pytest.raises(EngineError, match="no verify feed"):
        s.accept(1)
    rows, state = _serial(m, SEQ[:5], SEQ[5:9])
    assert same_bits(s.verify(SEQ[5:9]), rows)
    s.accept(4)
    assert bytes(s.export_state()) == state


def test_read_failure_mid_verify_leaves_the_session_as_it_was(tiny_dir: Path) -> None:
    from k3engine.model import ExpertReadError

    from k3engine.model import StreamOptions

    # a cache of 3 experts of 16,384 B: a 4-token pass reads its layer's experts again
    m = Model(tiny_dir, streaming=StreamOptions(expert_cache_bytes=3 * 16384))
    s = m.session(32)
    s.feed(SEQ[:5])
    before = bytes(s.export_state())
    last = m.config.n_layers - 1
    m.inject_fault(last, -2)  # the last layer: every earlier layer of the pass has run
    with pytest.raises(ExpertReadError):
        s.verify(SEQ[5:9])
    assert not s.tainted and bytes(s.export_state()) == before


# ------------------------------------------------------------------ the drafter


def test_drafter_proposes_what_followed_the_longest_recent_match() -> None:
    from k3chat.speculative import propose

    #        0  1  2  3  4  5  6  7  8  9
    toks = [1, 2, 3, 9, 1, 2, 4, 7, 8, 1, 2]
    assert propose(toks, 3) == [4, 7, 8]  # "1 2" last occurred at 4..5, followed by 4 7 8
    assert propose(toks + [3], 2) == [9, 1]  # the trigram "1 2 3" (at 0..2) is the longest match
    assert propose([5, 6, 7], 4) == []  # nothing repeats
    assert propose([4, 4], 3) == [4]  # a run proposes itself, up to the known tokens
    assert propose(toks, 0) == []


def test_drafter_never_drafts_a_stop_id() -> None:
    from k3chat.speculative import propose

    toks = [10, 11, 12, 99, 13, 10, 11]
    assert propose(toks, 5, stop_ids={99}) == [12]  # cut before the stop id 99
    assert propose(toks, 5, stop_ids=()) == [12, 99, 13, 10, 11]
    assert propose([10, 99, 10], 3, stop_ids={99}) == []


def test_drafter_index_equals_a_plain_scan() -> None:
    """The incremental index gives what a backwards scan for the longest suffix gives."""
    from k3chat.speculative import MAX_NGRAM, NgramDrafter

    rng = np.random.default_rng(3)
    toks = [int(x) for x in rng.integers(0, 6, size=300)]
    d = NgramDrafter()
    for i, t in enumerate(toks):
        d.append(t)
        seen = toks[:i + 1]
        want: list[int] = []
        for n in range(min(MAX_NGRAM, len(seen)), 0, -1):
            suffix = seen[-n:]
            hits = [j for j in range(len(seen) - n) if seen[j:j + n] == suffix]
            if hits:
                want = seen[hits[-1] + n:hits[-1] + n + 4]
                break
        assert d.propose(4) == want, f"after {i + 1} tokens"


# ------------------------------------------------------------------ the conversation loop

from k3chat.conversation import Conversation  # noqa: E402
from k3chat.history import HistoryStore  # noqa: E402
from k3chat.sampler import SamplerSettings  # noqa: E402
from k3chat.tokenizer import Tokenizer  # noqa: E402

GREEDY = SamplerSettings()
# peaked enough that a random-weight fixture repeats itself (so drafts get verified), random enough
# that the draws matter: a wrong draw order would change the tokens
SEEDED = SamplerSettings(greedy=False, temperature=0.7, top_p=0.95, top_k=6, seed=1234)


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> HistoryStore:
    monkeypatch.setenv("K3CHAT_HOME", str(tmp_path / "home"))
    return HistoryStore()


def _turn(m: Model, store: HistoryStore, spec: int, sampler: SamplerSettings, text: str,
          max_tokens: int = 40, **kw: object) -> tuple[object, bytes, Conversation]:
    conv = Conversation(m, Tokenizer.from_dir(m.dir), store, store.create("t").id, thinking=False,
                        sampler=sampler, max_tokens=max_tokens, state_files=False, speculative=spec, **kw)
    r = conv.send(text)
    assert r is not None
    return r, bytes(conv._live.export_state()), conv


def _scripted_drafts(monkeypatch: pytest.MonkeyPatch, ref: object, kind: str, vocab: int) -> None:
    """Replace the n-gram lookup by drafts that are all right (the serial run's own
    continuation) or all wrong (each of those ids plus one), so every fixture verifies both."""
    from k3chat.speculative import NgramDrafter

    want, start = list(ref.generated_ids), ref.prompt_tokens

    def propose(self: NgramDrafter, limit: int) -> list[int]:
        g = len(self.tokens) - start  # tokens sampled so far
        cont = [t for t in want[g:g + max(limit, 0)]]
        cut = next((i for i, t in enumerate(cont) if t in self.stop_ids), len(cont))
        cont = cont[:cut]
        return cont if kind == "right" else [(t + 1) % vocab for t in cont]

    monkeypatch.setattr(NgramDrafter, "propose", propose)


@pytest.mark.parametrize("drafts", ["ngram", "right", "wrong"])
@pytest.mark.parametrize("sampler", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_turn_is_bit_identical_to_serial_decoding(any_model: Model, store: HistoryStore,
                                                  sampler: SamplerSettings, drafts: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    text = "Repeat after me: the cat sat on the mat, the cat sat on the mat."
    ref, ref_state, _ = _turn(any_model, store, 0, sampler, text, max_tokens=24)
    assert ref.draft_proposed == 0
    if drafts != "ngram":
        _scripted_drafts(monkeypatch, ref, drafts, any_model.vocab)
    for n in (1, 4, 8):
        r, state, conv = _turn(any_model, store, n, sampler, text, max_tokens=24)
        assert r.generated_ids == ref.generated_ids, f"speculative {n} changed the output"
        assert (r.stop, r.answer) == (ref.stop, ref.answer)
        assert state == ref_state, f"speculative {n}: session state after the turn differs from serial"
        assert conv._fed == conv._live.ids
        assert 0 <= r.draft_accepted <= r.draft_proposed
        if drafts == "right":
            assert r.draft_proposed > 0 and r.draft_accepted == r.draft_proposed
        if drafts == "wrong":
            assert r.draft_proposed > 0 and r.draft_accepted == 0


class _Script:
    """A sampler factory emitting scripted ids (the engine runs as usual underneath)."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def __call__(self, settings: SamplerSettings, turn: int) -> object:
        it = iter(self.ids)

        class _S:
            def sample(self, logits: object) -> int:
                return next(it)

        return _S()


class _VerifySpy:
    def __init__(self, monkeypatch: pytest.MonkeyPatch, before: object = None) -> None:
        from k3engine.model import Session

        self.calls: list[tuple[int, int]] = []  # (session length, positions verified)
        real = Session.verify

        def verify(s: Session, ids: list[int], **kw: object) -> np.ndarray:
            self.calls.append((s.length, len(ids)))
            if before is not None:
                before()
            return real(s, ids, **kw)

        monkeypatch.setattr(Session, "verify", verify)


def _fixed_drafts(monkeypatch: pytest.MonkeyPatch, script: list[int]) -> None:
    """Drafts read from a script: after g sampled tokens, script[g:] (ignoring stop ids)."""
    from k3chat.speculative import NgramDrafter

    def propose(self: NgramDrafter, limit: int) -> list[int]:
        if not hasattr(self, "start"):
            self.start = len(self.tokens) - 1  # the first lookup follows the first sampled token
        g = len(self.tokens) - self.start
        return script[g:g + max(limit, 0)]

    monkeypatch.setattr(NgramDrafter, "propose", propose)


def test_a_stop_sampled_inside_a_draft_ends_the_turn_and_is_never_fed(
        tiny_dir: Path, store: HistoryStore, monkeypatch: pytest.MonkeyPatch) -> None:
    m = Model(tiny_dir)
    tok = Tokenizer.from_dir(tiny_dir)
    words = tok.encode_text(" one two three")
    from k3chat.template import Grammar

    script = words + list(Grammar(tok).closure) + [tok.end_of_msg_id]
    # the drafts are right up to the end id, which they skip: the end is sampled with draft
    # positions left in the block
    _fixed_drafts(monkeypatch, script[:-1] + [7, 8, 9, 10])
    spy = _VerifySpy(monkeypatch)
    conv = Conversation(m, tok, store, store.create("t").id, thinking=False, state_files=False,
                        speculative=8, sampler_factory=_Script(script))
    r = conv.send("Count")
    assert r is not None and r.stop == "end" and r.generated_ids == script
    prompt = r.prompt_tokens
    assert spy.calls and spy.calls[0][1] > len(words)  # the block reached past the end id
    assert conv._live.ids == conv._fed and len(conv._fed) == prompt + len(script) - 1  # the end id not fed
    serial = m.session(conv.context)
    serial.feed(conv._fed)
    assert bytes(conv._live.export_state()) == bytes(serial.export_state())


def test_the_token_limit_inside_a_draft_clips_what_is_verified(
        tiny_dir: Path, store: HistoryStore, monkeypatch: pytest.MonkeyPatch) -> None:
    m = Model(tiny_dir)
    tok = Tokenizer.from_dir(tiny_dir)
    _fixed_drafts(monkeypatch, list(range(100, 140)))
    spy = _VerifySpy(monkeypatch)
    limit = 6
    conv = Conversation(m, tok, store, store.create("t").id, thinking=False, state_files=False,
                        speculative=8, max_tokens=limit, sampler_factory=_Script(list(range(100, 140))))
    r = conv.send("Count")
    assert r is not None and r.stop == "limit" and r.generated_ids == list(range(100, 100 + limit))
    # the first id comes from the prefill, the last from the last verified row: limit - 2 drafted
    assert r.draft_accepted == r.draft_proposed == limit - 2
    # positions verified never reach past what the turn may still sample (nor the context)
    assert all(length + n <= r.prompt_tokens + limit - 1 for length, n in spy.calls)
    assert conv._fed == conv._live.ids == conv._live.ids[:r.prompt_tokens] + list(range(100, 100 + limit - 1))


def test_abort_during_a_verify_keeps_the_state_usable(tiny_dir: Path, store: HistoryStore,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    m = Model(tiny_dir)
    tok = Tokenizer.from_dir(tiny_dir)
    ids = tok.encode_text(" a b a b a b a b a b")
    holder: dict[str, Conversation] = {}
    calls = [0]

    def second_ctrl_c() -> None:
        calls[0] += 1
        if calls[0] == 2:  # both signals arrive while the second verify is in flight
            holder["c"].cancel()
            holder["c"].abort()

    _fixed_drafts(monkeypatch, ids)
    _VerifySpy(monkeypatch, before=second_ctrl_c)
    conv = holder["c"] = Conversation(m, tok, store, store.create("t").id, thinking=False, state_files=False,
                                      speculative=3, sampler_factory=_Script(ids))
    r = conv.send("Go")
    assert r is not None and r.stop == "cancelled" and r.interrupted
    # the verify was stopped between layers; the session is where it was before it, not tainted
    assert not conv._live.tainted and conv._fed == conv._live.ids
    assert conv._fed == conv._live.ids[:r.prompt_tokens] + r.generated_ids[:-1]
    serial = m.session(conv.context)
    serial.feed(conv._fed)
    assert bytes(conv._live.export_state()) == bytes(serial.export_state())


# ------------------------------------------------------------------ the command line


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("K3CHAT_HOME", str(h))
    return h


def test_run_json_reports_drafts_and_the_answer_equals_serial(home: Path, tmp_path: Path) -> None:
    """The demo model repeating a sentence: drafts from the prompt are right, the answer is the
    serial one, and run --json says how many drafted tokens were proposed and kept."""
    import json

    from k3chat.cli import main

    prompt = "Repeat after me: the little red fox jumps over the quiet brown dog."
    got = {}
    for n in (0, 8):
        out = tmp_path / f"r{n}.json"
        code = main(["run", "--demo", "--prompt", prompt, "--no-think", "--max-tokens", "40", "--threads", "2",
                     "--speculative", str(n), "--json", str(out)])
        assert code == 0
        got[n] = json.loads(out.read_text())
    assert got[8]["generated_ids"] == got[0]["generated_ids"] and got[8]["answer"] == got[0]["answer"]
    assert (got[0]["draft_proposed"], got[0]["draft_accepted"]) == (0, 0)
    assert got[8]["draft_proposed"] > 0 and 0 < got[8]["draft_accepted"] <= got[8]["draft_proposed"]


def test_speculative_from_the_config_file_and_its_errors(home: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from k3chat.cli import main
    from k3chat.demo import model_dir

    (home / "config").mkdir(parents=True)
    config = home / "config" / "config.toml"
    config.write_text(f'model = "{model_dir()}"\nspeculative = 4\n[thinking]\nenabled = false\n')
    out = tmp_path / "r.json"
    assert main(["run", "--prompt", "Repeat after me: a cat.", "--max-tokens", "12", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["draft_proposed"] > 0
    assert main(["run", "--prompt", "Repeat after me: a cat.", "--max-tokens", "12", "--speculative", "0",
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["draft_proposed"] == 0  # the command line beats the file
    capsys.readouterr()
    config.write_text('speculative = -2\n')
    assert main(["run", "--demo", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "line 1" in err and "speculative" in err and "from 0 (off) to 64" in err
    config.write_text('')
    assert main(["run", "--demo", "--prompt", "hi", "--speculative", "lots"]) == 2
    assert "--speculative" in capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    (["run", "--remote", "http://127.0.0.1:9", "--prompt", "hi", "--speculative", "4"],
     "--speculative is for the local model"),
    (["chat", "--remote", "http://127.0.0.1:9", "--speculative", "4"], "--speculative is for the local model"),
    (["run", "--demo", "--ids", "1,2", "--speculative", "4"], "--speculative need --prompt"),
])
def test_speculative_where_it_cannot_apply_is_a_usage_error(home: Path, argv: list[str], needle: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from k3chat.cli import main

    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_the_remote_backend_refuses_speculative_decoding(home: Path) -> None:
    from k3chat.history import HistoryStore
    from k3chat.remote import RemoteConversation

    store = HistoryStore()
    with pytest.raises(ValueError, match="the remote server decodes on its own"):
        RemoteConversation(None, "m", store, store.create("r").id, speculative=4)  # type: ignore[arg-type]


# ------------------------------------------------------------------ memory: the plan counts it


def test_the_planner_counts_the_verify_record_the_engine_allocates(any_model: Model) -> None:
    from k3engine.planner import verify_record_bytes

    cfg = any_model.config
    for n in (1, 4, 8, 64):
        assert verify_record_bytes(cfg, n) == any_model.verify_bytes(n + 1) + (n + 1) * cfg.vocab * 4
    assert verify_record_bytes(cfg, 0) == 0


def test_plan_shows_the_verify_record_within_the_budget(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from k3chat.demo import model_dir
    from k3engine.config import load_config
    from k3engine.planner import main_plan, make_plan, tensor_sizes_from_dir, verify_record_bytes

    cfg = load_config(model_dir())
    ts = tensor_sizes_from_dir(model_dir(), cfg)
    off = make_plan(cfg, ts, 1 << 30, 4096, check_machine=False)
    on = make_plan(cfg, ts, 1 << 30, 4096, check_machine=False, speculative=8)
    assert "speculative verify" not in off.floor_parts  # off: plans (and the README table) unchanged
    assert on.floor_parts["speculative verify"] == verify_record_bytes(cfg, 8)
    assert on.floor_bytes == off.floor_bytes + verify_record_bytes(cfg, 8) and on.total <= on.budget
    out = tmp_path / "plan.json"
    assert main_plan([str(model_dir()), "--memory", "1G", "--no-machine-check", "--speculative", "8",
                      "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "speculative verify" in text and "up to 8 drafted tokens" in text
    assert json.loads(out.read_text())["plan"]["verify_bytes"] == verify_record_bytes(cfg, 8)
    assert main_plan([str(model_dir()), "--speculative", "65"]) == 2


def test_verify_with_lm_head_streamed_in_blocks_keeps_the_held_bits(tiny_dir: Path) -> None:
    """A verify pass computes every position's logits through lm_head: streamed in ragged
    row blocks (the 8 GB-class plan) it must give the held lm_head's bits, state included."""
    from k3engine.model import StreamOptions

    head, tail = SEQ[:5], SEQ[5:11]
    with Model(tiny_dir) as held, Model(tiny_dir, streaming=StreamOptions(head_block_rows=7)) as blocks:
        rows, state = _serial(held, head, tail)
        s = blocks.session(32)
        s.feed(head)
        assert same_bits(s.verify(tail), rows)
        s.accept(len(tail))
        assert bytes(s.export_state()) == state
        assert blocks.stats()["head_bytes_read"] > 0  # lm_head really streamed
