"""The server's parts without a socket: request checks, stop strings, the state pool, the API
key file, the binding rules (refused before any model is opened)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from k3chat.runtime import Failure
from k3chat.server.pool import StatePool
from k3chat.server.protocol import ApiError, parse_chat, parse_completion
from k3chat.server.serve import is_loopback, read_api_key
from k3chat.server.worker import StopStrings

USER = [{"role": "user", "content": "2 + 3 = ?"}]


def _chat(**kw: object) -> object:
    return parse_chat({"model": "m", "messages": USER, **kw}, "m")


def test_greedy_unless_sampling_is_asked_for() -> None:
    assert _chat().sampler.greedy
    assert _chat(temperature=0).sampler.greedy
    sampled = _chat(temperature=0.7, top_k=-1, seed=-1).sampler
    assert not sampled.greedy and sampled.temperature == 0.7 and sampled.top_k == 0
    assert sampled.seed == (1 << 64) - 1  # a negative seed taken as two's complement


def test_thinking_and_effort_fields() -> None:
    assert (_chat().thinking, _chat().effort) == (True, "max")
    assert (_chat(reasoning_effort="low").thinking, _chat(reasoning_effort="low").effort) == (True, "low")
    assert _chat(reasoning_effort="none").thinking is False
    assert _chat(chat_template_kwargs={"enable_thinking": False}).thinking is False
    assert _chat(chat_template_kwargs={"thinking": True, "thinking_effort": "high"}).effort == "high"
    with pytest.raises(ApiError, match="one or the other"):
        _chat(chat_template_kwargs={"thinking": False}, reasoning_effort="low")
    with pytest.raises(ApiError, match="medium"):
        _chat(reasoning_effort="medium")


def test_messages_are_checked() -> None:
    parts = parse_chat({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                     {"type": "text", "text": "b"}]},
                                     {"role": "user", "content": "x"}]}, "m")
    assert parts.messages[0] == {"role": "system", "content": "ab"}
    resent = parse_chat({"messages": USER + [{"role": "assistant", "content": "5", "reasoning": "r"}] + USER}, "m")
    assert resent.messages[1]["reasoning_content"] == "r" and resent.turn == 2
    for bad, fragment in [
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "only text parts"),
        (USER + [{"role": "assistant", "content": "5"}], "last message"),
        ([{"role": "user"}, "hello"], r"messages\[1\] must be an object"),
    ]:
        with pytest.raises(ApiError, match=fragment) as info:
            parse_chat({"messages": bad}, "m")
        assert info.value.status == 400


def test_unsupported_fields_are_refused_not_ignored() -> None:
    for field, value in [("n", 3), ("presence_penalty", 0.5), ("tools", [{"type": "function"}]),
                         ("logprobs", True), ("response_format", {"type": "json_object"})]:
        with pytest.raises(ApiError) as info:
            _chat(**{field: value})
        assert info.value.status == 400 and info.value.param == field
    assert _chat(n=1, presence_penalty=0, logprobs=False).sampler.greedy


def test_limits_and_model() -> None:
    assert _chat(max_completion_tokens=9).max_tokens == 9
    assert _chat(stop="x").stop == ["x"]
    for field, value in [("max_tokens", 0), ("max_tokens", 1.5), ("stop", [""]), ("stop", 3), ("top_p", 0),
                         ("stream", "yes")]:
        with pytest.raises(ApiError):
            _chat(**{field: value})
    with pytest.raises(ApiError) as info:
        parse_chat({"model": "other", "messages": USER}, "m")
    assert info.value.status == 404 and info.value.code == "model_not_found"
    assert parse_completion({"prompt": ["abc"]}, "m").prompt == "abc"
    with pytest.raises(ApiError, match="prompt"):
        parse_completion({"prompt": [1, 2]}, "m")


def test_stop_strings_across_chunks() -> None:
    s = StopStrings(["</x>", "END"])
    assert s.push("ab") == ("ab", False)
    assert s.push("c<") == ("c", False)  # "<" may begin "</x>": held
    assert s.push("/") == ("", False)
    assert s.push("y") == ("</y", False)  # it did not: released
    assert s.push("E") == ("", False)
    assert s.push("ND and more") == ("", True)
    t = StopStrings(["zz"])
    assert t.push("az") == ("a", False)
    assert t.flush() == "z"  # the end of the answer releases what was held


def _state(n: int) -> bytearray:
    return bytearray(n)


def test_pool_keeps_the_longest_prefix_within_its_budget() -> None:
    pool = StatePool(budget=100)
    assert pool.put([1, 2], _state(40)) and pool.put([1, 2, 3, 4], _state(40))
    assert pool.best_for([1, 2, 3, 4, 5]).ids == (1, 2, 3, 4)
    assert pool.best_for([1, 2, 9]).ids == (1, 2)
    assert pool.best_for([1, 2]) is None  # a state must be shorter than the prompt ...
    logits = np.zeros(4, dtype=np.float32)
    assert pool.put([7, 8], _state(4), logits)
    assert pool.best_for([7, 8]).logits is logits  # ... unless it carries the prompt's logits
    assert pool.bytes == 40 + 40 + 4 + 16
    pool.best_for([1, 2, 3, 4, 5])  # used: the most recent
    assert pool.put([5, 6], _state(30))  # evicts the least recently used: [1, 2]
    assert not pool.holds([1, 2]) and pool.holds([1, 2, 3, 4]) and pool.bytes <= 100
    assert not pool.put([9], _state(101))  # never fits: not kept, nothing evicted
    assert pool.holds([1, 2, 3, 4]) and pool.bytes <= 100


def test_api_key_file_must_be_private_and_non_empty(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("  s3cret-key\n")
    os.chmod(key, 0o644)
    with pytest.raises(Failure, match="chmod 600") as info:
        read_api_key(str(key))
    assert info.value.code == 2 and "s3cret" not in info.value.message
    os.chmod(key, 0o600)
    assert read_api_key(str(key)) == b"s3cret-key"
    key.write_text("\n")
    with pytest.raises(Failure, match="empty"):
        read_api_key(str(key))
    with pytest.raises(Failure, match="cannot read"):
        read_api_key(str(tmp_path / "missing"))


def test_loopback_addresses() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "192.168.1.10", "example.com", ""))


def _serve(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from k3chat.cli import main
    code = main(["serve", *argv])
    return code, capsys.readouterr().err


def test_another_host_needs_a_key_and_is_refused_before_opening(capsys: pytest.CaptureFixture[str],
                                                                 tmp_path: Path) -> None:
    code, err = _serve(["--demo", "--host", "0.0.0.0"], capsys)
    assert code == 2 and "--api-key-file" in err and "Planning memory" not in err


@pytest.mark.parametrize("value", ["-1", "65", "four"])
def test_a_bad_speculative_value_is_refused_before_opening(capsys: pytest.CaptureFixture[str], value: str) -> None:
    code, err = _serve(["--demo", "--speculative", value], capsys)
    assert code == 2 and "--speculative" in err and "drafted tokens" in err and "Planning memory" not in err


def _worker_answers(model_dir: Path, speculative: int, sampler: object) -> tuple[list[object], bytes, list[int]]:
    """Two chat jobs on one worker (repeat-after-me: the demo model quotes the prompt, so drafts
    get verified): the outcomes, the engine state the worker holds afterwards, and its draft
    counters."""
    import threading

    from k3chat.server.worker import EngineWorker, Failed, Job, JobEvent, Outcome
    from k3chat.template import encode, render
    from k3chat.tokenizer import Tokenizer
    from k3engine.model import Model

    model = Model(model_dir)
    tok = Tokenizer.from_dir(model_dir)
    worker = EngineWorker(model, tok, context=256, pool_budget=0, state_size=lambda n: 0, speculative=speculative)
    worker.start()
    outcomes: list[object] = []
    messages: list[dict[str, str]] = [{"role": "user", "content": "Repeat after me: the old map shows a river."}]
    try:
        for turn in (1, 2):
            prompt = encode(render(messages, thinking=False, effort=None, add_generation_prompt=True), tok)
            done = threading.Event()
            got: list[JobEvent] = []

            def emit(event: JobEvent) -> None:
                if isinstance(event, (Outcome, Failed)):
                    got.append(event)
                    done.set()

            worker.submit(Job(prompt=prompt, sampler=sampler, max_tokens=40, emit=emit,  # type: ignore[arg-type]
                              thinking=False, turn=turn))
            assert done.wait(120), "the worker did not answer"
            outcome = got[0]
            assert isinstance(outcome, Outcome), outcome
            outcomes.append(outcome)
            messages += [{"role": "assistant", "content": outcome.content},
                         {"role": "user", "content": "Say this back to me exactly: a small boat is on the lake."}]
        assert worker._session is not None
        state = bytes(worker._session.export_state())  # the worker thread is idle between jobs
    finally:
        worker.stop_after_step()
        worker.close()
        model.close()
    return outcomes, state, [worker.drafts_proposed, worker.drafts_accepted]


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_serve_speculative_answers_equal_serial_answers(seeded: bool) -> None:
    from k3chat.demo import model_dir
    from k3chat.sampler import SamplerSettings

    demo = model_dir()
    sampler = (SamplerSettings(greedy=False, temperature=0.7, top_k=6, seed=99) if seeded else SamplerSettings())
    serial, serial_state, none = _worker_answers(demo, 0, sampler)
    assert none == [0, 0]
    proposed = 0
    for n in (1, 4, 8):
        fast, state, drafts = _worker_answers(demo, n, sampler)
        assert fast == serial, f"--speculative {n} changed an answer"
        assert state == serial_state, f"--speculative {n}: the engine state after the answers differs"
        assert 0 <= drafts[1] <= drafts[0]
        proposed += drafts[0]
    assert proposed > 0, "no draft was verified: the test would not exercise speculation"


def test_demo_and_model_dir_together_are_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, err = _serve([str(tmp_path), "--demo"], capsys)
    assert code == 2 and "not both" in err


def test_only_serve_loads_the_http_stack() -> None:
    """Without `serve`, k3chat opens no socket: the command line does not even import the
    HTTP server (the parser knows `serve` by its options alone)."""
    import subprocess
    import sys
    import tempfile

    code = ("import sys, k3chat.cli; k3chat.cli.build_parser().parse_args(['serve', '--demo']); "
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('uvicorn', 'starlette', 'k3chat.server.app'));"
            "assert not loaded and 'k3chat.server.app' not in sys.modules, loaded")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=tempfile.gettempdir())
