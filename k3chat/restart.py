"""Starting `k3chat chat` again with a larger context (no Textual).

When a message does not fit, the app can offer to restart the session with the context and
memory the planner suggests (k3chat.context_fit). The app then saves, exits with a
RestartRequest, and the command line re-executes itself with ``restart_argv``. The typed
message survives the restart in a draft file in the state directory (0600 in a 0700
directory, sealed when the history is encrypted): message text never goes on a command line,
where `ps` would show it. The new app reads the draft and deletes it (``take_draft``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from k3engine.private_files import write_private

from . import paths

DRAFT_NAME = "restart-draft.json"
_SEALED = b"k3chat-restart-draft"  # what a sealed draft is bound to
_PLAIN_HEAD, _SEALED_HEAD = b"plain\n", b"sealed\n"  # the first line says which
REPLACED = ("--session", "--context", "--memory")


class Sealer(Protocol):
    def seal(self, plaintext: bytes, associated: bytes) -> bytes: ...

    def open(self, blob: bytes, associated: bytes) -> bytes: ...


@dataclass(frozen=True)
class Draft:
    """The message that was not sent: its text and its files (history entries, token counts)."""
    text: str
    attachments: tuple[Mapping[str, Any], ...] = ()
    tokens: tuple[int | None, ...] = ()


@dataclass(frozen=True)
class RestartRequest:
    session: str | None  # the session to resume (None: a new one; nothing was saved)
    context: int
    memory: str | None  # a --memory value (None: keep the one given, if any)
    draft: Draft = field(default_factory=lambda: Draft(""))


def restart_argv(argv: Sequence[str], request: RestartRequest) -> list[str]:
    """``argv`` (the arguments after `k3chat`) with --session, --context and --memory replaced
    by the request's (each dropped in either spelling, ``--x V`` or ``--x=V``); every other
    argument kept in its place. --memory is kept when the request has none."""
    replaced = tuple(name for name in REPLACED if name != "--memory" or request.memory is not None)
    kept: list[str] = []
    words = list(argv)
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--":  # what follows is not an option
            kept += words[i:]
            break
        if word in replaced:
            i += 2
            continue
        if any(word.startswith(name + "=") for name in replaced):
            i += 1
            continue
        kept.append(word)
        i += 1
    added = ["--context", str(request.context)]
    if request.memory is not None:
        added += ["--memory", request.memory]
    if request.session is not None:
        added += ["--session", request.session]
    at = kept.index("--") if "--" in kept else len(kept)
    return kept[:at] + added + kept[at:]


def draft_path() -> Path:
    return paths.state_dir() / DRAFT_NAME


def hand_over(draft: Draft, sealer: Sealer | None) -> Path:
    """Write ``draft`` for the next app start (0600 in the 0700 state directory)."""
    data = json.dumps({"text": draft.text, "attachments": [dict(a) for a in draft.attachments],
                       "tokens": list(draft.tokens)}).encode("utf-8")
    data = _PLAIN_HEAD + data if sealer is None else _SEALED_HEAD + sealer.seal(data, _SEALED)
    path = draft_path()
    paths.ensure_private_dir(path.parent)
    write_private(path, data)
    return path


def take_draft(sealer: Sealer | None) -> Draft | None:
    """The draft a restart left (deleted once read), or None. Raises ValueError (kept on disk)
    when it cannot be read, so the text is not lost."""
    path = draft_path()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(f"the message kept across the restart ({path}) could not be read: {exc}") from None
    try:
        if data.startswith(_SEALED_HEAD):
            if sealer is None:
                raise ValueError("it is encrypted and the history is not unlocked")
            data = sealer.open(data[len(_SEALED_HEAD):], _SEALED)
        elif data.startswith(_PLAIN_HEAD):
            data = data[len(_PLAIN_HEAD):]
        else:
            raise ValueError("not a draft file")
        doc = json.loads(data.decode("utf-8"))
        draft = Draft(text=str(doc["text"]), attachments=tuple(doc.get("attachments", ())),
                      tokens=tuple(doc.get("tokens", ())))
    except Exception as exc:
        raise ValueError(f"the message kept across the restart ({path}) could not be read ({exc}); "
                         "it is left there") from None
    os.unlink(path)
    return draft


__all__ = ["Draft", "RestartRequest", "restart_argv", "hand_over", "take_draft", "draft_path"]
