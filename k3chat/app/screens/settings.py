"""The settings of one session: system prompt, sampling on/off, temperature, top-p, top-k, seed,
max tokens (ctrl+o, or "Session settings" in the palette). Values are checked by the same code
as the command line (k3chat.settings.merge_cli), so a value refused there is refused here with
the same reason; nothing is applied until every field is right."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, Input, Label, Static, TextArea

from k3chat.settings import Settings, SettingsError, merge_cli

from ..text import literal

# the session's own values, as stored in its {"k3chat": "settings"} lines (seed None: random)
SESSION_FIELDS = ("sampling", "temperature", "top_p", "top_k", "seed", "max_tokens")
NUMBER_FIELDS = (("temperature", "Temperature (> 0)"), ("top_p", "Top-p (0 to 1)"),
                 ("top_k", "Top-k (0 = off)"), ("seed", "Seed (empty: random)"),
                 ("max_tokens", "Max tokens per answer"))
STARTED_NOTE = ("This conversation has started, so it keeps its system prompt (a new one would mean "
                "re-reading the whole conversation under another instruction). A system prompt changed "
                "here is used by the next new session (ctrl+n).")
NEW_NOTE = "The system prompt starts this conversation: it is sent with your first message."


def session_values(settings: Settings) -> dict[str, Any]:
    """What a session stores of ``settings``."""
    return {name: getattr(settings, name) for name in SESSION_FIELDS}


def with_session_values(launch: Settings, stored: Mapping[str, Any]) -> Settings:
    """``launch`` with a session's stored values, each checked as the command line checks it
    (SettingsError says which value is wrong)."""
    given = {name: stored[name] for name in SESSION_FIELDS if name in stored}
    seed_cleared = "seed" in given and given["seed"] is None
    merged = merge_cli(launch, {"sampling": launch.sampling, **given})
    return dataclasses.replace(merged, seed=None) if seed_cleared else merged


def from_fields(launch: Settings, fields: Mapping[str, Any]) -> Settings:
    """The dialog's text fields as Settings (an empty seed means random); SettingsError names
    the field that is wrong."""
    values = {name: (value.strip() if isinstance(value, str) else value) for name, value in fields.items()}
    if values.get("seed") == "":
        values["seed"] = None
    try:
        return with_session_values(launch, values)
    except SettingsError as exc:
        raise SettingsError(_field_message(exc)) from None


def _field_message(exc: SettingsError) -> str:
    labels = {"--" + name.replace("_", "-"): label for name, label in NUMBER_FIELDS}
    text = str(exc)
    for option, label in labels.items():
        if text.startswith(option + ":"):
            return f"{label.split(' (')[0]}:{text[len(option) + 1:]}"
    return text


def sampler_label(settings: Settings) -> str:
    """The status bar's short form of a session's sampler."""
    if not settings.sampling:
        return "greedy"
    parts = [f"t {settings.temperature:g}", f"p {settings.top_p:g}"]
    if settings.top_k:
        parts.append(f"k {settings.top_k}")
    return "sampling " + " ".join(parts)


class SettingsScreen(ModalScreen["tuple[Settings, str] | None"]):
    """enter in a field or ctrl+s saves, escape cancels. Returns (settings, system prompt)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save", priority=True)]

    def __init__(self, current: Settings, launch: Settings, system: str, *, started: bool,
                 session_seed: int | None = None) -> None:
        super().__init__(classes="dialog")
        self.current, self.launch, self.system, self.started = current, launch, system, started
        self.session_seed = session_seed

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog-box", id="settings-box"):
            yield Static("Settings of this session (kept with it; enter or ctrl+s saves, escape cancels)",
                         classes="dialog-text", markup=False)
            yield Label("System prompt")
            yield TextArea(self.system, id="system", soft_wrap=True)
            yield Static(STARTED_NOTE if self.started else NEW_NOTE, classes="dialog-text", id="system-note",
                         markup=False)
            yield Checkbox("Sample (off: greedy, the same answer every time)", self.current.sampling, id="sampling")
            for name, label in NUMBER_FIELDS:
                with Horizontal(classes="settings-row"):
                    yield Label(label)
                    yield Input(self._shown(name), id=name, placeholder=self._placeholder(name))
            yield Static("", id="settings-error", classes="dialog-text", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button("Save", id="save", variant="primary")
                yield Button("Cancel", id="cancel")

    def _shown(self, name: str) -> str:
        value = getattr(self.current, name)
        return "" if value is None else str(value)

    def _placeholder(self, name: str) -> str:
        if name != "seed":
            return ""
        return f"random (this session: {self.session_seed})" if self.session_seed is not None else "random"

    def on_mount(self) -> None:
        self.query_one("#settings-error").display = False
        self.query_one("#system", TextArea).focus()

    def fields(self) -> dict[str, Any]:
        values: dict[str, Any] = {name: self.query_one(f"#{name}", Input).value for name, _ in NUMBER_FIELDS}
        values["sampling"] = self.query_one("#sampling", Checkbox).value
        return values

    def action_save(self) -> None:
        try:
            settings = from_fields(self.launch, self.fields())
        except SettingsError as exc:
            error = self.query_one("#settings-error", Static)
            error.update(literal(f"Not saved: {exc}"))
            error.display = True
            return
        self.dismiss((settings, self.query_one("#system", TextArea).text))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.action_save()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        else:
            self.dismiss(None)

    def action_cancel(self) -> None:
        self.dismiss(None)


__all__ = ["SettingsScreen", "SESSION_FIELDS", "session_values", "with_session_values", "from_fields",
           "sampler_label"]
