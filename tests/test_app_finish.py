"""The chat app, issue 8, what was left: the status bar at 80 and 120 columns, command-line
sampler options over a resumed session's stored ones, time to first token and per-turn time in
the answer's footer, vim-style movement, copying one code block, and a help screen that lists
every key binding. Pilot on the tiny fixture with scripted samples, as test_app."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from k3chat.history import HistoryStore
from k3chat.settings import Settings
from k3chat.tokenizer import Tokenizer

textual = pytest.importorskip("textual")

from test_app import Script, answer, home, make_app, model, run, screen_text, send, started, tok, until  # noqa: E402,F401

from k3chat.app.widgets.status import StatusBar, fitted  # noqa: E402

LONG_PLAN = "12 GB: trunk 20 pinned/41 streamed, 3000 expert slots"


# --------------------------------------------------------------------------- the status bar


def fill_status(status: StatusBar) -> None:
    """A busy turn on a streamed model: every field of the bar set, as wide as they get."""
    status.set_model("Kimi-K3-Instruct", LONG_PLAN)
    status.set_thinking(True, "high")
    status.set_sampler("sampling t 0.7 p 0.9 k 40")
    status.set_phase("answering")
    status.speed, status.cache, status.per_token = "1.2 s/tok", "cache 87%", "1.3 GB/tok read"
    status.set_context(12_345, 262_144)


@pytest.mark.parametrize("columns", [80, 120])
def test_the_context_figure_is_never_clipped(columns: int, home: Path, model: Any, tok: Tokenizer,
                                             tiny_dir: Path) -> None:
    app = make_app(model, tok, tiny_dir, Script())
    lines: list[str] = []

    async def scenario() -> None:
        async with app.run_test(size=(columns, 30)) as pilot:
            await started(pilot)
            fill_status(app.chat.status)
            await pilot.pause(0.1)
            lines.extend(ln for ln in screen_text(app).splitlines() if "answering" in ln)

    run(scenario)
    assert len(lines) == 1, lines
    line = lines[0]
    assert "ctx 12,345/256K" in line and "1.2 s/tok" in line, line
    assert LONG_PLAN not in line  # the first to go
    if columns == 120:
        assert "Kimi-K3-Instruct" in line and "thinking high" in line, line


def test_fitted_drops_the_plan_first_and_keeps_everything_when_it_fits() -> None:
    fields = [("model", "K3"), ("plan", "a long memory plan"), ("phase", "ready"), ("context", "ctx 10/8K")]
    assert fitted(fields, 200) == ["K3", "a long memory plan", "ready", "ctx 10/8K"]
    assert fitted(fields, 30) == ["K3", "ready", "ctx 10/8K"]
    assert fitted(fields, 0) == ["K3", "a long memory plan", "ready", "ctx 10/8K"]  # not laid out yet


# --------------------------------------------------------------------------- command-line sampler


def stored_session(name: str, settings: dict[str, Any]) -> str:
    """A session with one answered turn and stored sampler settings (as the dialog stores them)."""
    store = HistoryStore()
    info = store.create(name, model="tiny")
    store.append(info.id, {"role": "user", "content": "Hi"})
    store.append(info.id, {"role": "assistant", "content": "Hello.", "thinking": False})
    store.set_settings(info.id, settings)
    return info.id


def launch(model: Any, tok: Tokenizer, tiny_dir: Path, argv: list[str], session: str) -> Any:
    """The app as `k3chat chat ARGV --session SESSION` builds it (options parsed and merged by
    the command line's own code), on the tiny model."""
    from k3chat.app import build_app
    from k3chat.app.engine import Engine
    from k3chat.cli import build_parser, chat_sampler_options, sampler_given
    from k3chat.settings import merge_cli

    args = build_parser().parse_args(["chat", *argv])
    settings = merge_cli(Settings(thinking=False, effort="high"), chat_sampler_options(args))

    def factory(model_dir: Path, s: Settings, progress: Any) -> Engine:
        return Engine(model=model, tokenizer=tok, model_dir=tiny_dir, name="tiny", owns_model=False, context=None,
                      conversation_options={"sampler_factory": Script()})

    return build_app(tiny_dir, settings=settings, engine_factory=factory, session=session,
                     sampler_given=sampler_given(args))


def test_command_line_sampler_options_win_over_the_resumed_session_for_this_run(
        home: Path, model: Any, tok: Tokenizer, tiny_dir: Path) -> None:
    stored = {"sampling": True, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 42, "max_tokens": 50}
    sid = stored_session("tuned", stored)
    app = launch(model, tok, tiny_dir, ["--temperature", "0.3", "--max-tokens", "20"], sid)
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        async with app.run_test(size=(150, 45)) as pilot:
            await started(pilot)
            await until(pilot, lambda: app.conv is not None and not app.loading_session, "the session")
            await pilot.pause(0.05)
            conv = app.conv
            seen["sampler"] = (conv.sampler.greedy, conv.sampler.temperature, conv.sampler.top_k, conv.sampler.seed)
            seen["max_tokens"] = conv.max_tokens
            seen["status"] = app.chat.status.parts()
            seen["screen"] = screen_text(app)

    run(scenario)
    # the options given win; what was not given comes from the session
    assert seen["sampler"] == (False, 0.3, 5, 42) and seen["max_tokens"] == 20
    assert "sampling t 0.3 p 0.9 k 5" in seen["status"]
    assert "From the command line for this run: max-tokens 20 (stored: 50), temperature 0.3 (stored: 0.7)" \
        in " ".join(seen["screen"].split()), seen["screen"]
    assert {k: HistoryStore().load(sid).settings[k] for k in stored} == stored  # not stored over


def test_chat_sampler_options_are_checked_and_named(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from k3chat.cli import build_parser, main, sampler_given

    assert sampler_given(build_parser().parse_args(["chat", "--top-k", "3"])) == {"top_k", "sampling"}
    assert sampler_given(build_parser().parse_args(["chat", "--max-tokens", "3"])) == {"max_tokens"}
    assert sampler_given(build_parser().parse_args(["chat"])) == frozenset()
    assert main(["chat", "--demo", "--temperature", "hot"]) == 2
    assert "--temperature" in capsys.readouterr().err


# --------------------------------------------------------------------------- item 4: times in the footer


def footers(app: Any) -> list[str]:
    from textual.widgets import Static

    from k3chat.app.widgets.transcript import AssistantMessage

    out = []
    for turn in app.chat.transcript.query(AssistantMessage):
        footer = turn.query_one(".turn-footer", Static)
        out.append(str(footer.render()) if footer.display else "")
    return out


def expected_footer(record: dict[str, Any]) -> str:
    """The footer of a turn of the tiny model (under 10 s, over 1 token/s), written out here."""
    speed = record["speed"]
    return (f"first token {speed['first_token_seconds']:.2f} s \u00b7 turn {speed['turn_seconds']:.2f} s \u00b7 "
            f"{speed['decode_tokens_per_second']:.1f} tok/s")


def test_time_to_first_token_and_turn_time_are_stored_and_shown_after_redraw_and_resume(
        home: Path, model: Any, tok: Tokenizer, tiny_dir: Path) -> None:
    app = make_app(model, tok, tiny_dir, Script(answer(tok, " Let me see.", " It is four.")))
    seen: dict[str, Any] = {}

    async def first() -> None:
        async with app.run_test(size=(150, 45)) as pilot:
            await started(pilot)
            await send(pilot, "Two plus two?")
            seen["live"] = footers(app)
            shown = expected_footer(HistoryStore().load(app.conv.session_id).records[-1])
            await until(pilot, lambda: shown in screen_text(app), "the footer drawn")
            await app.toggle_markdown()  # a redraw from the stored records
            await pilot.pause(0.1)
            seen["redrawn"] = footers(app)
            seen["sid"] = app.conv.session_id
            await pilot.press("ctrl+q")

    run(first)
    record = HistoryStore().load(seen["sid"]).records[-1]
    speed = record["speed"]
    assert 0 < speed["first_token_seconds"] <= speed["turn_seconds"] < 10, speed
    assert speed["turn_seconds"] >= speed["reasoning_seconds"]  # the turn holds the reasoning
    expected = expected_footer(record)
    assert seen["live"] == [expected]
    assert seen["redrawn"] == [expected]
    again = make_app(model, tok, tiny_dir, Script(), session=seen["sid"])

    async def resume() -> None:
        async with again.run_test(size=(150, 45)) as pilot:
            await started(pilot)
            await until(pilot, lambda: again.conv is not None and bool(footers(again)), "the session shown")
            seen["resumed"] = footers(again)

    run(resume)
    assert seen["resumed"] == [expected]


def test_a_record_without_times_has_no_footer() -> None:
    from k3chat.app.widgets.transcript import turn_footer

    assert turn_footer({"role": "assistant", "content": "x", "speed": {"decode_tokens_per_second": 3.0}}) == ""
    assert turn_footer({"role": "assistant", "content": "x"}) == ""
    assert turn_footer({"role": "assistant", "content": "x", "speed": {"first_token_seconds": 75.0,
                                                                         "turn_seconds": 130.4}}) == \
        "first token 1 min 15 s \u00b7 turn 2 min 10 s"


# --------------------------------------------------------------------------- item 2: vim-style movement


def test_vim_keys_move_between_blocks_only_when_on_and_never_while_typing(
        home: Path, model: Any, tok: Tokenizer, tiny_dir: Path) -> None:
    app = make_app(model, tok, tiny_dir, Script(answer(tok, " a", " One."), answer(tok, " b", " Two.")))

    async def scenario() -> None:
        async with app.run_test(size=(150, 45)) as pilot:
            await started(pilot)
            await send(pilot, "First")
            await send(pilot, "Second")
            blocks = app.chat.transcript.blocks()
            assert [type(b).__name__ for b in blocks] == ["UserMessage", "ReasoningBlock", "AnswerBlock"] * 2
            await pilot.press("tab")  # the newest reasoning
            assert app.focused is blocks[4]
            await pilot.press("j", "G")
            assert app.focused is blocks[4]  # off by default: nothing moves
            app.toggle_vim_keys()
            await pilot.press("j")
            assert app.focused is blocks[5]
            await pilot.press("j")
            assert app.focused is blocks[5]  # j stops at the last block
            await pilot.press("g")
            assert app.focused is blocks[0]
            await pilot.press("k")
            assert app.focused is blocks[0]  # k stops at the first
            await pilot.press("j", "j")
            assert app.focused is blocks[2]
            await pilot.press("G")
            assert app.focused is blocks[5]
            await pilot.press("k")
            assert app.focused is blocks[4]
            await pilot.press("escape")  # back to the input: the keys are letters again
            assert app.focused is app.chat.prompt
            await pilot.press("j", "k", "g", "G")
            assert app.chat.prompt.text == "jkgG"
            assert app.focused is app.chat.prompt

    run(scenario)


def test_vim_keys_are_a_config_setting(home: Path, tmp_path: Path) -> None:
    from k3chat.settings import SettingsError, load_settings

    config = tmp_path / "config.toml"
    config.write_text("vim_keys = true\n")
    assert load_settings(config).vim_keys is True
    assert load_settings(tmp_path / "none.toml").vim_keys is False  # off by default
    config.write_text('vim_keys = "yes"\n')
    with pytest.raises(SettingsError, match="vim_keys"):
        load_settings(config)


# --------------------------------------------------------------------------- item 3: one code block


CODE_ANSWER = ("Two ways:\n\n```python\nprint('[bold]hi[/bold]')\nx = 1\n```\n\nor, in a shell:\n\n"
               "```sh\necho $HOME\n```\n\nand plainly:\n\n    indented = True\n")


def test_b_copies_the_code_blocks_of_the_focused_answer_one_by_one_and_digits_pick_one(
        home: Path, model: Any, tok: Tokenizer, tiny_dir: Path) -> None:
    from test_app import notices

    from k3chat.app.widgets.transcript import AnswerBlock

    app = make_app(model, tok, tiny_dir, Script(answer(tok, " a", CODE_ANSWER), answer(tok, " b", "No code.")),
                   max_tokens=200)

    async def scenario() -> None:
        async with app.run_test(size=(150, 45)) as pilot:
            await started(pilot)
            await send(pilot, "Show me")
            answer_block = app.chat.query_one(AnswerBlock)
            assert answer_block.text == CODE_ANSWER
            await pilot.press("tab", "alt+down")
            assert app.focused is answer_block
            await pilot.press("b")
            assert app.clipboard == "print('[bold]hi[/bold]')\nx = 1\n"  # the model's text, markup and all
            assert notices(app)[-1] == "Copied code block 1 of 3 (python, 2 lines)"
            await pilot.press("b")
            assert app.clipboard == "echo $HOME\n" and notices(app)[-1] == "Copied code block 2 of 3 (sh, 1 line)"
            await pilot.press("b")
            assert app.clipboard == "indented = True\n"
            assert notices(app)[-1] == "Copied code block 3 of 3 (no language given, 1 line)"
            await pilot.press("b")  # round again
            assert notices(app)[-1] == "Copied code block 1 of 3 (python, 2 lines)"
            await pilot.press("2")
            assert app.clipboard == "echo $HOME\n"
            await pilot.press("7")
            assert notices(app)[-1] == "This answer has 3 code blocks" and app.clipboard == "echo $HOME\n"
            await pilot.press("escape")
            await send(pilot, "And now?")
            await pilot.press("tab", "alt+down")
            assert app.focused is app.chat.query(AnswerBlock).last()
            await pilot.press("b")
            assert notices(app)[-1] == "This answer has no code block" and app.clipboard == "echo $HOME\n"
            await pilot.press("escape", "b", "2")
            assert app.chat.prompt.text == "b2"  # typing: never a copy

    run(scenario)


# --------------------------------------------------------------------------- item 6: help lists every key


HELP_SECTIONS = {"everywhere": "chat", "chat": "chat", "a reasoning block": "chat", "an answer": "chat",
                 "your message": "chat", "an attachment chip": "Attachment chips",
                 "file picker": "File picker (ctrl+l)", "session browser": "Session browser (ctrl+s)",
                 "reasoning viewer": "Reasoning viewer (v)", "settings dialog": "Settings dialog (ctrl+o)",
                 "a question": "Questions and this help", "help": "Questions and this help"}
CHAT_SECTIONS = ("Writing", "While the model answers", "Reading", "Elsewhere")


def help_keys(title: str) -> set[str]:
    """The keys the help screen names in a section ("chat": the chat screen's four)."""
    import re

    from k3chat.app.screens.help import KEYS

    titles = CHAT_SECTIONS if title == "chat" else (title,)
    keys: set[str] = set()
    for section, rows in KEYS:
        if section in titles:
            for cell, _ in rows:
                for key in re.split(r"[,\s]+", cell):
                    keys.update(str(n) for n in range(1, 10)) if key == "1-9" else keys.add(key)
    return keys


def test_the_help_screen_lists_every_key_binding_of_the_app() -> None:
    from k3chat.app.keys import PLACES, binding_rows
    from k3chat.app.screens.help import ABOUT, KEYS

    assert {title for title, _ in KEYS} >= set(CHAT_SECTIONS) | {s for s in HELP_SECTIONS.values() if s != "chat"}
    assert {place for place, _ in PLACES} == set(HELP_SECTIONS)
    missing = [(place, key) for place, keys, _, _ in binding_rows() for key in keys
               if key not in help_keys(HELP_SECTIONS[place])]
    assert missing == [], f"bindings the help screen does not list: {missing}"
    ids = [binding_id for *_, binding_id in binding_rows() if binding_id]
    assert len(ids) >= 15 and [i for i in ids if i not in ABOUT] == []  # every [keys] name is given


def test_the_keys_table_is_generated_from_the_bindings() -> None:
    from k3chat.app.keys import markdown_table

    table = markdown_table()
    assert "| an answer | `b` | Copy code |  |" in table
    assert "| an answer | `1`, `2`, `3`, `4`, `5`, `6`, `7`, `8`, `9` | Copy that code block |  |" in table
    assert "| chat | `G` | Last block | vim_last |" in table
    assert "| help | `escape`, `q`, `f1`, `?` | Close |  |" in table


@pytest.mark.parametrize("quit_key", ["ctrl+q", "ctrl+x"])
def test_quit_stays_in_the_footer_at_80_columns_and_a_keys_remap_moves_it(
        quit_key: str, home: Path, model: Any, tok: Tokenizer, tiny_dir: Path) -> None:
    from dataclasses import replace

    app = make_app(model, tok, tiny_dir, Script())
    if quit_key != "ctrl+q":
        app.settings = replace(app.settings, keys={"quit": quit_key})
    footers: list[str] = []

    async def scenario() -> None:
        async with app.run_test(size=(80, 30)) as pilot:
            await started(pilot)
            # the footer is laid out after the model opens; on a loaded CI machine a fixed
            # 0.2 s pause saw none, so wait for it (up to the usual 30 s)
            await until(pilot, lambda: any("palette" in ln for ln in screen_text(app).splitlines()),
                        "the footer")
            footers.extend(ln for ln in screen_text(app).splitlines() if "palette" in ln)
            await pilot.press(quit_key)
            await until(pilot, lambda: not app.is_running, "the quit")

    run(scenario)
    shown = "^" + quit_key[-1] + " Quit"
    assert len(footers) == 1 and shown in footers[0], footers


def test_the_readme_key_table_is_the_generated_one() -> None:
    """README's key table is `python -m k3chat.app.keys`: a binding added without it fails."""
    from k3chat.app.keys import markdown_table

    readme = Path(__file__).resolve().parents[1] / "README.md"
    if not readme.exists():
        pytest.skip(f"no README.md beside the tests ({readme}): an installed copy of the tests")
    assert markdown_table() in readme.read_text(encoding="utf-8"), \
        "README's key table is stale: paste the output of `python -m k3chat.app.keys`"
