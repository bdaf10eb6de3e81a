"""k3chat's themes (Textual's Theme API) and its stylesheet (package data in k3chat.themes).

The stylesheet uses only theme variables ($primary, $surface, ...), so any Textual theme
works with it; ``default`` in config.toml means ``k3-dark``.

The theme chosen in the palette is remembered in a small private file beside config.toml
(``app-state.json``, 0600; config.toml itself, comments and all, is never rewritten). It is
used while config.toml's ``theme`` stays what it was when the choice was made: editing that
line later means the file wins again.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Any

from textual.theme import Theme

from k3chat import paths

DEFAULT_THEME = "k3-dark"
STYLESHEET = "k3chat.tcss"
APP_STATE_FILE = "app-state.json"  # in the config directory

THEMES: tuple[Theme, ...] = (
    Theme(
        name="k3-dark",
        primary="#5FA8D3",
        secondary="#8FB3A8",
        accent="#D9A55B",
        warning="#D9A55B",
        error="#E06C6C",
        success="#8DBF7A",
        foreground="#D8DEE4",
        background="#111418",
        surface="#181C21",
        panel="#20262D",
        dark=True,
        variables={"footer-key-foreground": "#5FA8D3"},
    ),
    Theme(
        name="k3-light",
        primary="#1F5F8B",
        secondary="#3E6E62",
        accent="#9A5B00",
        warning="#9A5B00",
        error="#B3261E",
        success="#2E6B1F",
        foreground="#1C2126",
        background="#F7F7F4",
        surface="#EFEFEA",
        panel="#E2E4DE",
        dark=False,
    ),
)


def stylesheet() -> str:
    """The app's stylesheet, read from the installed package (works from a wheel too)."""
    return resources.files("k3chat.themes").joinpath(STYLESHEET).read_text(encoding="utf-8")


def resolve_theme(name: str, available: Iterable[str]) -> tuple[str, str | None]:
    """(theme to use, a warning or None) for the name in config.toml."""
    if name in ("default", ""):
        return DEFAULT_THEME, None
    if name in set(available):
        return name, None
    return DEFAULT_THEME, f"unknown theme {name!r}; using {DEFAULT_THEME}"


def app_state_path() -> Path:
    return paths.config_dir() / APP_STATE_FILE


def _read_app_state(path: Path) -> dict[str, Any]:
    """The remembered choices; a missing or damaged file is nothing remembered."""
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def remembered_theme(configured: str, path: Path | None = None) -> str | None:
    """The theme last chosen in the palette, unless config.toml's ``theme`` has changed since."""
    doc = _read_app_state(path or app_state_path())
    theme = doc.get("theme")
    if doc.get("config_theme") != configured or not isinstance(theme, str):
        return None
    return theme


def remember_theme(theme: str, configured: str, path: Path | None = None) -> None:
    """Remember ``theme`` (chosen while config.toml said ``configured``); OSError if it cannot."""
    path = path or app_state_path()
    paths.ensure_private_dir(path.parent)
    doc = _read_app_state(path)
    doc.update(theme=theme, config_theme=configured)
    paths.atomic_write(path, (json.dumps(doc, indent=1) + "\n").encode("utf-8"))
