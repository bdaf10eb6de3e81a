"""The k3chat Textual app: it owns the engine, the conversation and the turn worker.

Threads: the model is opened on a daemon thread (nothing to save if the user quits while it
opens), and each turn runs in a Textual thread worker. Both hand their results and the turn's
events to the UI thread the way ``App.call_from_thread`` does (``_ui``); streamed text and
statistics are queued and drawn in batches so the model never waits for the screen. The UI
thread never blocks on a worker (it only ``await``s one). The Conversation is used by one
thread at a time: the worker while a turn runs, the UI thread only between turns.

Quitting (ctrl+q, a second ctrl+c, SIGTERM) saves: it stops the turn, waits for the worker to
store the partial answer, saves the engine state (Conversation.save_state_now: no compute, the
live state or the turn's boundary snapshot; or the reason it could not, printed after the app
has gone), then exits. Asking again while that wait is on also stops the step
in flight (Conversation.abort); a third time quits at once (the message stays in the history,
unanswered, and ctrl+r answers it next time). SIGHUP (the terminal is gone) saves the same
way without drawing anything, and exits 5.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FutureTimeout
from functools import partial
from pathlib import Path
from typing import Any

from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Input, TextArea

from k3chat.attachments import Attachment, AttachmentError, read_attachment, token_count
from k3chat.events import AnswerToken, ReasoningToken, Stats
from k3chat.context_fit import ContextAdvice, advise, memory_text
from k3chat.conversation import ContextOverflow, Conversation, ConversationError, TurnFailed, sampler_settings
from k3chat.history import AmbiguousSession, HistoryError, HistoryStore, SessionInfo, display_name, open_store
from k3chat.demo import DISPLAY_NAME as DEMO_NAME
from k3chat.demo import banner as demo_banner
from k3chat.demo import model_dir as demo_model_dir
from k3chat.restart import Draft, RestartRequest, take_draft
from k3chat.runtime import AFTER_STEP, EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNTIME, Failure, StopPolicy
from k3chat.settings import Settings

from .engine import Engine, EngineFactory, open_engine, plan_summary
from .screens.attach import AttachScreen
from .screens.chat import ChatScreen
from .screens.dialogs import AskScreen, ConfirmScreen
from .screens.help import HelpScreen
from .screens.settings import SettingsScreen, sampler_label, session_values, with_session_values
from .screens.sessions import SessionsChanged, SessionsScreen, export_dialog
from .screens.viewer import ReasoningViewer
from .text import one_line
from .theming import THEMES, remember_theme, remembered_theme, resolve_theme, stylesheet
from .widgets.prompt import teach_alt_enter
from .widgets.reasoning import DISPLAY_MODES, ReasoningBlock
from .widgets.status import thinking_label

log = logging.getLogger(__name__)

QUIT_WINDOW = 5.0  # seconds in which a second ctrl+c quits
STREAM_INTERVAL = 0.03  # seconds: streamed text is drawn at most this often (per batch)
HANGUP_WAIT = 300.0  # after SIGHUP, how long the step in flight may take before we exit anyway
EFFORTS = ("low", "high", "max")


STREAMED = (ReasoningToken, AnswerToken, Stats)


def _merged(events: list[Any]) -> list[tuple[Any, int]]:
    """(event, how many it stands for): consecutive text events of one kind joined, and only
    the last of consecutive Stats kept."""
    out: list[tuple[Any, int]] = []
    for event in events:
        last, n = out[-1] if out else (None, 0)
        if isinstance(event, (ReasoningToken, AnswerToken)) and type(last) is type(event):
            out[-1] = (type(event)(last.text + event.text), n + 1)
        elif isinstance(event, Stats) and isinstance(last, Stats):
            out[-1] = (event, 1)
        else:
            out.append((event, 1))
    return out


def stored_thinking(settings: Mapping[str, Any], records: Sequence[Mapping[str, Any]]) -> tuple[bool, str | None] | None:
    """A session's own thinking setting: its last "settings" line, else what its last answer
    used (each answer records it); None when it has neither. The effort is None when the
    session answers without thinking and never said which effort."""
    on, effort = settings.get("thinking"), settings.get("effort")
    if isinstance(on, bool):
        return on, effort if effort in EFFORTS else None
    for record in reversed(records):
        if record.get("role") == "assistant" and isinstance(record.get("thinking"), bool):
            effort = record.get("effort")
            return record["thinking"], effort if effort in EFFORTS else None
    return None


def history_ids(records: Sequence[Mapping[str, Any]], tokenizer: Any, thinking: bool, effort: str | None) -> list[int]:
    """The ids the model holds for ``records`` under a thinking setting (the effort is part of
    the rendering, at its very start)."""
    from k3chat.template import encode, render

    segments = render(records, thinking=thinking, effort=effort if thinking else None, add_generation_prompt=False)
    return encode(segments, tokenizer)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def last_prefill_speed(records: Sequence[Mapping[str, Any]]) -> float | None:
    for record in reversed(records):
        speed = record.get("speed")
        value = speed.get("prefill_tokens_per_second") if isinstance(speed, dict) else None
        if isinstance(value, (int, float)) and value > 0:
            return float(value)
    return None


class AppUsageError(Exception):
    """build_app was given something it cannot start with (exit 2)."""


def session_name(text: str) -> str:
    """A new session's name: the first message on one line, printable, at most 60 characters."""
    line = " ".join(text.split())
    name = "".join(ch for ch in line if ch.isprintable())[:60].strip()
    return name or "untitled"


def find_session(store: HistoryStore, ref: str) -> SessionInfo | None:
    """A session by id or name (AppUsageError when several share the name)."""
    try:
        return store.find(ref)
    except AmbiguousSession as exc:
        raise AppUsageError(str(exc)) from None


class K3ChatApp(App[int]):
    """Private, local chat with Kimi K3."""

    CSS = stylesheet()
    TITLE = "k3chat"
    BINDINGS = [
        Binding("ctrl+c", "interrupt", "Stop / copy", show=False, priority=True, id="interrupt"),
        Binding("ctrl+q", "quit", "Quit", priority=True, id="quit"),
        Binding("f1", "help", "Help", priority=True, id="help"),
    ]

    def __init__(self, model_dir: Path | None, *, settings: Settings, demo: bool,
                 engine_factory: EngineFactory, session: SessionInfo | None = None,
                 new_session_name: str | None = None, store: HistoryStore | None = None,
                 thinking_given: bool = False, sampler_given: frozenset[str] = frozenset()) -> None:
        teach_alt_enter()
        super().__init__()
        self.settings = settings
        self.model_dir = model_dir
        self.demo = demo
        self.engine_factory = engine_factory
        self.store = store or open_store()
        self.session: SessionInfo | None = session
        self.pending_name = new_session_name
        self.reasoning_display = settings.reasoning_display if settings.reasoning_display in DISPLAY_MODES else "auto"
        self.markdown = True
        self.vim_keys = settings.vim_keys  # j/k, g/G in the transcript (config.toml; the palette for this run)
        self.thinking = settings.thinking  # this session's (status bar, palette); kept in its history
        self.effort = settings.effort
        # A session starts with the launch settings; one given on the command line also
        # overrides what the session resumed at launch had stored.
        self._thinking_given = thinking_given
        # Sampler fields given on the command line: they win over every resumed session's
        # stored ones for this run, and are not stored (the settings dialog stores).
        self._sampler_given = sampler_given
        self.chat_settings = settings  # this session's sampler and max tokens (settings dialog, ctrl+o)
        self.system_prompt = ""  # this session's (sent with its first message)
        self._next_system: str | None = None  # chosen in a started session: for the next new one
        self.engine: Engine | None = None
        self.conv: Conversation | None = None
        self.ready = False
        self.loading_session = False
        self.busy = False
        self.turns_over = 0  # turns that ended, whatever the outcome (tests wait on it)
        self.load_error: str | None = None
        self.ui_errors: list[str] = []  # exceptions raised by UI callbacks of a worker (tests check it)
        self._turn_worker: Any = None
        self._quitting = False
        self._saving_state = False
        self._closed = False
        self.exit_notes: list[str] = []  # printed by the command line once the screen is gone
        self.resume_command = "k3chat chat"  # how this app was started, less --session (cli sets it)
        self._stop = StopPolicy(exit_now=self._force_exit)  # the running turn's (runtime's policy)
        self._armed_at: float | None = None
        self._return_code = EXIT_OK
        self._signals: list[int] = []
        self._old_hup: Any = None
        self._stream_lock = threading.Lock()
        self._streamed: list[Any] = []  # text and statistics waiting to be drawn
        self._stream_scheduled = False
        self._flush_lock = asyncio.Lock()
        self._job_done = threading.Event()  # no turn job runs (set), one runs (clear)
        self._job_done.set()
        self._chat: ChatScreen
        self._theme_kept = ""  # the theme in use that needs no saving
        self._sent_chips: list[tuple[Attachment, int | None]] = []  # the last message's files, until it is taken
        self.attach_events: list[str] = []  # each file attached or refused (tests wait on it)
        self.restart: RestartRequest | None = None  # set when the user chose to start again with a larger context

    # ------------------------------------------------------------------ setup

    def get_default_screen(self) -> Screen:
        self._chat = ChatScreen()
        return self._chat

    @property
    def chat(self) -> ChatScreen:
        return self._chat

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer if self.engine is not None else None

    @property
    def grammar(self) -> Any:
        return self.conv.grammar if self.conv is not None else None

    def on_mount(self) -> None:
        for theme in THEMES:
            self.register_theme(theme)
        name, warning = resolve_theme(self.settings.theme, self.available_themes)
        remembered = remembered_theme(self.settings.theme)
        if remembered in self.available_themes:
            name, warning = remembered, None
        self.theme = self._theme_kept = name
        self.theme_changed_signal.subscribe(self, self._remember_theme)
        if warning:
            self.say(warning, warning=True)
        self._install_signals()
        if self.settings.keys:  # [keys] in config.toml: binding id = key(s), e.g. quit = "ctrl+x"
            self.set_keymap(dict(self.settings.keys))

    def _remember_theme(self, theme: Any) -> None:
        """A theme chosen in the palette (Textual's "Change theme") is kept for the next start."""
        if theme.name == self._theme_kept:
            return
        try:
            remember_theme(theme.name, self.settings.theme)
        except OSError as exc:
            self.say(f"theme {theme.name} not remembered for the next start: {exc}", warning=True)
            return
        self._theme_kept = theme.name

    def chat_ready(self) -> None:
        """The chat screen is composed: show what happens and start opening the model."""
        chat = self.chat
        chat.set_title(self.session.name if self.session else self.pending_name, None)
        chat.status.set_model("opening the model", "")
        chat.show_progress("Opening the demo model" if self.demo else f"Opening {self.model_dir}")
        threading.Thread(target=self._load, name="k3chat-open", daemon=True).start()
        self.run_worker(self._restore_draft(), exit_on_error=False, name="restore-draft")

    async def _restore_draft(self) -> None:
        """The message a restart for a larger context carried over (k3chat.restart): back in
        the input with its files, and the draft file deleted."""
        try:
            draft = take_draft(self.store.vault)
        except ValueError as exc:
            self.say(str(exc), error=True)
            return
        if draft is None:
            return
        self.chat.prompt.restore(draft.text)
        tokens = list(draft.tokens) + [None] * (len(draft.attachments) - len(draft.tokens))
        chips = [(Attachment.from_record(entry), count) for entry, count in zip(draft.attachments, tokens)]
        if chips:
            await self.chat.attachment_bar.set_attachments(chips)
        self.say("Your message is back in the input: enter sends it")

    # ------------------------------------------------------------------ thread plumbing

    def _ui(self, fn: Callable[..., Any], *args: Any, wait: bool = True) -> Any:
        """Run ``fn(*args)`` on the UI thread and wait for it (from a worker thread).

        This is ``App.call_from_thread`` (the same coroutine, in the app's context, on the app's
        loop) with two differences: the wait gives up once the app is closed (after a terminal
        hangup the UI may never run again, and a turn must still be able to store its answer),
        and ``wait=False`` only schedules the call (for streamed text: the model must not run
        at the speed at which the UI can draw).
        """
        if self._closed:
            return None
        loop, context = getattr(self, "_loop", None), getattr(self, "_context", None)
        if loop is None or context is None:  # not the Textual this was written for: the plain call
            try:
                return self.call_from_thread(fn, *args)
            except Exception as exc:
                self._ui_failed(exc)
                return None

        async def run() -> Any:
            with context():
                result = fn(*args)
                if inspect.isawaitable(result):
                    result = await result
                return result

        try:
            future = asyncio.run_coroutine_threadsafe(run(), loop)
        except RuntimeError:  # the loop is closed: the app has gone
            return None
        if not wait:
            future.add_done_callback(self._scheduled_done)
            return None
        while True:
            try:
                return future.result(timeout=0.25)
            except FutureTimeout:
                if self._closed:
                    future.cancel()
                    return None
            except CancelledError:
                return None
            except Exception as exc:  # a UI bug must not stop the turn (its answer is saved regardless)
                self._ui_failed(exc)
                return None

    def _scheduled_done(self, future: Any) -> None:
        if not future.cancelled() and future.exception() is not None:
            self._ui_failed(future.exception())

    def _ui_failed(self, exc: BaseException) -> None:
        if isinstance(exc, RuntimeError) and "not running" in str(exc):
            return
        log.error("UI callback failed: %s", exc, exc_info=exc)
        self.ui_errors.append(f"{type(exc).__name__}: {exc}")

    def _progress(self, text: str) -> None:
        self._ui(self._show_progress, text)

    def _show_progress(self, text: str) -> None:
        self.chat.show_progress(text)

    def say(self, text: str, *, warning: bool = False, error: bool = False) -> None:
        """A toast with plain text (never markup)."""
        severity = "error" if error else ("warning" if warning else "information")
        self.notify(one_line(text, 400), severity=severity, markup=False, timeout=6 if error else 4)

    # ------------------------------------------------------------------ opening

    def _load(self) -> None:
        try:
            assert self.model_dir is not None
            engine = self.engine_factory(Path(self.model_dir), self.settings, self._progress)
            if self.demo:
                engine.name = DEMO_NAME
        except Failure as exc:
            self._ui(self._load_failed, exc.message, exc.code)
            return
        except Exception as exc:
            self._ui(self._load_failed, f"{type(exc).__name__}: {exc}", EXIT_RUNTIME)
            return
        if not self._ui(self._engine_ready, engine):
            engine.close()  # the app went away (or is quitting) while the model opened
            return
        if self.session is not None:
            self._open_session_job(self.session.id)

    def _engine_ready(self, engine: Engine) -> bool:
        if self._quitting:
            return False
        self.engine = engine
        self.loading_session = self.session is not None  # no turn until it is shown
        self.ready = True
        chat = self.chat
        chat.hide_progress()
        chat.status.set_model(engine.name, plan_summary(engine))
        chat.status.set_thinking(self.thinking, self.effort)
        chat.status.set_sampler(sampler_label(self.chat_settings))
        chat.status.set_phase("ready")
        chat.set_title(self.session.name if self.session else self.pending_name, engine.name)
        if self.demo:
            chat.show_notice(demo_banner(engine.model_dir))
        return True

    async def _load_failed(self, message: str, code: int) -> None:
        self.load_error = message
        self._return_code = code
        chat = self.chat
        chat.hide_progress()
        chat.status.set_model("no model", "")
        chat.status.set_phase("failed")
        chat.show_notice(f"Cannot open the model: {message}  (ctrl+q quits)", error=True)

    # ------------------------------------------------------------------ sessions

    def _new_conversation(self, session_id: str) -> Conversation:
        engine = self.engine
        assert engine is not None
        s = self.chat_settings
        store = HistoryStore(self.store.root, vault=self.store.vault)
        make = engine.conversation_factory or Conversation  # the remote backend has its own
        conv = make(engine.model, engine.tokenizer, store, session_id,
                            thinking=self.thinking, effort=self.effort, max_tokens=s.max_tokens,
                            context=engine.context, model_name=engine.model_dir.name,
                            speculative=s.speculative,  # the remote factory leaves it to its server
                            **engine.conversation_options)
        conv.sampler = sampler_settings(sampling=s.sampling, temperature=s.temperature, top_p=s.top_p,
                                        top_k=s.top_k, seed=s.seed, records=conv.records)
        return conv

    @staticmethod
    def _held(conv: Conversation | None) -> int | None:
        """The context figure between turns (Conversation.history_tokens), None if unknown."""
        if conv is None:
            return None
        try:
            return conv.history_tokens()
        except Exception:
            return None

    def _open_session_job(self, session_id: str) -> None:
        """Thread: load a session's conversation (history, its thinking setting, prompt size),
        then show it."""
        try:
            conv = self._new_conversation(session_id)
            note = self._adopt_session_thinking(conv)
            own, refused = self._adopt_session_sampler(conv)
            held = self._held(conv)
            stopped = self._held_prompt(conv)
        except Exception as exc:  # HistoryError, OSError, a refused context...: said, never fatal
            self._ui(self._session_failed, f"cannot open the session: {exc}")
            return
        self._ui(self._session_loaded, conv, held, "\n".join(n for n in (note, refused) if n) or None, own, stopped)

    @staticmethod
    def _held_prompt(conv: Conversation) -> tuple[int, int, str | None] | None:
        """Thread: what a stopped prefill of the unanswered last message left in the saved
        state (Conversation.held_prompt; the remote backend has none), never raising."""
        find = getattr(conv, "held_prompt", None)
        if find is None:
            return None
        try:
            return find()
        except Exception as exc:  # the next turn reads the prompt from the start, and says why
            log.warning("the saved state of the unanswered message was not read: %s", exc)
            return None

    def _adopt_session_thinking(self, conv: Conversation) -> str | None:
        """Thread: give ``conv`` its session's thinking setting (so the prompt, and the saved
        engine state, match what the history was read with). Returns a note for the user when
        the command line overrides it."""
        launch = (self.settings.thinking, self.settings.effort)
        stored = stored_thinking(conv.session_settings, conv.records)
        given, self._thinking_given = self._thinking_given, False  # only for the session resumed at launch
        if stored is None:
            conv.thinking, conv.effort = launch
            return None
        own = (stored[0], stored[1] or launch[1])
        if not given or own == launch:
            conv.thinking, conv.effort = own
            return None
        conv.thinking, conv.effort = launch
        HistoryStore(self.store.root).set_settings(conv.session_id, {"thinking": launch[0], "effort": launch[1]})
        return (f"{thinking_label(*launch).capitalize()} from the command line (this session had "
                f"{thinking_label(*own)}); the conversation is re-read with it at the next message.")

    def _adopt_session_sampler(self, conv: Conversation) -> tuple[Settings, str | None]:
        """Thread: give ``conv`` its session's sampler and max tokens (stored by the settings
        dialog), checked as the command line checks them; the launch values and a note when a
        stored value is refused."""
        stored = {k: v for k, v in conv.session_settings.items() if k not in self._sampler_given}
        try:
            own = with_session_values(self.settings, stored)
        except Exception as exc:
            own, note = self.settings, f"this session's stored settings were refused ({exc}); the launch settings are used"
        else:
            note = self._command_line_note(conv.session_settings, own)
        self._give_sampler(conv, own)
        return own, note

    def _command_line_note(self, stored: Mapping[str, Any], own: Settings) -> str | None:
        """What the command line changed of a session's stored sampler, said once it is open."""
        mine = session_values(own)
        changed = [name for name in sorted(self._sampler_given) if name in stored and stored[name] != mine[name]]
        if not changed:
            return None
        what = ", ".join(f"{name.replace('_', '-')} {mine[name]} (stored: {stored[name]})" for name in changed)
        return (f"From the command line for this run: {what}. The session keeps its stored settings; "
                "ctrl+o stores new ones.")

    @staticmethod
    def _give_sampler(conv: Conversation, own: Settings) -> None:
        conv.sampler = sampler_settings(sampling=own.sampling, temperature=own.temperature, top_p=own.top_p,
                                        top_k=own.top_k, seed=own.seed, records=conv.records)
        conv.max_tokens = own.max_tokens

    async def _session_failed(self, message: str) -> None:
        self.loading_session = False
        await self.start_new_session()
        self.chat.hide_progress()
        self.chat.show_notice(message, error=True)

    async def _session_loaded(self, conv: Conversation, held: int | None, note: str | None = None,
                              own: Settings | None = None,
                              stopped: tuple[int, int, str | None] | None = None) -> None:
        self.loading_session = False
        if self._quitting:
            conv.close()
            return
        if self.conv is not None and self.conv is not conv:
            self.conv.close()
        self.conv = conv
        self.thinking, self.effort = conv.thinking, conv.effort or self.effort
        self.chat_settings = own or self.settings
        self.system_prompt = next((str(r.get("content", "")) for r in conv.records[:1] if r.get("role") == "system"), "")
        try:
            self.session = self.store.info(conv.session_id)
        except HistoryError:
            pass
        chat = self.chat
        chat.hide_progress()
        chat.status.set_thinking(self.thinking, self.effort)
        chat.status.set_sampler(sampler_label(self.chat_settings))
        await chat.show_history(conv.records)
        chat.set_title(self.session.name if self.session else None, self.engine.name if self.engine else None)
        chat.status.clear_speed()  # the figures of another session's last turn
        chat.status.set_context(held, conv.context)
        notes = [f"damaged history line skipped: {p}" for p in conv.load_problems]
        if note:
            notes.append(note)
        if stopped is not None and stopped[2]:
            notes.append(stopped[2])  # why the saved state was refused
        ask = conv.pending_user and stopped is not None and stopped[0] > 0
        if ask:
            assert stopped is not None
            read, total, _ = stopped
            notes.append(f"The last message has no answer (k3chat was stopped while it read the prompt): ctrl+r "
                         f"continues reading it ({total - read:,} of {total:,} tokens left), ctrl+e edits it.")
        elif conv.pending_user:
            notes.append("The last message has no answer (k3chat was stopped): ctrl+r answers it (a prompt stopped "
                         "while it was read continues from where it stopped), ctrl+e edits it.")
        chat.show_notice("\n".join(notes), error=bool(conv.load_problems))
        if ask:
            assert stopped is not None
            self._ask_to_continue(*stopped[:2])

    def _ask_to_continue(self, read: int, total: int) -> None:
        """A session whose prefill was stopped: continue it now (as ctrl+r), or leave it."""
        question = f"Continue reading the prompt? {total - read:,} of {total:,} tokens left (held: {read:,})"

        async def chosen(yes: bool | None) -> None:
            if yes and self.conv is not None and self.conv.pending_user:
                self.chat.clear_notice()
                await self.action_regenerate()

        self.push_screen(ConfirmScreen(question, yes="Continue", no="Later"), chosen)

    def _close_conversation(self) -> None:
        """Leave the session (a switch, a new session, the end): its engine state is saved
        first, unless quitting already did that (off the UI thread)."""
        if self.conv is not None:
            if not self._quitting and not self.busy:
                note = self._save_state_quietly(self.conv)
                if note:
                    self.say(note, warning=True)
            try:
                self.conv.close()
            except Exception:
                pass
            self.conv = None

    @staticmethod
    def _save_state_quietly(conv: Conversation) -> str | None:
        """conv.save_state_now, never raising: None, or what to tell the user."""
        try:
            return conv.save_state_now()
        except Exception as exc:
            log.exception("engine state not saved")
            return f"engine state not saved ({type(exc).__name__}: {exc}); the next start re-reads the conversation"

    async def start_new_session(self) -> None:
        self._close_conversation()
        self.session = None
        self.pending_name = None
        self.thinking, self.effort = self.settings.thinking, self.settings.effort  # a session's own start
        self.chat_settings = self.settings
        self.system_prompt, self._next_system = self._next_system or "", None
        chat = self.chat
        chat.status.set_thinking(self.thinking, self.effort)
        chat.status.set_sampler(sampler_label(self.chat_settings))
        await chat.show_history([])
        chat.clear_notice()
        chat.set_title(None, self.engine.name if self.engine else None)
        chat.status.set_context(None, None)
        chat.status.clear_speed()
        chat.prompt.focus()

    def switch_session(self, session_id: str | None) -> None:
        if session_id is None or (self.conv is not None and self.conv.session_id == session_id):
            return
        if self.busy:
            self.say("K3 is answering: stop it (ctrl+c) or wait before switching sessions", warning=True)
            return
        if not self.ready or self._quitting:
            self.say("the model is still opening" if not self.ready else "k3chat is quitting", warning=True)
            return
        self._close_conversation()
        self.pending_name = None
        self.loading_session = True
        self.chat.show_progress("Opening the session")
        self.run_worker(partial(self._open_session_job, session_id), thread=True, group="session",
                        exit_on_error=False, name="open-session")

    # ------------------------------------------------------------------ turns

    def _can_start(self) -> bool:
        if self._quitting:
            return False
        if not self.ready:
            self.say(self.load_error or "the model is still opening", warning=True)
            return False
        if self.busy:
            self.say("K3 is still answering: wait, or stop it with ctrl+c", warning=True)
            return False
        if self.loading_session:
            self.say("the session is still opening", warning=True)
            return False
        return True

    async def submit(self, text: str) -> None:
        """A message from the box (already emptied by it: keys typed since stay there), with
        the files attached to it (their chips are cleared, and put back if it is refused)."""
        if not self._can_start():
            self.chat.prompt.restore(text)
            return
        if self.conv is not None and self.conv.pending_user:
            self.chat.prompt.restore(text)
            self.say("The last message has no answer yet: ctrl+r answers it, ctrl+e edits it", warning=True)
            return
        chat = self.chat
        chat.clear_notice()
        bar = chat.attachment_bar
        self._sent_chips = [(chip.attachment, chip.tokens) for chip in bar.chips]
        await bar.clear()
        await self._start_turn("send", text, attachments=[a for a, _ in self._sent_chips])

    # ------------------------------------------------------------------ attachments

    def action_attach(self) -> None:
        if isinstance(self.screen, AttachScreen):
            return
        self.push_screen(AttachScreen(Path.cwd()))

    def on_attach_screen_chosen(self, message: AttachScreen.Chosen) -> None:
        self.run_worker(partial(self._read_attachment, message.path), thread=True, group="attach",
                        exit_on_error=False, name="attach")

    def _read_attachment(self, path: Path) -> None:
        """Thread: read and count a chosen file (a PDF or a long file takes a while)."""
        try:
            attachment = read_attachment(path)
        except AttachmentError as exc:
            self._ui(self._attach_failed, exc.message)
            return
        except Exception as exc:  # never a crash: say it
            log.exception("attachment failed")
            self._ui(self._attach_failed, f"cannot attach {path}: {type(exc).__name__}: {exc}")
            return
        tokenizer = self.tokenizer
        tokens = token_count(attachment, tokenizer) if tokenizer is not None else None
        self._ui(self._attached, attachment, tokens)

    async def _attached(self, attachment: Attachment, tokens: int | None) -> None:
        await self.chat.attachment_bar.add(attachment, tokens)
        self.chat.clear_notice()
        note = f" ({'; '.join(attachment.notes)})" if attachment.notes else ""
        self.say(f"Attached {attachment.name}{note}: it goes with your next message")
        self.attach_events.append(attachment.name)

    def _attach_failed(self, message: str) -> None:
        self.chat.show_notice(message, error=True)
        self.say(message, error=True)
        self.attach_events.append(message)

    async def submit_edit(self, text: str) -> None:
        chat = self.chat
        if not self._can_start():
            chat.prompt.restore(text)
            return
        draft = chat.stop_edit(restore=False)
        if draft:
            chat.prompt.restore(draft)  # what was in the box before ctrl+e comes back
        await self._start_turn("edit", text, shown=self._last_user_attachments())

    async def action_regenerate(self) -> None:
        if not self._can_start():
            return
        conv = self.conv
        if conv is None or not conv.records:
            self.say("nothing to regenerate yet")
            return
        if conv.pending_user:
            await self._start_turn("respond", None)
        elif conv.records[-1].get("role") == "assistant":
            await self._start_turn("regenerate", None, sampler=self._fresh_sampler(conv))
        else:
            self.say("nothing to regenerate")

    def _fresh_sampler(self, conv: Conversation) -> Any:
        """A regenerated answer can differ: the same (seed, turn) gives the same answer, and so
        does greedy decoding, so this one answer samples with a new seed (the session keeps
        its own settings). Says so."""
        own = conv.sampler
        fresh = dataclasses.replace(own, greedy=False, seed=secrets.randbits(64))
        how = (f"temperature {fresh.temperature:g}, top-p {fresh.top_p:g}"
               + (f", top-k {fresh.top_k}" if fresh.top_k else "") + f", seed {fresh.seed}")
        if own.greedy:
            self.say(f"Regenerating with sampling ({how}): greedy decoding would give the same answer again. "
                     "Settings (ctrl+o) turn sampling on for every answer.")
        else:
            self.say(f"Regenerating with a new seed ({how})")
        return fresh

    def action_edit_last(self) -> None:
        if not self._can_start():
            return
        conv = self.conv
        users = [r for r in (conv.records if conv is not None else []) if r.get("role") == "user"]
        if not users:
            self.say("no message to edit yet")
            return
        self.chat.start_edit(str(users[-1].get("content", "")))

    def _last_user_attachments(self) -> list[dict[str, Any]]:
        """The history entries of the last message's files (an edited message keeps them)."""
        users = [r for r in (self.conv.records if self.conv is not None else []) if r.get("role") == "user"]
        return list(users[-1].get("attachments") or []) if users else []

    async def _start_turn(self, kind: str, text: str | None, *, sampler: Any = None,
                          attachments: Sequence[Attachment] = (),
                          shown: Sequence[Mapping[str, Any]] | None = None) -> None:
        """``shown``: the files to draw with the message when they are not sent anew (an edit)."""
        self.busy = True
        self._stop = StopPolicy(exit_now=self._force_exit)
        self._armed_at = None
        self._job_done.clear()
        drawn = [a.to_record() for a in attachments] if shown is None else list(shown)
        await self.chat.begin_turn(kind, text, thinking=self.thinking, attachments=drawn)
        self._turn_worker = self.run_worker(partial(self._turn_job, kind, text, sampler, attachments), thread=True,
                                            group="turn", exit_on_error=False, name=f"turn:{kind}")

    def _turn_job(self, kind: str, text: str | None, sampler: Any = None,
                  attachments: Sequence[Attachment] = ()) -> None:
        """Thread: one turn (``sampler``: for this turn only, else the session's). Every outcome
        reaches the UI; nothing is raised from here."""
        created: SessionInfo | None = None
        conv = self.conv
        own_sampler = conv.sampler if conv is not None else None
        try:
            if conv is None:
                engine = self.engine
                assert engine is not None and text is not None
                store = HistoryStore(self.store.root, vault=self.store.vault)
                # a name made from the message is numbered when taken ("hello (2)"): names stay unique
                named = text or (attachments[0].name if attachments else "")
                created = store.create(self.pending_name or session_name(named), model=engine.model_dir.name,
                                       numbered=self.pending_name is None)
                if (self.thinking, self.effort) != (self.settings.thinking, self.settings.effort):
                    store.set_settings(created.id, {"thinking": self.thinking, "effort": self.effort})
                if session_values(self.chat_settings) != session_values(self.settings):
                    store.set_settings(created.id, session_values(self.chat_settings))
                conv = self._new_conversation(created.id)
                self._ui(self._adopt, conv, created)
            emit = self._emit
            if sampler is not None:
                conv.sampler = sampler
            if kind == "send":
                assert text is not None
                system = self.system_prompt if self.system_prompt.strip() and not conv.records else None
                conv.send(text, system=system, attachments=attachments, on_event=emit)
            elif kind == "edit":
                assert text is not None
                conv.edit_last(text, on_event=emit)
            elif kind == "regenerate":
                conv.regenerate(on_event=emit)
            else:
                conv.respond(on_event=emit)
        except (ContextOverflow, ConversationError) as exc:
            if created is not None:
                self._drop_created(conv, created)
            advice = self._fit_advice(exc)
            self._ui(self._turn_refused, kind, text, self._refusal_text(exc, advice), advice)
        except TurnFailed as exc:
            self._ui(self._turn_error, str(exc))
        except HistoryError as exc:
            self._ui(self._turn_error, f"the history could not be written: {exc}")
        except Exception as exc:
            log.exception("turn failed")
            self._ui(self._turn_error, f"the turn failed: {type(exc).__name__}: {exc}")
        finally:
            if sampler is not None and conv is not None and own_sampler is not None:
                conv.sampler = own_sampler  # the one-off sampler was for this answer only
            held = self._held(self.conv) if self.conv is conv else None  # tokenized here, off the UI thread
            self._job_done.set()
            self._ui(self._turn_over, held)

    def _drop_created(self, conv: Conversation | None, info: SessionInfo) -> None:
        """A session made for a first message that was refused: leave no trace."""
        try:
            if conv is not None:
                conv.close()
            HistoryStore(self.store.root, vault=self.store.vault).delete(info.id)
        except (HistoryError, OSError):
            pass
        self._ui(self._forget, info.id)

    def _adopt(self, conv: Conversation, info: SessionInfo) -> None:
        self.conv = conv
        self.session = info
        self.chat.set_title(info.name, self.engine.name if self.engine else None)

    def _forget(self, session_id: str) -> None:
        if self.conv is not None and self.conv.session_id == session_id:
            self.conv = None
        if self.session is not None and self.session.id == session_id:
            self.session = None
        self.chat.set_title(None, self.engine.name if self.engine else None)

    def _emit(self, event: Any) -> None:
        """Thread: a turn event. Text and statistics are queued and drawn in batches without
        making the turn wait; everything else is delivered in order, after the queue."""
        if isinstance(event, STREAMED):
            with self._stream_lock:
                self._streamed.append(event)
                if self._stream_scheduled:
                    return
                self._stream_scheduled = True
            self._ui(self._flush_streamed_soon, wait=False)
            return
        self._ui(self._deliver, event)

    async def _flush_streamed_soon(self) -> None:
        await asyncio.sleep(STREAM_INTERVAL)  # gather what arrives meanwhile: fewer, larger redraws
        await self._flush_streamed()

    async def _flush_streamed(self) -> None:
        async with self._flush_lock:  # batches are drawn whole and in order
            with self._stream_lock:
                batch, self._streamed = self._streamed, []
                self._stream_scheduled = False
            for event, pieces in _merged(batch):
                await self.chat.turn_event(event, pieces=pieces)

    async def _deliver(self, event: Any) -> None:
        await self._flush_streamed()
        await self.chat.turn_event(event)

    def _fit_advice(self, exc: Exception) -> ContextAdvice | None:
        """Thread: for a message that does not fit, the context and the memory that would hold
        it (k3chat.context_fit, as `k3chat run` says it); None for any other refusal."""
        engine = self.engine
        if not isinstance(exc, ContextOverflow) or engine is None or engine.memory == "remote":
            return None
        plan = engine.plan
        return advise(exc, engine.model_dir, lookahead=plan.lookahead if plan is not None else 0,
                      process_bytes=plan.process_bytes if plan is not None else 0)

    def _refusal_text(self, exc: Exception, advice: ContextAdvice | None) -> str:
        """Why a turn was refused, with the advice's numbers when there are some."""
        engine = self.engine
        if advice is None or engine is None:
            return str(exc)
        return advice.message(engine.model_dir).replace("run again with --context",
                                                        "start k3chat again with --context")

    async def _turn_refused(self, kind: str, text: str | None, message: str,
                            advice: ContextAdvice | None = None) -> None:
        chat = self.chat
        await chat.show_history(self.conv.records if self.conv is not None else [])
        if text is not None and kind in ("send", "edit"):
            if kind == "edit":
                chat.start_edit(text)
            else:
                chat.prompt.restore(text)
                if self._sent_chips:  # the files go back with the text
                    await chat.attachment_bar.set_attachments(self._sent_chips)
        chat.show_notice(message, error=True)
        if self.conv is not None:
            chat.status.set_context(self._held(self.conv), self.conv.context)
        if kind == "send" and advice is not None and advice.suggested is not None:
            self._offer_restart(advice)

    def _offer_restart(self, advice: ContextAdvice) -> None:
        """Ask to start this session again with the context (and memory) that holds the message;
        yes saves and exits with a restart request (k3chat.restart), the message kept."""
        assert advice.suggested is not None
        memory = memory_text(advice.memory) if advice.memory is not None else None
        plan = getattr(self.engine, "plan", None) if self.engine is not None else None
        if memory is not None and plan is not None and plan.budget >= (advice.memory or 0):
            memory = None  # the budget in use already holds it: keep the user's --memory
        question = (f"Restart this session with context {advice.suggested:,}"
                    + (f" (memory {memory})" if memory is not None else "") + "?")

        async def chosen(yes: bool | None) -> None:
            if not yes or self.busy or self._quitting:
                return
            chips = self.chat.attachment_bar.chips
            draft = Draft(self.chat.prompt.text, tuple(chip.attachment.to_record() for chip in chips),
                          tuple(chip.tokens for chip in chips))
            session = self.session.id if self.session is not None else self.pending_name
            self.restart = RestartRequest(session, advice.suggested or 0, memory, draft)
            await self._save_and_quit(None)

        self.push_screen(ConfirmScreen(question, yes="Restart", no="No"), chosen)

    def _turn_error(self, message: str) -> None:
        self.chat.show_notice(message, error=True)
        if self.chat.turn is not None:
            self.chat.turn.set_status(message)

    async def _turn_over(self, held: int | None = None) -> None:
        await self.chat.turn_over()
        if held is not None and self.conv is not None:
            self.chat.status.set_context(held, self.conv.context)  # the same figure as after a restart
        self.busy = False
        self.turns_over += 1
        if self._stop.requested.is_set():
            self._armed_at = time.monotonic()  # a second ctrl+c from now on quits
        if self.session is not None:
            self.pending_name = None
            try:
                self.session = self.store.info(self.session.id)
            except HistoryError:
                pass

    # ------------------------------------------------------------------ ctrl+c, quitting, signals

    def _selected_text(self) -> str | None:
        focused = self.focused
        if isinstance(focused, (TextArea, Input)) and focused.selected_text:
            return focused.selected_text
        try:
            text = self.screen.get_selected_text()
        except Exception:
            text = None
        return text or None

    async def action_interrupt(self) -> None:
        selected = self._selected_text()
        if selected:
            self.copy_to_clipboard(selected)
            self.screen.clear_selection()
            self.say(f"Copied {len(selected):,} characters")
            return
        if self._quitting:
            await self._save_and_quit(None)
            return
        now = time.monotonic()
        if self.busy:
            if self._stop_turn() == AFTER_STEP:
                self._armed_at = now
                if self.chat.prefilling:
                    self.chat.status.set_phase("stopping at the next chunk of the prompt")
                    self.say("Stopping at the next chunk of the prompt; the message and what was read are kept. "
                             "ctrl+c again saves and quits.")
                else:
                    self.chat.status.set_phase("stopping after the step in flight")
                    self.say("Stopping after the step in flight; the partial answer is kept. "
                             "ctrl+c again saves and quits.")
            else:  # the second ctrl+c stopped the step in flight as well: save, quit
                await self._save_and_quit(None)
            return
        if self._armed_at is not None and now - self._armed_at <= QUIT_WINDOW:
            await self._save_and_quit(None)
            return
        self._armed_at = now
        self.say("Nothing to stop. Press ctrl+c again (or ctrl+q) to quit.")

    async def action_quit(self) -> None:
        await self._save_and_quit(None)

    def _stop_turn(self) -> int:
        """One more stop request for the running turn (runtime.StopPolicy): 1 stops it after
        the step in flight, 2 aborts the step in flight too (Conversation.abort: the partial
        answer is still saved, the engine state is not), 3 quits at once. Returns the level."""
        conv = self.conv
        if conv is not None and not self._stop.requested.is_set():
            self._stop.bind(after_step=conv.cancel, abort_step=getattr(conv, "abort", conv.cancel))
        return self._stop.request()

    async def _save_and_quit(self, code: int | None) -> None:
        if self._quitting:
            # Asked again while the turn finishes: stop the step in flight, then quit at once;
            # while the engine state is written: quit now (the write is atomic, nothing breaks).
            if self.busy:
                self._stop_turn()
            elif self._saving_state:
                self.exit_notes.append("engine state not saved (you quit while it was written); "
                                       "the next start re-reads the conversation")
                self._force_exit()
            return
        self._quitting = True
        if self.busy and self._turn_worker is not None:
            if not self._stop.requested.is_set():
                self._stop_turn()
            self.chat.show_progress("Saving: the step in flight finishes, then the partial answer is stored "
                                    "(press again to stop the step now)")
            try:
                await self._turn_worker.wait()
            except Exception:
                pass
        await self._save_engine_state()
        self._shutdown_engine()
        final = self._return_code if code is None else code
        self.exit(final, return_code=final)

    async def _save_engine_state(self) -> None:
        """Save the engine state before quitting, on a thread (it can be large); what could not
        be saved is said after the app has gone."""
        conv = self.conv
        if conv is None or self.busy:
            return
        self._saving_state = True
        self.chat.show_progress("Saving the engine state, so the next start need not re-read the conversation "
                                "(press again to quit without it)")
        try:
            note = await asyncio.to_thread(self._save_state_quietly, conv)
        finally:
            self._saving_state = False
        if note:
            self.exit_notes.append(note)

    def _force_exit(self) -> None:
        """Quit now, without waiting for the step in flight (its partial answer is lost; the
        message stays in the history, unanswered)."""
        try:
            driver = self._driver
            if driver is not None and not self.is_headless:
                driver.stop_application_mode()
            for line in self.goodbye():
                sys.stderr.write(line + "\n")
            sys.stderr.flush()
        except Exception:
            pass
        finally:
            os._exit(EXIT_INTERRUPTED)

    def goodbye(self) -> list[str]:
        """What to print once the screen is gone: notes (engine state), and how to resume."""
        lines = [f"k3chat: {note}" for note in self.exit_notes]
        session = self.session
        if session is not None:
            lines.append(f"k3chat: session {display_name(session.name)!r} is saved; resume it with: "
                         f"{self.resume_command} --session {session.id}")
        return lines

    def _shutdown_engine(self) -> None:
        if self.busy:
            return  # the worker still uses it; the process is about to end anyway
        self._close_conversation()
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def _install_signals(self) -> None:
        """SIGTERM (and SIGINT from outside: ctrl+c in the app is a key) go through the event
        loop; SIGHUP does not, because after a hangup the terminal is gone and the UI may be
        stuck writing to it (see _on_hangup)."""
        if threading.current_thread() is not threading.main_thread():
            return
        loop = asyncio.get_running_loop()
        handlers = {"SIGTERM": self._on_term_signal, "SIGINT": self._on_int_signal}
        for name, handler in handlers.items():
            sig = getattr(signal, name, None)
            if sig is None:
                continue
            try:
                loop.add_signal_handler(sig, handler)
                self._signals.append(sig)
            except (ValueError, RuntimeError, NotImplementedError):
                pass
        if hasattr(signal, "SIGHUP"):
            self._old_hup = signal.signal(signal.SIGHUP, self._on_hangup)

    def _remove_signals(self) -> None:
        if self._old_hup is not None:
            try:
                signal.signal(signal.SIGHUP, self._old_hup)
            except (ValueError, OSError):
                pass
            self._old_hup = None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        for sig in self._signals:
            try:
                loop.remove_signal_handler(sig)
            except (ValueError, RuntimeError):
                pass
        self._signals = []

    def _on_hangup(self, signum: int, frame: Any) -> None:
        """The terminal hung up. Stop the turn after the step in flight, let the worker store the
        partial answer (it no longer waits for the UI), then exit 5 without drawing anything."""
        if self._closed and self._quitting:
            os._exit(EXIT_INTERRUPTED)
        self._closed = True
        self._quitting = True

        def finish() -> None:
            if self._job_done.wait(HANGUP_WAIT) and self.conv is not None:
                self._save_state_quietly(self.conv)  # nobody to tell if it fails: the terminal is gone
            os._exit(EXIT_INTERRUPTED)

        # The exit is armed first: this handler runs inside whatever the main thread was doing,
        # and should the stop request below ever block there, the process still ends.
        threading.Thread(target=finish, name="k3chat-hangup", daemon=True).start()
        if not self._job_done.is_set() and self.conv is not None and not self._stop.requested.is_set():
            self._stop_turn()

    def _on_term_signal(self) -> None:
        self.call_later(self._save_and_quit, EXIT_INTERRUPTED)

    def _on_int_signal(self) -> None:
        self.call_later(self.action_interrupt)

    async def on_unmount(self) -> None:
        self._remove_signals()
        if self.busy and self._turn_worker is not None:  # closed without quitting (a test harness)
            if self.conv is not None:
                self.conv.cancel()
            self._closed = True
            try:
                await asyncio.wait_for(self._turn_worker.wait(), 30)
            except Exception:
                pass
            self.busy = False
        self._closed = True
        self._shutdown_engine()

    # ------------------------------------------------------------------ screens

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_sessions(self) -> None:
        if isinstance(self.screen, SessionsScreen):
            return
        current = self.conv.session_id if self.conv is not None else None
        self.push_screen(SessionsScreen(self.store, current=current, busy=self.busy), self.switch_session)

    async def action_new_session(self) -> None:
        if self.busy:
            self.say("K3 is answering: stop it (ctrl+c) or wait", warning=True)
            return
        await self.start_new_session()

    def open_viewer(self, block: ReasoningBlock) -> None:
        title = f"Reasoning: {block.tokens:,} tokens  (/ find, n next, N previous, c copy, escape back)"
        self.push_screen(ReasoningViewer(block.text, title))

    async def on_sessions_changed(self, event: SessionsChanged) -> None:
        if self.session is None or event.session_id != self.session.id:
            return
        if event.deleted:
            await self.start_new_session()
            return
        try:
            self.session = self.store.info(event.session_id)
        except HistoryError:
            return
        self.chat.set_title(self.session.name, self.engine.name if self.engine else None)

    # ------------------------------------------------------------------ settings from the palette

    def set_thinking(self, on: bool, effort: str | None = None) -> None:
        """The palette's "Thinking: ..." entries. When the new setting changes how the history
        is presented to the model (the effort is at the very start of the prompt), the next
        message re-reads the whole conversation: ask first, with the token count."""
        if self.busy:
            self.say("change thinking after this answer", warning=True)
            return
        new = (on, effort or self.effort)
        if new == (self.thinking, self.effort):
            self.say(f"This session already uses {thinking_label(*new)}")
            return
        conv = self.conv
        if conv is not None:
            problem = self._thinking_refused(conv, *new)
            if problem is not None:
                self.chat.show_notice(f"thinking not changed: {problem}", error=True)
                return
            reread = self._rereading(conv, *new)
            if reread:
                self.push_screen(ConfirmScreen(self._reread_question(conv, new, reread), yes="Change", no="Keep"),
                                 lambda yes: self._apply_thinking(*new) if yes else self.say("Thinking not changed"))
                return
        self._apply_thinking(*new)

    @staticmethod
    def _thinking_refused(conv: Conversation, on: bool, effort: str) -> str | None:
        """Why the next prompt would not fit with this setting, or None."""
        old = (conv.thinking, conv.effort)
        conv.thinking, conv.effort = on, effort
        try:
            conv.prompt_ids()
        except ContextOverflow as exc:
            return str(exc)
        except Exception:
            return None
        finally:
            conv.thinking, conv.effort = old
        return None

    def _rereading(self, conv: Conversation, on: bool, effort: str) -> int:
        """History tokens the next message must re-read because of the new setting (0: none)."""
        records = conv.records
        if not records or self.tokenizer is None:
            return 0
        try:
            before = history_ids(records, self.tokenizer, conv.thinking, conv.effort)
            after = history_ids(records, self.tokenizer, on, effort)
        except Exception:
            return 0
        same = common_prefix(before, after)
        return len(after) - same if same < len(before) else 0

    @staticmethod
    def _reread_question(conv: Conversation, new: tuple[bool, str], reread: int) -> str:
        speed = last_prefill_speed(conv.records)
        eta = f", about {max(1, round(reread / speed)):,} s at the last prefill speed" if speed else ""
        return (f"Switch to {thinking_label(*new)}? The model reads the conversation differently with this "
                f"setting, so your next message first re-reads all {reread:,} tokens of it{eta} (progress "
                "is shown).  y: switch, n: keep it as it is")

    def _apply_thinking(self, on: bool, effort: str) -> None:
        self.thinking, self.effort = on, effort
        conv = self.conv
        if conv is not None:
            conv.thinking, conv.effort = on, effort
            try:
                self.store.set_settings(conv.session_id, {"thinking": on, "effort": effort})
            except HistoryError as exc:
                self.say(f"{thinking_label(on, effort).capitalize()} is used, but not stored with the session: {exc}",
                         warning=True)
        self.chat.status.set_thinking(on, effort)
        self.say(f"{thinking_label(on, effort).capitalize()} from the next answer (kept with this session)")

    def action_session_settings(self) -> None:
        """ctrl+o: this session's settings dialog."""
        if isinstance(self.screen, SettingsScreen):
            return
        if self.busy:
            self.say("change the settings after this answer", warning=True)
            return
        conv = self.conv
        started = conv is not None and bool(conv.records)
        seed = conv.sampler.seed if conv is not None and self.chat_settings.seed is None else None
        self.push_screen(SettingsScreen(self.chat_settings, self.settings, self.system_prompt, started=started,
                                        session_seed=seed), self._settings_chosen)

    def _settings_chosen(self, chosen: tuple[Settings, str] | None) -> None:
        if chosen is None:
            return
        if self.busy:
            self.say("settings not changed: K3 is answering", warning=True)
            return
        own, system = chosen
        conv = self.conv
        notes = [self._apply_session_sampler(own)]
        started = conv is not None and bool(conv.records)
        if not started:
            self.system_prompt = system
        elif system != self.system_prompt:
            self._next_system = system
            notes.append("this conversation keeps its system prompt; the new one is used by the next new session "
                         "(ctrl+n)")
        self.say("; ".join(n for n in notes if n))

    def _apply_session_sampler(self, own: Settings) -> str:
        self.chat_settings = own
        conv = self.conv
        kept = "kept with this session"
        if conv is not None:
            self._give_sampler(conv, own)
            try:
                self.store.set_settings(conv.session_id, session_values(own))
            except HistoryError as exc:
                kept = f"used, but not stored with the session: {exc}"
        else:
            kept = "kept with the session your next message starts"
        self.chat.status.set_sampler(sampler_label(own))
        return f"Settings saved: {sampler_label(own)}, at most {own.max_tokens:,} tokens per answer ({kept})"

    def set_reasoning_display(self, mode: str) -> None:
        self.reasoning_display = mode
        for block in self.chat.query(ReasoningBlock):
            block.set_mode(mode)
        self.say(f"Reasoning blocks: {mode}")

    def toggle_vim_keys(self) -> None:
        self.vim_keys = not self.vim_keys
        if self.vim_keys:
            self.say("Vim-style movement on for this run: j/k next/previous block, g/G first/last, when a block "
                     "has the focus (tab). vim_keys = true in config.toml keeps it on.")
        else:
            self.say("Vim-style movement off")

    async def toggle_markdown(self) -> None:
        if self.busy:
            self.say("change the answer format after this answer", warning=True)
            return
        self.markdown = not self.markdown
        await self.chat.show_history(self.conv.records if self.conv is not None else [])
        self.say("Answers shown as Markdown" if self.markdown else "Answers shown as plain text")

    def view_last_reasoning(self) -> None:
        blocks = [t.reasoning for t in self.chat.transcript.turns() if t.reasoning is not None]
        if not blocks:
            self.say("no reasoning yet")
            return
        self.open_viewer(blocks[-1])

    def copy_last_answer(self) -> None:
        answer = self.chat.last_answer()
        if answer is None:
            self.say("no answer yet")
            return
        if not answer.text.strip():
            self.say("nothing to copy: the last answer is empty")
            return
        self.copy_to_clipboard(answer.text)
        self.say(f"Copied the answer ({len(answer.text):,} characters)")

    def export_current(self) -> None:
        if self.conv is None:
            self.say("nothing to export yet")
            return
        session_id = self.conv.session_id
        name = self.session.name if self.session is not None else session_id
        export_dialog(self, self.store, session_id, name, self.say)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("Sessions", "Browse, search, resume, rename, delete, export (ctrl+s)", self.action_sessions)
        yield SystemCommand("Attach file...", "Add a file to the next message: text, Markdown, code, CSV/TSV, JSON "
                            "or PDF (ctrl+l)", self.action_attach)
        yield SystemCommand("New session", "Start an empty conversation (ctrl+n)", self.action_new_session)
        yield SystemCommand("Help", "Every key (f1)", self.action_help)
        yield SystemCommand("Session settings", "System prompt, sampling, temperature, top-p, top-k, seed, max tokens "
                            "(ctrl+o)", self.action_session_settings)
        yield SystemCommand("Regenerate with a new seed", "The last answer again, sampled with a new seed so it can "
                            "differ (ctrl+r)", self.action_regenerate)
        current = " (current)"
        yield SystemCommand("Thinking: off" + (current if not self.thinking else ""), "Answer without reasoning",
                            partial(self.set_thinking, False))
        for effort in EFFORTS:
            mark = current if self.thinking and self.effort == effort else ""
            yield SystemCommand(f"Thinking: {effort}{mark}", f"Reason before answering, effort {effort} "
                                "(kept with this session)", partial(self.set_thinking, True, effort))
        for mode in DISPLAY_MODES:
            yield SystemCommand(f"Reasoning display: {mode}", {
                "expanded": "Keep reasoning blocks open",
                "auto": "Open while thinking, folded when the answer starts",
                "hidden": "Do not show reasoning"}[mode], partial(self.set_reasoning_display, mode))
        yield SystemCommand("Answers: Markdown / plain text", "Switch how answers are drawn", self.toggle_markdown)
        yield SystemCommand(f"Vim-style movement: {'off' if self.vim_keys else 'on'}",
                            "j/k, g/G between blocks of the transcript (for this run; vim_keys in config.toml)",
                            self.toggle_vim_keys)
        yield SystemCommand("View last reasoning", "Full screen, with search (v on a block)", self.view_last_reasoning)
        yield SystemCommand("Copy last answer", "To the clipboard", self.copy_last_answer)
        yield SystemCommand("Export this session", "Markdown, JSON or JSONL, private file", self.export_current)


def build_app(model_dir: str | Path | None, *, settings: Settings, demo: bool = False,
              engine_factory: EngineFactory | None = None, session: str | None = None,
              memory: str | None = None, threads: int | None = None, context: int | None = None,
              store: HistoryStore | None = None, thinking_given: bool = False,
              sampler_given: frozenset[str] = frozenset()) -> K3ChatApp:
    """The app for ``model_dir`` (or the demo model). ``session`` is an id or a name: resumed if
    it exists, else the name of the session the first message creates. ``engine_factory``
    replaces the way the model is opened (tests); the default plans ``memory`` and opens it.
    ``thinking_given``: the settings' thinking came from the command line, so it overrides
    the one the resumed session has stored. ``sampler_given``: the Settings fields of the
    sampler the command line gave; they win over every resumed session's stored ones."""
    if model_dir is None and not demo:
        raise AppUsageError("MODEL_DIR is required (or --demo, or `model` in config.toml)")
    if demo:
        model_dir = demo_model_dir()
    if engine_factory is None:
        engine_factory = partial(_default_factory, memory=memory or ("all" if demo else None), threads=threads,
                                 context=context)
    store = store or open_store()  # asks for the passphrase of an encrypted history
    info = find_session(store, session) if session else None
    if session is not None and info is None:
        from k3chat.history import _check_name

        try:
            _check_name(session)
        except HistoryError as exc:
            raise AppUsageError(f"--session: {exc}") from None
    return K3ChatApp(Path(model_dir) if model_dir is not None else None, settings=settings, demo=demo,
                     engine_factory=engine_factory, session=info,
                     new_session_name=session if info is None else None, store=store,
                     thinking_given=thinking_given, sampler_given=sampler_given)


def _default_factory(model_dir: Path, settings: Settings, progress: Callable[[str], None], *,
                     memory: str | None, threads: int | None, context: int | None) -> Engine:
    return open_engine(model_dir, settings, progress, memory=memory, threads=threads, context=context)


__all__ = ["K3ChatApp", "build_app", "AppUsageError", "session_name", "find_session"]
